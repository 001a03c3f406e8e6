#!/usr/bin/env bash
# Create .venv and install stoker with its test extras. Idempotent: reinstalls only when
# pyproject.toml or setup.py changes. torch is pinned to the CPU build in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.stoker-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  # Build the native CPU kernels now rather than on the first request (cached afterwards).
  .venv/bin/python -c "from stoker.kernels import cpu_ops; cpu_ops.load()"
  echo "$want" > "$stamp"
fi

# --- chromium, for tests/observability/test_dashboard.py (begin) ---
# The dashboard test drives Debian's chromium through playwright (in the test extra; its own
# browser download is never used). Installed with apt only where /usr/bin/chromium is missing.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup: /usr/bin/chromium is missing (install Debian's chromium as root);" \
      "tests/observability/test_dashboard.py will be skipped"
  else
    apt_chromium() {
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        chromium fonts-dejavu-core
    }
    echo "setup: apt-get install chromium fonts-dejavu-core (for the dashboard test)"
    if ! apt_chromium; then
      echo "setup: apt-get install failed: apt-get update, then once more"
      DEBIAN_FRONTEND=noninteractive apt-get update -q
      apt_chromium
    fi
  fi
fi
# --- chromium (end) ---
