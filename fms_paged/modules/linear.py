"""`nn.Linear` whose CPU fp32 GEMMs run through oneDNN with a prepacked weight (vLLM's CPU path).

MKL's GEMV reads a plain row-major weight at a fraction of the memory bandwidth, and its GEMMs at
these widths leave FLOPs unused; oneDNN's blocked weight layout does better at both ends. The
packed copy is made on first use, kept per weight tensor (weak keys: it goes with the weight) and
made again when the weight changes (another storage or an in-place write such as
`load_state_dict`). It costs one more copy of each packed weight in memory;
`LLaMAConfig(linear_impl="torch")` turns it off.

Which calls pack: CPU, fp32, no gradient wanted, and either a large weight (decode: reading the
weight dominates) or many rows (prefill: the GEMM is compute-bound), so small GEMMs keep MKL's
lower per-call cost. Inside a compiled graph the packed GEMM is the opaque op
`fms_paged::packed_linear`, except when inductor freezes the weights into the graph: it then packs
and tunes the GEMM itself, so the plain `F.linear` is traced.
"""

from __future__ import annotations

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

LINEAR_IMPLS = ("auto", "torch")

# a call packs when its weight has this many elements (1 MiB of fp32) ...
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


_LIB.impl("packed_linear", packed_linear, "CPU")
_LIB.impl("packed_linear_cat", packed_linear_cat, "CPU")


@torch.library.register_fake("fms_paged::packed_linear")
def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


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


def packs(x: torch.Tensor, weight: torch.Tensor, out_features: int | None = None) -> bool:
    """Whether `x @ weight.T` takes the packed path (see the module docstring); `out_features`:
    the width of a stack of weights like `weight` computed in one GEMM (`linear_cat`)."""
    n = weight.shape[0] if out_features is None else out_features
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and _ONEDNN
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and (n * weight.shape[1] >= PACK_MIN_WEIGHT or x.numel() >= PACK_MIN_ROWS * x.shape[-1])
    )


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) with the packed CPU path; `pack=False` keeps
    `F.linear` everywhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, pack: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.pack = pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if self.pack and packs(x, self.weight):
            if not torch.compiler.is_compiling():
                return packed_linear(x, self.weight, self.bias)
            if not torch._inductor.config.freezing:
                return torch.ops.fms_paged.packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_cat(x: torch.Tensor, linears: list[Linear]) -> list[torch.Tensor]:
    """[m(x) for m in linears] (bias-free, same input width), through one GEMM over their stacked
    weights where the packed path applies (vLLM's fused q/k/v and gate/up projections: fewer,
    wider GEMMs); the outputs are views of that GEMM's result."""
    weights = [m.weight for m in linears]
    width = sum(w.shape[0] for w in weights)
    if not all(m.pack and m.bias is None for m in linears) or not packs(x, weights[0], width):
        return [m(x) for m in linears]
    if not torch.compiler.is_compiling():
        y = packed_linear_cat(x, weights)
    elif not torch._inductor.config.freezing:
        y = torch.ops.fms_paged.packed_linear_cat(x, weights)
    else:  # frozen weights: the stack is folded into one constant
        y = F.linear(x, torch.cat(weights))
    return list(y.split([w.shape[0] for w in weights], dim=-1))
