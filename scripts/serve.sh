#!/usr/bin/env bash
# Set up (if needed) and serve the bundled default model on http://127.0.0.1:8000.
# Extra arguments go to `stoker serve` (see `stoker serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/stoker serve "$@"
