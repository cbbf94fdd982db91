#!/usr/bin/env bash
# make gpu-check: prove the CUDA path on a lent GPU machine in under ten minutes.
#   bash scripts/gpu_check.sh OUTDIR                       # on the GPU machine
#   bash scripts/gpu_check.sh OUTDIR --device cpu --tiny   # the dry run (CI runs it)
# Uses the machine's own torch (PYTHON, default python3) and never installs torch: where the package
# is not importable it is installed from this checkout without dependencies and without the network.
# Stages, results and exit status: scripts/gpu_check/check.py (its stages: scripts/gpu_check/, run
# from the checkout's root as `python -m scripts.gpu_check.<stage>`; the wheel does not ship them).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR [--device cpu --tiny] [--stages tests,exact,kernels,bench]}
shift
py=${PYTHON:-python3}
[[ $py == */* && $py != /* ]] && py="$PWD/$py"  # relative to the checkout: still valid from / (a
                                               # venv's python is a link: keep it, do not resolve it)
mkdir -p "$out"
start=$SECONDS
# GPU_CHECK_WHEELS=DIR: install DIR's wheels (scripts/gpu_wheels.sh: the extras' packages the
# machine lacks) into a folder of their own on PYTHONPATH, without the network
if [[ -n ${GPU_CHECK_WHEELS:-} ]]; then
    site=/tmp/fms-paged-gpu-site
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$GPU_CHECK_WHEELS"/*.whl \
        || exit 2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd / && "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('fms_paged') is None)"); then
    echo "[gpu-check] installing fms_paged from $(pwd) (no dependencies, no network)"
    "$py" -m pip install -q --no-deps --no-build-isolation --no-index . || exit 2
fi
"$py" -c "import torch, fms_paged; print(f'[gpu-check] torch {torch.__version__}, CUDA {torch.version.cuda}, '
          f'GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else None}, '
          f'fms_paged from {fms_paged.__file__}')" || exit 2
"$py" -m scripts.gpu_check.check "$out" "$@"
rc=$?
echo "[gpu-check] exit $rc after $((SECONDS - start)) s; results in $out"
exit $rc
