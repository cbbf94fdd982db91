"""`nn.Linear` whose CPU fp32 GEMMs run through oneDNN with a prepacked weight (vLLM's CPU path).

MKL's GEMV reads a plain row-major weight at a fraction of the memory bandwidth, and its GEMMs at
these widths leave FLOPs unused; oneDNN's blocked weight layout does better at both ends. The
packed copy is made on first use, kept per weight tensor (weak keys: it goes with the weight) and
made again when the weight changes (another storage or an in-place write such as
`load_state_dict`). It costs one more copy of each packed weight in memory;
`LLaMAConfig(linear_impl="torch")` turns it off.

Calls of at most `GEMV_MAX_ROWS` rows (decode steps of a few sequences) take the project's GEMV
kernel instead (`cpu_gemv.cpp`; the op `fms_paged::gemv` in compiled graphs). Which other calls
pack: CPU, fp32, no gradient wanted, and either a large weight (decode of more sequences: reading
the weight dominates) or many rows (prefill: the GEMM is compute-bound), so small GEMMs keep MKL's
lower per-call cost. Inside a compiled graph the packed GEMM is the opaque op
`fms_paged::packed_linear`, except when inductor freezes the weights into the graph: it then packs
and tunes the GEMM itself, so the plain `F.linear` is traced.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from fms_paged import native

LINEAR_IMPLS = ("auto", "torch")

# a call with at most this many rows (a decode step of up to 8 sequences) runs the project's GEMV
# kernel (`cpu_gemv.cpp`): each weight row streamed once, a few microseconds per call against
# oneDNN's ~20. One step of a SmolLM2-shaped stack (2-vCPU AMD EPYC, fp32) read its weights at
# 85 / 92 / 75% of a `sum`'s bandwidth at 1 / 4 / 8 rows against oneDNN's 58 / 67 / 63%; at 16
# rows oneDNN led (49% against 45%). The README's Devices section has the table.
GEMV_MAX_ROWS = 8
GEMV_SOURCE = Path(__file__).with_name("cpu_gemv.cpp")

# otherwise a call packs when its weight has this many elements (1 MiB of fp32) ...
PACK_MIN_WEIGHT = 1 << 18
# ... or when it has this many rows
PACK_MIN_ROWS = 256

# whether this torch build has oneDNN (read once: Dynamo cannot trace the query)
_ONEDNN = torch.backends.mkldnn.is_available()

# weight -> ((data_ptr, version) when packed, oneDNN-packed copy)
_PACKED = WeakIdKeyDictionary()

# first weight of a stack -> (every weight's (data_ptr, version) when packed, packed copy of the stack)
_PACKED_CAT = WeakIdKeyDictionary()

_LIB = torch.library.Library("fms_paged", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("packed_linear_cat(Tensor x, Tensor[] weights) -> Tensor")
_LIB.define("gemv(Tensor x, Tensor[] weights) -> Tensor")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight` [N, K], packed again if the weight changed since."""
    key = (weight.data_ptr(), weight._version)
    known = _PACKED.get(weight)
    if known is None or known[0] != key:
        known = _PACKED[weight] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
    return known[1]


def packed_weights_cat(weights: list[torch.Tensor]) -> torch.Tensor:
    """The oneDNN-packed copy of the weights [N_i, K] stacked [sum N_i, K], packed again if any changed."""
    key = tuple((w.data_ptr(), w._version) for w in weights)
    known = _PACKED_CAT.get(weights[0])
    if known is None or known[0] != key:
        stacked = torch.cat([w.detach() for w in weights])
        known = _PACKED_CAT[weights[0]] = (key, torch.ops.mkldnn._reorder_linear_weight(stacked))
    return known[1]


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias -> [..., N], through the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, "none", [], "")


def packed_linear_cat(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ [w_1; w_2; ...]^T -> [..., sum N_i]: one GEMM through the packed stack."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weights_cat(weights), None, "none", [], "")


@functools.cache
def _gemv_kernel() -> ctypes._CFuncPtr | None:
    lib, _ = native.load(GEMV_SOURCE)
    if lib is None:
        return None
    fn, i64, ptr = lib.fms_paged_gemv, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def gemv(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ [w_1; w_2; ...]^T -> [..., sum N_i] by the GEMV kernel (F.linear where it cannot
    be built)."""
    fn = _gemv_kernel()
    if fn is None:
        return torch.cat([F.linear(x, w) for w in weights], dim=-1)
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weights = [w if w.is_contiguous() else w.contiguous() for w in weights]
    n = len(weights)
    y = torch.empty(*x.shape[:-1], sum(w.shape[0] for w in weights), dtype=x.dtype)
    ptrs = (ctypes.c_void_p * n)(*[w.data_ptr() for w in weights])
    widths = (ctypes.c_int64 * n)(*[w.shape[0] for w in weights])
    threads = torch.get_num_threads()
    fn(rows.data_ptr(), rows.shape[0], K, rows.stride(0), n, ptrs, widths, y.data_ptr(), threads)
    return y


_LIB.impl("packed_linear", packed_linear, "CPU")
_LIB.impl("packed_linear_cat", packed_linear_cat, "CPU")
_LIB.impl("gemv", gemv, "CPU")


@torch.library.register_fake("fms_paged::packed_linear")
def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("fms_paged::gemv")
def _gemv_fake(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


@torch.library.register_fake("fms_paged::packed_linear_cat")
def _packed_linear_cat_fake(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def unpacked_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights that `Linear` may still pack on the CPU (each packed copy is
    about its weight's size): memory the KV budget leaves free for them."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear) and m.pack}
    in_stacks = {ptr for key, _ in _PACKED_CAT.values() for ptr, _ in key}
    return sum(w.nbytes for w in weights.values()
               if w.device.type == "cpu" and w.dtype == torch.float32 and _ONEDNN and w not in _PACKED
               and w.data_ptr() not in in_stacks)


def cpu_path(x: torch.Tensor, weight: torch.Tensor, out_features: int | None = None) -> str | None:
    """Which path `x @ weight.T` takes: "gemv", "packed" or None (F.linear); see the module
    docstring. `out_features`: the width of a stack of weights like `weight` computed in one call
    (`linear_cat`)."""
    if not (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        return None
    if x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return "gemv"
    n = weight.shape[0] if out_features is None else out_features
    if _ONEDNN and (n * weight.shape[1] >= PACK_MIN_WEIGHT or x.numel() >= PACK_MIN_ROWS * x.shape[-1]):
        return "packed"
    return None


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the packed CPU path; `pack=False` keeps
    `F.linear` everywhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, pack: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.pack = pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        path = cpu_path(x, self.weight) if self.pack else None
        if path is None or torch.compiler.is_compiling() and torch._inductor.config.freezing:
            return F.linear(x, self.weight, self.bias)  # frozen: inductor packs and tunes the GEMM
        compiled = torch.compiler.is_compiling()
        if path == "packed":
            if compiled:
                return torch.ops.fms_paged.packed_linear(x, self.weight, self.bias)
            return packed_linear(x, self.weight, self.bias)
        y = torch.ops.fms_paged.gemv(x, [self.weight]) if compiled else gemv(x, [self.weight])
        return y if self.bias is None else y + self.bias


def linear_cat(x: torch.Tensor, linears: list[Linear]) -> list[torch.Tensor]:
    """[m(x) for m in linears] (bias-free, same input width), through one kernel call over their
    stacked weights where a CPU path applies (vLLM's fused q/k/v and gate/up projections: fewer,
    wider GEMMs); the outputs are views of that call's result."""
    weights = [m.weight for m in linears]
    width = sum(w.shape[0] for w in weights)
    path = cpu_path(x, weights[0], width) if all(m.pack and m.bias is None for m in linears) else None
    if path is None:
        return [m(x) for m in linears]
    if torch.compiler.is_compiling():
        if torch._inductor.config.freezing:  # frozen weights: the stack is folded into one constant
            y = F.linear(x, torch.cat(weights))
        elif path == "packed":
            y = torch.ops.fms_paged.packed_linear_cat(x, weights)
        else:
            y = torch.ops.fms_paged.gemv(x, weights)
    else:
        y = packed_linear_cat(x, weights) if path == "packed" else gemv(x, weights)
    return list(y.split([w.shape[0] for w in weights], dim=-1))
