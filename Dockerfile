# CPU image by default. Build it with `make docker` (see the README's Docker section): online, from a
# local wheelhouse (air-gapped), behind a TLS-inspecting proxy (EXTRA_CA_CERT), or on a CUDA base:
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t fms-paged:cuda .
# The install steps are the Makefile's own (`make install`), the same ones CI runs.
#
# Stages: `system` (the OS packages and the user), `runtime` (what running needs: the package with
# its bench, serve and fms extras; the default image), `test` (runtime plus the dev and notebooks
# extras, for `make test`: docker build --target test -t fms-paged:test .).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS system

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/app/docker/wheelhouse \
    PATH=/app/.venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# What the image needs at run time as well as to build: make (the benchmark targets), a C++ compiler
# and the headers of the Python that runs (inductor compiles its CPU kernels, flex_attention among
# them, when a process first runs them, and they include Python.h). A base whose python3 lacks
# Python.h gets python3-dev; a base without python3 gets one; a base that has them is left alone.
# DL3008: versions come from the base image's distribution, which the BASE_IMAGE argument changes, so
# they cannot be pinned here. SC2086: $pkgs is a word list and must be split.
# hadolint ignore=DL3008,SC2086
RUN pkgs=""; \
    command -v make >/dev/null || pkgs="$pkgs make"; \
    command -v g++ >/dev/null || pkgs="$pkgs g++"; \
    if ! command -v python3 >/dev/null; then \
        pkgs="$pkgs python3 python3-venv python3-dev"; \
    else \
        python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || pkgs="$pkgs python3-dev"; \
        python3 -c 'import ensurepip' 2>/dev/null || pkgs="$pkgs python3-venv"; \
    fi; \
    if [ -z "$pkgs" ]; then \
        echo "fms-paged image: the base has make, g++ and its Python's headers: nothing to install"; \
    else \
        echo "fms-paged image: installing$pkgs"; \
        command -v apt-get >/dev/null \
            || { echo "this base has no apt-get: give it make, g++ and its python3's headers" >&2; exit 1; }; \
        apt-get update \
        && apt-get install -y --no-install-recommends $pkgs \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import os, sysconfig; h = os.path.join(sysconfig.get_paths()["include"], "Python.h"); assert os.path.exists(h), h'

# Runs as a user of its own; the virtual environment belongs to it (no copy of it in another layer).
RUN useradd --create-home --uid 1000 app && install -d -o app /app
USER 1000:1000
WORKDIR /app

FROM system AS runtime
# TORCH_INDEX_URL: the index torch comes from; empty means docker/wheelhouse/ first, then PyPI (whose
# default torch is the multi-GB CUDA build: a CPU image wants the wheelhouse or the CPU index).
# EXTRA_CA_CERT: a PEM file in the build context that pip must trust too (a proxy that re-signs TLS).
# PIP_NO_INDEX=1: an air-gapped build, every wheel from docker/wheelhouse (unset: indexes are asked).
ARG TORCH_INDEX_URL=
ARG EXTRA_CA_CERT=
ARG PIP_NO_INDEX
COPY --chown=1000:1000 . .
# The runtime extras only: bench (the default command), serve (`fms-paged serve`), fms (`--loader
# fms`). xgrammar (serve) requires Triton, ~1 GB installed, which only its CUDA bitmask kernel
# imports; its CPU path never does, so a torch without CUDA drops it in this same layer.
RUN if [ -n "${EXTRA_CA_CERT}" ]; then \
        cat /etc/ssl/certs/ca-certificates.crt "${EXTRA_CA_CERT}" > /home/app/ca-bundle.pem; \
        export PIP_CERT=/home/app/ca-bundle.pem; \
    fi; \
    make install EXTRAS=bench,serve,fms TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
    && if python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then \
        python -m pip uninstall -y -q triton; \
    fi

# `docker run -p 8000:8000 fms-paged fms-paged serve --host 0.0.0.0` serves the OpenAI API
EXPOSE 8000
CMD ["make", "bench-llama-paged"]

FROM runtime AS test
ARG PIP_NO_INDEX
# The test tools on top (pytest, ruff, hadolint, lm-eval, the openai client; the notebooks' kernel),
# the torch of the runtime stage kept; pip trusts the proxy's CA the runtime stage was given.
RUN if [ -f /home/app/ca-bundle.pem ]; then export PIP_CERT=/home/app/ca-bundle.pem; fi; \
    python -m pip install -q -e '.[dev,notebooks]' "torch==$(python -c 'import torch; print(torch.__version__)')"
CMD ["make", "test"]

# The default target (a build without --target): the runtime image.
FROM runtime
