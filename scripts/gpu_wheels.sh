#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for the whole device test stage of `make gpu-check`: the
# packages of the serve, fms and dev extras that its image (Python 3.12, no network) does not hold,
# at the versions this project's venv runs, for Python 3.12 on x86-64 Linux.
#   bash scripts/gpu_wheels.sh [DIR]     # -> DIR (default .whl); then, there:
#   GPU_CHECK_WHEELS=DIR bash scripts/gpu_check.sh OUTDIR   # installs DIR's wheels first
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
names=(ibm-fms fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn
       xgrammar apache-tvm-ffi openai httpx2 jiter sniffio jsonschema jsonschema-specifications
       referencing rpds-py httpcore2 truststore opentelemetry-api typing-extensions)
mapfile -t specs < <("$py" -c 'import sys; from importlib.metadata import version
for n in sys.argv[1:]: print(f"{n}=={version(n)}")' "${names[@]}")
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${specs[@]}"
echo "[gpu-wheels] ${#specs[@]} wheels in $dir ($(du -sh "$dir" | cut -f1))"
