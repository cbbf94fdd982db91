"""Tensor parallelism for our own models, on torch.distributed (gloo on the CPU, NCCL on CUDA): each
rank holds its share of the heads and of the MLP, and its kv heads' slice of every KV page under
the one page table.

`shard(model, rank, size, group)` cuts a built `LLaMA` (any family we load) in place, as Megatron
and vLLM cut it:
- attention: q/k/v column-parallel (this rank's query heads and their kv heads; with fewer kv
  heads than ranks, each kv head replicated on `size // kvheads` ranks), the output projection
  row-parallel, one all-reduce after it;
- MLP: gate and up column-parallel, down row-parallel, one all-reduce;
- the LM head vocabulary-parallel (each rank its rows, zero-padded to equal shares), its logits
  gathered, so every rank holds the whole logits;
- embeddings, norms and RoPE tables replicated.
The collectives are torch's functional ones, which run eagerly and trace into a compiled graph.
The model's config then describes this rank's part (`nheads`, `kvheads`: what the KV pool and
the attention kernels see); `model.tp` says which part it is. Settings that cannot be cut evenly
are refused with the numbers (`TensorParallelError`) before anything changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from fms_paged.models.llama import LLaMA
from fms_paged.modules.linear import Linear

# all_gather_single is all_gather_tensor's newer name (torch 2.13); the lent GPUs' torch 2.11 has
# the older one only
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class TensorParallelError(ValueError):
    """A model or setting that cannot be split over the ranks asked for."""


@dataclass(frozen=True)
class TensorParallel:
    """Which part of the model a rank holds."""

    rank: int
    size: int
    group: Any = None  # the ProcessGroup of the ranks
    nheads: int = 0  # the whole model's query and kv heads
    kvheads: int = 0


def layout(nheads: int, kvheads: int, hidden_dim: int, size: int) -> tuple[int, int]:
    """(query heads, kv heads) per rank for `size` ranks; TensorParallelError naming the numbers
    when they do not divide (kv heads fewer than ranks are replicated when the ranks divide evenly
    among them)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TensorParallelError(f"tensor_parallel_size={size!r}; expected an int >= 1")
    if nheads % size:
        raise TensorParallelError(f"tensor_parallel_size={size} does not divide the model's {nheads} "
                                  f"query heads")
    if kvheads % size and size % kvheads:
        raise TensorParallelError(f"tensor_parallel_size={size} neither divides the model's {kvheads} kv "
                                  f"heads nor is a multiple of them (to replicate each on as many ranks)")
    if hidden_dim % size:
        raise TensorParallelError(f"tensor_parallel_size={size} does not divide the MLP's {hidden_dim} "
                                  f"hidden units")
    return nheads // size, max(1, kvheads // size)


class CollectiveClock:
    """Seconds this process spends in the split model's collectives (waiting for the other ranks
    included), in eager forwards while `on` (`make bench-tp` reads it per step); off by default."""

    def __init__(self):
        self.on, self.calls, self.seconds = False, 0, 0.0

    def timing(self) -> bool:
        return self.on and not torch.compiler.is_compiling()

    def add(self, t0: float) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - t0


clock = CollectiveClock()


class RowParallel(nn.Module):
    """A projection whose input features are this rank's share: partial sums, summed over the ranks
    by one all-reduce."""

    def __init__(self, linear: Linear, group: Any):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if clock.timing():
            t0 = time.perf_counter()
            y = funcol.wait_tensor(funcol.all_reduce(y, "sum", self.group))
            clock.add(t0)
            return y
        return funcol.wait_tensor(funcol.all_reduce(y, "sum", self.group))


class GatheredHead(nn.Module):
    """The LM head's rows of this rank's share of the vocabulary (padded to equal shares); the
    logits of every rank gathered along the vocabulary, the padding cut."""

    def __init__(self, linear: Linear, vocab_size: int, group: Any):
        super().__init__()
        self.linear, self.vocab_size, self.group = linear, vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [..., V / size]
        t0 = time.perf_counter() if clock.timing() else None
        y = funcol.wait_tensor(_all_gather(y.contiguous(), y.dim() - 1, self.group))
        if t0 is not None:
            clock.add(t0)
        return y[..., : self.vocab_size]


def _rows(weight: torch.Tensor, start: int, stop: int) -> nn.Parameter:
    return nn.Parameter(weight[start:stop].clone(), requires_grad=False)


def _cols(weight: torch.Tensor, start: int, stop: int) -> nn.Parameter:
    return nn.Parameter(weight[:, start:stop].contiguous(), requires_grad=False)


def _take_rows(linear: Linear, start: int, stop: int) -> None:
    linear.weight = _rows(linear.weight.data, start, stop)
    if linear.bias is not None:
        linear.bias = _rows(linear.bias.data, start, stop)
    linear.out_features = stop - start


def shard(model: nn.Module, rank: int, size: int, group: Any = None) -> nn.Module:
    """Keep rank `rank`'s part of `model` (a built `LLaMA`, the same weights on every rank), in
    place; -> the model. See the module docstring."""
    if not isinstance(model, LLaMA):
        raise TensorParallelError(f"tensor parallelism splits fms_paged's own models (LLaMA and the "
                                  f"families it loads), got {type(model).__name__}; an IBM FMS model "
                                  "keeps FMS's own (distributed_strategy='tp')")
    if model.tp is not None:
        raise TensorParallelError(f"the model is already split (rank {model.tp.rank} of {model.tp.size})")
    if model.config.quantization is not None:
        raise TensorParallelError(f"the model's projections are quantized ({model.config.quantization}): a "
                                  "quantized model is not split over ranks; load it without quantization")
    if group is None:
        group = dist.group.WORLD
    c = model.config
    hidden = model.layers[0].ff_sub_module.wg.out_features
    heads, kv = layout(c.nheads, c.kvheads, hidden, size)
    if not 0 <= rank < size:
        raise TensorParallelError(f"rank={rank}; expected 0 <= rank < tensor_parallel_size={size}")
    D, share = c.head_dim, hidden // size
    kv0 = rank * kv if c.kvheads >= size else rank // (size // c.kvheads)
    with torch.no_grad():
        for layer in model.layers:
            a, ff = layer.attn, layer.ff_sub_module
            _take_rows(a.in_proj.query, rank * heads * D, (rank + 1) * heads * D)
            _take_rows(a.in_proj.key, kv0 * D, (kv0 + kv) * D)
            _take_rows(a.in_proj.value, kv0 * D, (kv0 + kv) * D)
            a.dense.weight = _cols(a.dense.weight.data, rank * heads * D, (rank + 1) * heads * D)
            a.dense.in_features = heads * D
            a.dense = RowParallel(a.dense, group)
            a.nheads, a.kvheads = heads, kv
            _take_rows(ff.wg, rank * share, (rank + 1) * share)
            _take_rows(ff.w1, rank * share, (rank + 1) * share)
            ff.w2.weight = _cols(ff.w2.weight.data, rank * share, (rank + 1) * share)
            ff.w2.in_features = share
            ff.w2 = RowParallel(ff.w2, group)
        V = c.src_vocab_size
        per = -(-V // size)
        w = model.head.weight.data[rank * per : min(V, (rank + 1) * per)]
        if w.shape[0] < per:  # the last share, zero-padded to the others' size
            w = torch.cat([w, w.new_zeros(per - w.shape[0], w.shape[1])])
        with torch.device("meta"):  # no throwaway init of the rows
            head = Linear(c.emb_dim, per, bias=False, pack=model.head.pack)
        head.weight = nn.Parameter(w.clone(), requires_grad=False)
        model.head = GatheredHead(head, V, group)
    model.config = c.updated(nheads=heads, kvheads=kv, head_dim=D)
    model.tp = TensorParallel(rank, size, group, c.nheads, c.kvheads)
    return model
