"""`nn.Linear` whose CPU GEMMs run through oneDNN with a prepacked weight (vLLM's CPU path), and
whose decode GEMVs run the project's kernel, in fp32, bf16 and fp16: one operator,
`torch.ops.fms_paged.linear` (`csrc/ops/ops.cpp`), in eager mode and in compiled graphs.

MKL's GEMV reads a plain row-major weight at a fraction of the memory bandwidth, and its GEMMs at
these widths leave FLOPs unused; oneDNN's blocked weight layout does better at both ends. The
packed copy is made on first use, kept per weight tensor (weak keys: it goes with the weight) and
made again when the weight changes: another storage, or an in-place write such as
`load_state_dict` (seen through the tensor's version counter). An inference tensor (a weight
created under `torch.inference_mode()`, e.g. a model loaded there) has no version counter, so
only a new storage is seen for it: after an in-place write to such a weight, give the module a new
tensor (`load_state_dict(..., assign=True)`, `module.weight = nn.Parameter(...)`) or load the
model outside inference mode. It costs one more copy of each packed weight in memory;
`LLaMAConfig(linear_impl="torch")` turns it off. The packed copies are kept by the operator
(`csrc/ops/ops.cpp`), each with a weak reference to its weight; without a C++ compiler (no operators)
every projection is `F.linear`.

Calls of at most `GEMV_MAX_ROWS` rows (decode steps of a few sequences) take the project's GEMV
kernel instead (`csrc/kernels/gemv.cpp`). With `fms_paged.native.gemm.GEMM == "own"` (the
default on x86 CPUs with AVX-512 and no AMX: `gemm.default_gemm`; `$FMS_PAGED_GEMM` overrides) the
calls past them take the project's GEMM kernel (`csrc/kernels/gemm.cpp`) on the same plain
weights, and nothing is packed. Otherwise, which
calls pack: CPU, fp32, no gradient wanted, and either
a large weight (decode of more sequences: reading the weight dominates) or many rows (prefill: the
GEMM is compute-bound), so small GEMMs keep MKL's lower per-call cost. The operator picks its path
by the rows when it runs (one compiled graph for every row count); `cpu_path` says which it takes.
The thresholds and the packed dtypes are `fms_paged.native.gemm`'s (handed to the operator when it
loads); whether the operator serves a dtype is `fms_paged.native.ready`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fms_paged import native
from fms_paged.native import configure, gemm, load_gemv
from fms_paged.native.gemm import DTYPES as CPU_DTYPES
from fms_paged.native.gemm import GEMV_MAX_ROWS, ONEDNN, PACK_DTYPES, PACK_MIN_ROWS, PACK_MIN_WEIGHT

__all__ = [
    "GEMV_MAX_ROWS", "LINEAR_IMPLS", "PACK_DTYPES", "PACK_MIN_ROWS", "PACK_MIN_WEIGHT", "Linear", "configure",
    "cpu_path", "gemm_paths", "gemv", "is_packed", "linear_cat", "load_gemv", "packed_copy", "serves",
    "unpacked_bytes",
]

LINEAR_IMPLS = ("auto", "torch")


def serves(dtype: torch.dtype) -> bool:
    """Whether `torch.ops.fms_paged.linear` serves `dtype` here (`native.ready`: loading it on
    first use; False while a first start's builds compile: torch's operations meanwhile)."""
    return native.ready(dtype)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The operators' packed copy of the stack `weight` heads (None: none kept)."""
    return torch.ops.fms_paged._packed_copy(weight) if native.ops_loaded() else None


def is_packed(weight: torch.Tensor) -> bool:
    """Whether the operators hold a packed copy of `weight` (alone or in a stack)."""
    return native.ops_loaded() and weight.data_ptr() in torch.ops.fms_paged._packed_data_ptrs()


def gemv(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ [w_1; w_2; ...]^T -> [..., sum N_i] by the GEMV kernel (F.linear where it cannot
    be built). x and the weights [N_i, K]: one dtype of fp32, bf16 and fp16, on the CPU (ValueError
    otherwise); the dot products accumulate in fp32."""
    if x.dtype not in native.ELEM_TYPES or not x.is_cpu or not x.dim():
        kinds = ", ".join(map(str, native.ELEM_TYPES))
        raise ValueError(f"gemv: x must be a CPU tensor [..., K] of {kinds}, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if native.load_gemv(x.dtype) is not None and not native.ops_loaded():
        return torch.cat([F.linear(x, w) for w in weights], dim=-1)
    return torch.ops.fms_paged.gemv(x, weights)


def gemm_paths(dtype: torch.dtype) -> dict[str, str]:
    """How a CPU model in `dtype` computes its projections here: {"decode": ..., "prefill": ...}
    (what `fms-paged info` reports)."""
    name = str(dtype).removeprefix("torch.")
    flags = native.cpu_flags()
    if native.compiler() is not None:
        decode = f"GEMV kernel on the {name} weights, fp32 sums ({native.kernel_isa()})"
    else:
        decode = "F.linear (no C++ compiler for the GEMV kernel)"
    if gemm.GEMM == "own" and native.compiler() is not None:
        how = "bf16 pairs, AVX512_BF16" if dtype == torch.bfloat16 and "avx512_bf16" in flags and \
            native.isa() == "native" else "fp32 sums"
        prefill = f"GEMM kernel on the {name} weights the GEMV reads, no second copy ({how})"
    elif not ONEDNN:
        prefill = "F.linear (this torch has no oneDNN)"
    elif PACK_DTYPES[dtype] != dtype:
        prefill = (f"oneDNN fp32 GEMM on a packed fp32 copy of the weights: oneDNN has no {name} GEMM "
                   "on this CPU")
    else:
        unit = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}.get(dtype)
        how = "AMX" if unit in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
        prefill = f"oneDNN {name} GEMM on a packed copy of the weights ({how}, chosen by oneDNN)"
    return {"decode": decode, "prefill": prefill}


def unpacked_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights that `Linear` may still pack on the CPU (each packed copy is
    about its weight's size): memory the KV budget leaves free for them."""
    if gemm.GEMM == "own":  # the GEMM kernel reads the weights as they are: nothing is packed
        return 0
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear) and m.pack}
    packed = set(torch.ops.fms_paged._packed_data_ptrs()) if native.ops_loaded() else set()
    return sum(w.numel() * PACK_DTYPES[w.dtype].itemsize for w in weights.values()
               if w.device.type == "cpu" and w.dtype in native.ELEM_TYPES and ONEDNN
               and w.data_ptr() not in packed)


def _cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # the calls the CPU paths serve: fp32, bf16 or fp16 on the CPU, no gradient wanted (what a
    # trace may decide)
    # (a tuple, not a lookup in PACK_DTYPES: a trace would guard on that dict)
    return (x.device.type == "cpu" and x.dtype == weight.dtype
            and x.dtype in CPU_DTYPES
            and not (torch.is_grad_enabled() and weight.requires_grad))


def cpu_path(x: torch.Tensor, weight: torch.Tensor, out_features: int | None = None) -> str | None:
    """Which path `x @ weight.T` takes: "gemv", "gemm", "packed" or None (F.linear), as the operator picks
    it (see the module docstring). `out_features`: the width of a stack of weights like `weight`
    computed in one call (`linear_cat`)."""
    if not (_cpu_inference(x, weight) and serves(x.dtype)):
        return None
    path = torch.ops.fms_paged._linear_path(x, out_features or weight.shape[0])
    return None if path == "aten" else path


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the packed CPU path; `pack=False` keeps
    `F.linear` everywhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, pack: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.pack = pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if not (self.pack and _cpu_inference(x, self.weight)):
            return F.linear(x, self.weight, self.bias)
        if native.ops_loaded() if torch.compiler.is_compiling() else serves(x.dtype):
            return torch.ops.fms_paged.linear(x, [self.weight], self.bias)  # picks its path as it runs
        return F.linear(x, self.weight, self.bias)


def linear_cat(x: torch.Tensor, linears: list[Linear]) -> list[torch.Tensor]:
    """[m(x) for m in linears] (same input width; all with a bias or none), through one kernel call
    over their stacked weights where a CPU path applies (vLLM's fused q/k/v and gate/up
    projections: fewer, wider GEMMs); the outputs are views of that call's result. Modules other
    than `Linear` (a quantized projection: `fms_paged.modules.quantized`) each run alone."""
    if not all(isinstance(m, Linear) for m in linears):
        return [m(x) for m in linears]
    weights = [m.weight for m in linears]
    with_bias = [m.bias is not None for m in linears]
    if not (all(m.pack for m in linears) and len(set(with_bias)) == 1 and _cpu_inference(x, weights[0])):
        return [m(x) for m in linears]
    if not (native.ops_loaded() if torch.compiler.is_compiling() else serves(x.dtype)):
        return [F.linear(x, m.weight, m.bias) for m in linears]
    bias = torch.cat([m.bias for m in linears]) if with_bias[0] else None  # [sum N_i]
    y = torch.ops.fms_paged.linear(x, weights, bias)
    return list(y.split([w.shape[0] for w in weights], dim=-1))
