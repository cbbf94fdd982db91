"""`nn.Linear` whose CPU fp32 GEMMs run through oneDNN with a prepacked weight (vLLM's CPU path).

MKL's GEMV reads a plain row-major weight at a fraction of the memory bandwidth, and its GEMMs at
these widths leave FLOPs unused; oneDNN's blocked weight layout does better at both ends. The
packed copy is made on first use, kept per weight tensor (weak keys: it goes with the weight) and
made again when the weight changes (another storage or an in-place write such as
`load_state_dict`). It costs one more copy of each packed weight in memory;
`LLaMAConfig(linear_impl="torch")` turns it off.

Calls of at most `GEMV_MAX_ROWS` rows (decode steps of a few sequences) take the project's GEMV
kernel instead (`cpu_gemv.cpp`). Which other calls pack: CPU, fp32, no gradient wanted, and either
a large weight (decode of more sequences: reading the weight dominates) or many rows (prefill: the
GEMM is compute-bound), so small GEMMs keep MKL's lower per-call cost. Inside a compiled graph a
projection is the opaque op `fms_paged::linear`, which picks its path by the rows when it runs (one
graph for every row count), except when inductor freezes the weights into the graph: it then packs
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
_LIB.define("linear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor")


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


# data_ptr of each weight of a stack, then their rows -> the kernel's arguments for it (pointers, widths,
# count, total width): building them took ~3.5 of the ~11 us a call spent in Python here
_GEMV_ARGS: dict[tuple, tuple] = {}


def _gemv_args(weights: list[torch.Tensor], keep: bool) -> tuple:
    n = len(weights)
    key = (*[w.data_ptr() for w in weights], *[w.shape[0] for w in weights])
    args = _GEMV_ARGS.get(key)
    if args is None:
        args = ((ctypes.c_void_p * n)(*key[:n]), (ctypes.c_int64 * n)(*key[n:]), n, sum(key[n:]))
        if keep:
            if len(_GEMV_ARGS) >= 4096:
                _GEMV_ARGS.clear()
            _GEMV_ARGS[key] = args
    return args


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
    if False not in [w.is_contiguous() for w in weights]:
        args = _gemv_args(weights, keep=True)
    else:  # contiguous copies, for this call alone
        weights = [w.contiguous() for w in weights]
        args = _gemv_args(weights, keep=False)
    ptrs, widths, n, width = args
    y = torch.empty(*x.shape[:-1], width, dtype=x.dtype)
    fn(rows.data_ptr(), rows.shape[0], K, rows.stride(0), n, ptrs, widths, y.data_ptr(),
       torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ [w_1; w_2; ...]^T + bias -> [..., sum N_i] for a call the CPU paths serve (fp32
    on the CPU, no gradient: checked by the caller) through the path `cpu_path` picks for its rows.
    Compiled graphs call it as the op `fms_paged::linear`: the path is chosen when the step runs,
    not when it is traced, so one graph serves every row count (no guard on the rows)."""
    return _linear(x, weights, bias, _rows_path(x, weights[0], sum(w.shape[0] for w in weights)))


def _linear(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, path: str | None
            ) -> torch.Tensor:
    if path == "gemv":
        y = gemv(x, weights)
        return y if bias is None else y + bias
    if len(weights) == 1:
        return packed_linear(x, weights[0], bias) if path == "packed" else F.linear(x, weights[0], bias)
    if path == "packed":
        y = packed_linear_cat(x, weights)
    else:
        y = torch.cat([F.linear(x, w) for w in weights], -1)
    return y if bias is None else y + bias


_LIB.impl("linear", linear, "CPU")


@torch.library.register_fake("fms_paged::linear")
def _linear_fake(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def unpacked_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights that `Linear` may still pack on the CPU (each packed copy is
    about its weight's size): memory the KV budget leaves free for them."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear) and m.pack}
    in_stacks = {ptr for key, _ in _PACKED_CAT.values() for ptr, _ in key}
    return sum(w.nbytes for w in weights.values()
               if w.device.type == "cpu" and w.dtype == torch.float32 and _ONEDNN and w not in _PACKED
               and w.data_ptr() not in in_stacks)


def _cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # the calls the CPU paths serve: fp32 on the CPU, no gradient wanted (what a trace may decide)
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and weight.requires_grad))


def cpu_path(x: torch.Tensor, weight: torch.Tensor, out_features: int | None = None) -> str | None:
    """Which path `x @ weight.T` takes: "gemv", "packed" or None (F.linear); see the module
    docstring. `out_features`: the width of a stack of weights like `weight` computed in one call
    (`linear_cat`)."""
    return _rows_path(x, weight, out_features or weight.shape[0]) if _cpu_inference(x, weight) else None


def _rows_path(x: torch.Tensor, weight: torch.Tensor, width: int) -> str | None:
    if x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return "gemv"
    if _ONEDNN and (width * weight.shape[1] >= PACK_MIN_WEIGHT or x.numel() >= PACK_MIN_ROWS * x.shape[-1]):
        return "packed"
    return None


def _traced(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    # inside torch.compile: the op that picks its path when run, or, where inductor freezes the
    # weights into the graph (compile="tuned"), a plain linear that it packs and tunes itself
    if torch._inductor.config.freezing:
        return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(weights), bias)
    return torch.ops.fms_paged.linear(x, weights, bias)


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
        if torch.compiler.is_compiling():
            return _traced(x, [self.weight], self.bias)
        return linear(x, [self.weight], self.bias)


def linear_cat(x: torch.Tensor, linears: list[Linear]) -> list[torch.Tensor]:
    """[m(x) for m in linears] (bias-free, same input width), through one kernel call over their
    stacked weights where a CPU path applies (vLLM's fused q/k/v and gate/up projections: fewer,
    wider GEMMs); the outputs are views of that call's result."""
    weights = [m.weight for m in linears]
    if not (all(m.pack and m.bias is None for m in linears) and _cpu_inference(x, weights[0])):
        return [m(x) for m in linears]
    if torch.compiler.is_compiling():
        y = _traced(x, weights, None)
    else:
        path = _rows_path(x, weights[0], sum(w.shape[0] for w in weights))
        if path is None:
            return [F.linear(x, w) for w in weights]  # eager: no copy into one output
        y = _linear(x, weights, None, path)
    return list(y.split([w.shape[0] for w in weights], dim=-1))
