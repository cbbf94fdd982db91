# CPU image by default. For CUDA:
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t fms-paged:cuda .
# The install steps are the Makefile's own (`make install`), the same ones CI runs.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    TORCH_INDEX_URL=${TORCH_INDEX_URL}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# make + a C++ compiler (inductor's CPU flex_attention kernels); a Python only when the base has none.
# DL3008: versions come from the base image's distribution, which the BASE_IMAGE argument changes, so
# they cannot be pinned here. SC2086: $pkgs is a word list and must be split.
# hadolint ignore=DL3008,SC2086
RUN pkgs="make g++ git"; \
    if ! command -v python3 >/dev/null; then pkgs="$pkgs python3 python3-venv python3-dev"; fi; \
    apt-get update \
    && apt-get install -y --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
RUN make install TORCH_INDEX_URL="${TORCH_INDEX_URL}"

CMD ["make", "bench-llama-paged"]
