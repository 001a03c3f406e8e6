#!/usr/bin/env bash
# Set up (if needed), lint, and run the test suite. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m slow` for the long tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
scripts/typecheck.sh
.venv/bin/python -m pytest "$@"
