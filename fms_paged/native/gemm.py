"""The rules by which the operator `fms_paged::linear` picks its path (the GEMV kernel, oneDNN's
packed GEMM, or ATen), and which dtype oneDNN's packed GEMMs compute in here: what `configure`
hands the operators when they load (`fms_paged.modules.linear` explains the paths).

`PACK_DTYPES` is found out on first use, not at import: it runs one small packed GEMM per
half-precision dtype through oneDNN.
"""

from __future__ import annotations

import os

import torch

from fms_paged.native.build import ELEM_TYPES, cpu_flags, isa

# a call with at most this many rows (a decode step of up to 8 sequences) runs the project's GEMV
# kernel (`csrc/kernels/gemv.cpp`): it streams each weight row once and costs less per call than
# oneDNN, so it reads the weights closer to the memory bandwidth up to about this many rows; past
# it oneDNN's blocked GEMM leads (docs/benchmarks.md has the measurements)
GEMV_MAX_ROWS = 8
# otherwise a call packs when its weight (a stack's: all of them) has this many elements (64 KiB
# of fp32) ... : past a tiny weight, oneDNN's packed GEMM costs less per call than at::linear (and
# a stack then runs as one call, not one at::linear each and a cat); docs/design.md has the figures
PACK_MIN_WEIGHT = 1 << 14
# ... or when it has this many rows
PACK_MIN_ROWS = 256

# past the GEMV's rows: "own", the project's GEMM kernel (`csrc/kernels/gemm.cpp`) on the plain
# weights the GEMV reads (each weight held once); "packed", oneDNN's GEMM on a packed copy of each
# weight kept beside it (fp32 for fp16 weights where oneDNN has no fp16 GEMM: held three times).
# `$FMS_PAGED_GEMM` chooses; by default `default_gemm()`, by the CPU
GEMMS = ("packed", "own")
# whether this torch build has oneDNN (read once: Dynamo cannot trace the query)
ONEDNN = torch.backends.mkldnn.is_available()


def default_gemm() -> str:
    """The GEMM `linear` takes past the GEMV's rows unless `$FMS_PAGED_GEMM` says: "own" where the
    kernels are built for AVX-512 (`isa()` "native" on an x86 CPU with avx512f), the CPU has no
    AMX (amx_bf16 / amx_tile) and torch has oneDNN; "packed" otherwise. The rule follows the
    measurements (docs/benchmarks.md, "Weights held once"; 2-vCPU Zen 4, AVX512_BF16, no AMX):
    there steady RSS drops by the packed copies (1.44x -> 1.12x llama.cpp's, Gemma 3 270M in
    bf16) while the kernel's AVX-512 build takes about oneDNN's time (16-stream decode steps
    0.88-1.01x, 64-token prefills 0.94-1.02x, 512-token prefills 0.99x in bf16 and 1.09-1.12x in
    fp32, SmolLM2-135M and the default model); its AVX2 build took ~1.4x oneDNN's time, and with
    AMX oneDNN computes on tiles the kernel does not use. So a build for less than the CPU has
    (`$FMS_PAGED_CPU_ISA` avx2 or baseline) keeps "packed" by default, as a CPU without AVX-512
    would; "own" asked for there runs the GEMM kernel of that build. Without oneDNN "packed" means
    ATen's GEMM on the plain weights (nothing packed either)."""
    try:
        native = isa() == "native"
    except ValueError:  # (a bad `$FMS_PAGED_CPU_ISA` is refused where the kernels are built)
        native = False
    flags = cpu_flags()  # (Arm's features have no avx512f)
    amx = bool({"amx_bf16", "amx_tile"} & flags)
    return "own" if native and "avx512f" in flags and not amx and ONEDNN else "packed"


# with "own", the most rows the GEMV kernel takes, per dtype (GEMV_MAX_ROWS where not named): the
# rule's one place (`native.configure` hands it to the operators; the GEMM kernel itself takes
# calls of any row count). bf16 calls under 32 rows stay on the GEMV: its streamed reads beat
# oneDNN's packed GEMM there (a 16-stream bf16 decode of SmolLM2-135M: 0.85-0.88x its time) and
# take about the GEMM kernel's time, whose panels' packing is spread over few rows; in fp32 the
# panels were level with oneDNN at 16 rows and the GEMV 1.06x (docs/design.md, "One layout
# instead"; the figures in docs/benchmarks.md, "Weights held once")
OWN_GEMV_MAX_ROWS = {torch.bfloat16: 31}

GEMM = os.environ.get("FMS_PAGED_GEMM") or default_gemm()
if GEMM not in GEMMS:
    raise ValueError(f"FMS_PAGED_GEMM={GEMM!r}; expected one of {GEMMS}")
# the dtypes the CPU paths serve: the kernels' (a tuple: a trace may test a dtype's membership)
DTYPES = tuple(ELEM_TYPES)


def onednn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes packed GEMMs in `dtype` on this CPU: torch's check of the CPU's ISA
    (bf16: AVX512_BF16 or AMX; fp16: AVX512_FP16 or AMX-FP16), then one small packed GEMM against
    fp32, so that a torch build whose half-precision path fails here falls back to fp32 instead
    of failing a model's first call."""
    if not ONEDNN:
        return False
    if dtype == torch.float32:
        return True
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    if not getattr(torch.ops.mkldnn, checks[dtype])():
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(4, 64, generator=g)
    try:
        y = torch.ops.mkldnn._linear_pointwise(
            x.to(dtype), torch.ops.mkldnn._reorder_linear_weight(w.to(dtype)), None, "none", [], "")
    except RuntimeError:
        return False
    ref = x.to(dtype).double() @ w.to(dtype).double().T  # |y| ~ 8: a few of dtype's ulps
    return bool(((y.double() - ref).abs() <= 0.1).all())


class _PackDtypes(dict):
    """dtype served -> the dtype of its packed weights here (`onednn_native`, probed on a dtype's
    first lookup and kept; KeyError for a dtype the CPU paths do not serve)."""

    def __missing__(self, dtype: torch.dtype) -> torch.dtype:
        if dtype not in DTYPES:
            raise KeyError(f"the CPU paths serve {', '.join(map(str, DTYPES))}, not {dtype}")
        self[dtype] = dtype if onednn_native(dtype) else torch.float32
        return self[dtype]


# the dtypes the CPU paths serve -> the dtype of their packed weights here (probed on first use)
PACK_DTYPES: dict[torch.dtype, torch.dtype] = _PackDtypes()
