#!/usr/bin/env bash
# The GPU checks of issue 7 in one run of under 8 minutes on a lent H200 (nvidia-h200: Python
# 3.12 with torch, triton, transformers, pytest; no network). Phases, each its own process under
# a hard timeout, so one failing or hanging leaves the others' results (benchmarks/gpu_check.py
# runs one; each is a module of benchmarks/gpu_phases/):
#   model       the Qwen3-0.6B-shaped random-init bf16 folder (hidden 1024, 28 layers, 16/8
#               heads of 128, intermediate 3072, vocab 151936, tied) with a word tokenizer
#   kernels     the triton kernel tests (tests/kernels, compiled on the GPU) through pytest:
#               every kernel against its torch reference (bf16/fp32, GQA 1/4/8, head dim
#               64/128, block size 16/32, with the slow sweeps), one record per test and kernel
#   hf          greedy agreement with HF in bf16, tolerance-based on logits
#   decode      batch-1 decode ms/token with and without CUDA graphs
#   throughput  nano-vllm workload: 256 requests, in/out lengths uniform 100-1024, seed 0
#   serve       `stoker serve --device cuda` over HTTP: one completion, bench serve at 128
#               streams, no KV block leaked (its log comes back as serve.log)
#   timing      decode attention / RMSNorm / rotary / the sampling race against the copy-bandwidth
#               floor
#   paths       n-gram speculation, prefix caching and preemption, each against plain greedy in
#               float32: identical tokens
#   profile     torch.profiler's top kernels (batch-1 decode, a slice of the workload) and
#               cProfile of eager batch-1 forwards (profile_*.txt come back beside the JSON)
# Results: $OUT/gpu_check.json (every phase, with exit status and wall time) and
# $OUT/gpu_check.log. Exit status 0 only if every phase run passed. `--phase decode,profile` (or
# GPU_CHECK_PHASES="decode profile") runs only the phases named, in the plan's order, with the
# model phase first where the folder is not built yet; `--kernels rotary,race` (or
# GPU_CHECK_KERNELS) only those kernels' tests.
#
# The image lacks msgspec (stoker's message structs, imported on the engine path), pyzmq,
# starlette, uvicorn and httptools. Fill .whl/ here first (git-ignored) with scripts/fetch_gpu_wheels.sh,
# which runs exactly:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl msgspec==0.23.0 pyzmq==27.3.0 starlette==1.10.0 \
#     uvicorn==0.54.0 httptools==0.9.0
# Then, with the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"],
# timeout_s=540).
#
# On CPU: `PYTHON=.venv/bin/python benchmarks/gpu_check.sh --smoke` runs every phase at tiny
# shapes (no wheels installed; TRITON_INTERPRET=1 adds the kernel tests under the interpreter).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=()
ONLY=${GPU_CHECK_PHASES:-}  # e.g. "model decode profile": a re-run of a few phases
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=(--smoke) ;;
    --phase | --phases) ONLY=${2:-}; shift ;;
    --phase=* | --phases=*) ONLY=${1#*=} ;;
    --kernels) export GPU_CHECK_KERNELS=${2:-}; shift ;;
    --kernels=*) export GPU_CHECK_KERNELS=${1#*=} ;;
    *) echo "usage: $0 [--smoke] [--phase a,b,...] [--kernels a,b,...]" >&2; exit 2 ;;
  esac
  shift
done
ONLY=${ONLY//,/ }
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/.gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/stoker-gpu-check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}  # all phases together; the device command limit is 600
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/*.json "$WORK"/*.rc "$WORK"/profile_*.txt "$WORK"/serve.log
LOG=$OUT/gpu_check.log
exec > >(tee "$LOG") 2>&1
start=$SECONDS

if [ ${#SMOKE[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  # As the device README says: into /tmp/site, first on PYTHONPATH.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Only `stoker` on the path (a link to the checkout's stoker/, whose __init__ maps the folders
# beside it): the repo root itself would put its kernels/ ahead of Hugging Face's `kernels`.
mkdir -p "$WORK/path" && ln -sfn "$PWD/stoker" "$WORK/path/stoker"
export PYTHONPATH=$WORK/path${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
torch.version.cuda, "transformers", transformers.__version__)'
"$PY" -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "no triton"

# phase, cap in seconds; each gets min(cap, what is left of the budget).
PLAN=("model 90" "kernels 150" "hf 90" "decode 90" "throughput 150" "serve 120" "timing 60"
  "paths 120" "profile 120")
NAMES=" ${PLAN[*]/% [0-9]*/} "
for name in $ONLY; do
  [[ $NAMES == *" $name "* ]] || { echo "unknown phase $name; phases:$NAMES" >&2; exit 2; }
done
# All but kernels and timing read the model folder: build it first where it is not there yet.
if [ ! -f "$WORK/model/config.json" ] && [[ " $ONLY " != *" model "* ]]; then
  for name in $ONLY; do
    [[ " kernels timing " == *" $name "* ]] || { ONLY="model $ONLY"; break; }
  done
fi
for entry in "${PLAN[@]}"; do
  read -r phase cap <<<"$entry"
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $phase "* ]]; then
    continue
  fi
  left=$((BUDGET_S - (SECONDS - start)))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    echo "== $phase: skipped, budget spent"
    echo "skipped 0" >"$WORK/$phase.rc"
    continue
  fi
  echo "== $phase (limit ${limit}s) at +$((SECONDS - start))s"
  t0=$SECONDS
  timeout -k 10 "$limit" "$PY" benchmarks/gpu_check.py "$phase" --work "$WORK" "${SMOKE[@]}"
  rc=$?
  echo "$rc $((SECONDS - t0))" >"$WORK/$phase.rc"
  echo "== $phase: exit $rc after $((SECONDS - t0))s"
done
[ -f "$WORK/serve.log" ] && tail -c 200000 "$WORK/serve.log" >"$OUT/serve.log"
for f in "$WORK"/profile_*.txt; do [ -f "$f" ] && cp "$f" "$OUT/"; done
"$PY" benchmarks/gpu_check.py merge --work "$WORK" --out "$OUT/gpu_check.json"
rc=$?
echo "== total $((SECONDS - start))s; results in $OUT/gpu_check.json"
exit $rc
