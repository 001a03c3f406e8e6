# stoker: one image for every service; compose picks the command.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
# A C++ compiler for the native CPU kernels (kernels/csrc). They build on the worker's first start
# for the CPU the container runs on (-march=native), not at image build time, so an image built
# on one machine never carries instructions another lacks. Without it the torch references run.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The CPU build of torch first, from PyTorch's CPU index, so nothing pulls a CUDA build.
# For a GPU image, swap the base for a CUDA one and drop --index-url.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY common ./common
COPY kernels ./kernels
COPY services ./services
RUN pip install .

# The bundled default model, baked in. Compose mounts a named volume here, which Docker fills
# from the image on first use; mount your own folder over it to serve another model.
COPY models /models

EXPOSE 8000
CMD ["stoker", "serve", "--model", "/models/stoker-tiny", "--host", "0.0.0.0"]
