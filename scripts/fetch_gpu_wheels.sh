#!/usr/bin/env bash
# Fill .whl/ with the wheels benchmarks/gpu_check.sh installs on the lent GPU machine (Python
# 3.12, x86-64, no network there). Its image has torch, triton, transformers, tokenizers,
# safetensors, numpy, tqdm, msgpack and uvloop; stoker's engine path also needs msgspec, and the
# services need pyzmq, starlette, uvicorn (their own needs, anyio, h11 and click, are there) and
# httptools (uvicorn's faster parser; without it uvicorn falls back to h11).
# Versions match this checkout's .venv. .whl/ is git-ignored; carry it to the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
  manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
PY=${PYTHON:-python3}
"$PY" -m pip download -q "${args[@]}" msgspec==0.23.0 pyzmq==27.3.0 starlette==1.10.0 \
  uvicorn==0.54.0 httptools==0.9.0
ls -l .whl
