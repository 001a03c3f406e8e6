#!/usr/bin/env bash
# Create .venv and install stoker with its test extras. Idempotent: reinstalls only when
# pyproject.toml changes. torch is pinned to the CPU build in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.stoker-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  # Build the native CPU kernels now rather than on the first request (cached afterwards).
  .venv/bin/python -c "from kernels import cpu_ops; cpu_ops.load()"
  echo "$want" > "$stamp"
fi
