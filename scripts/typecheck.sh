#!/usr/bin/env bash
# Type-check common/ and the scheduler with mypy ([tool.mypy] in pyproject.toml). The folders
# import each other as stoker.<folder> (setup.py maps them), a layout that exists only once
# installed, so mypy reads them through a tree of links laid out the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/stoker"
ln -s "$repo/stoker/"*.py "$tree/stoker/"
for folder in common kernels services tools models; do ln -s "$repo/$folder" "$tree/stoker/$folder"; done
cd "$tree"
"$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.venv/mypy-cache" \
  -p stoker.common -p stoker.services.scheduler "$@"
