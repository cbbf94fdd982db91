"""What every paged kernel is (`Kernel`: capabilities and the step builders) and what its steps share
(`PoolStep`: ASSIGN, then attention over the pools; `MixedStep`: decode rows and prefill chunks in
one forward).

Callers ask a kernel what it can do instead of testing its name: whether its steps compile, whether
its compiled decode step can be replayed from CUDA graphs, whether a page must be zeroed before use,
the fewest rows and tokens its compiled graphs take.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fms_paged.kv._pool_ops import write_slots
from fms_paged.kv.spec import AttentionSpec
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch

# an 8-bit pool pair's (k_scales, v_scales), each [1, Hkv, NP, G] fp32; (None, None) for 16/32 bits
Scales = tuple[torch.Tensor | None, torch.Tensor | None]


class _NoBackward(torch.autograd.Function):
    """Paged attention's output `out` as a function of `q` whose backward pass raises."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("paged attention has no backward pass: it reads a KV cache written in place. "
                           "Run the paged model under torch.inference_mode() or torch.no_grad(); train "
                           "with attn_impl='sdpa'")


class PoolStep:
    """A prepared step over a view's per-layer pools: the slots of its new tokens and whatever its
    kernel needs to find each sequence's pages. `attend` runs ASSIGN (`store`) and `attention` on
    layer `layer`'s pools with the layer's spec; FMS's attention op calls `store` and `attention`
    on the pools and spec it is handed (`fms_paged.integrations.fms`)."""

    view: PoolView
    slots: torch.Tensor  # [B' * S'] pool slot of every new token, in the step's token order

    def prepare(self) -> PoolStep:
        """Device-side metadata built once per forward, before the layers (see AttentionStep)."""
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B', H, S', D]; k, v: [B', Hkv, S', D]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # autograd records (a model run outside inference_mode / no_grad): the pools are a cache
            # written in place, not a differentiable input, so ASSIGN and attention run untracked
            # (no pool joins a graph that would outlive the step; flex's kernels would want a
            # backward BlockMask) and a backward pass through the output is refused
            with torch.no_grad():
                out = self.attend(layer, q, k, v)
            return _NoBackward.apply(q, out)
        kp, vp = self.view.k_pools[layer], self.view.v_pools[layer]
        scales = self.view.scales(layer)
        self.store(kp, vp, k, v, scales)
        return self.attention(q, kp, vp, self.view.specs[layer], scales)

    def forward_model(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None,
                      logits_at: torch.Tensor | None) -> torch.Tensor | None:
        """The model's whole forward on this step in one call of the kernel's own (the logits), or
        None: the model runs its layers (every kernel but cpp)."""
        return None

    def run_blocks(self, model: torch.nn.Module, x: torch.Tensor,
                   ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.Tensor | None:
        """Every block of the model on this step in one call of the kernel's own (their output), or
        None: the model runs its blocks (every kernel but cpp)."""
        return None

    def store(self, kp: torch.Tensor, vp: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scales: Scales = (None, None)) -> None:
        """ASSIGN the step's new k/v ([B', Hkv, S', D]) to their slots of pools kp, vp
        ([1, Hkv, NP, D]), in place (`write_slots`: the page manager's ASSIGN at precomputed slots;
        8-bit pools: quantized there, their `scales` written at the same slots)."""
        B, H, S, D = k.shape  # -> [B' * S', Hkv, D], the token order of the slots
        write_slots(kp, vp, self.slots, k.transpose(1, 2).reshape(B * S, H, D),
                    v.transpose(1, 2).reshape(B * S, H, D), *scales)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
        """q: [B', H, S', D] over pools kp, vp (already written; 8-bit pools with their `scales`
        (k_scales, v_scales) [1, Hkv, NP, G]), under `spec` -> [B', H, S', D]"""
        raise NotImplementedError


class MixedStep(PoolStep):
    """Decodes and prefill chunks in one forward: the packed row holds `rows` decode tokens (one per
    row of a decode batch, padded) and then the prefill tokens. Linear layers run on all of them at
    once; attention runs each part on its own (decode rows through their own pages; the prefill
    part through its chunks' pages), so a decode token never scans the union of pages of the
    sequences sharing its query block. (The cpp kernel needs none of this: one chunk list.)"""

    def __init__(self, decode, prefill: PoolStep, rows: int, slots: torch.Tensor | None = None):
        self.decode, self.prefill, self.rows = decode, prefill, rows
        self.view = prefill.view
        self.slots = slots  # [B + Tp] pool slot of every token of the row (set by prepare)

    def prepare(self) -> MixedStep:
        if self.slots is not None:
            return self
        decode = self.decode.prepare()
        return MixedStep(decode, self.prefill, self.rows, torch.cat([decode.slots, self.prefill.slots]))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
        # q: [1, H, B + Tp, D], a view of [1, B + Tp, H, D]. Compiled flex kernels are specialised
        # on strides: each part gets the strides a pure decode / pure prefill step gives it, so
        # mixed steps reuse their kernels (a plain slice's strides would depend on the other
        # part's length: one recompilation per new (B, Tp) pair)
        B = self.rows
        rows = q.transpose(1, 2)  # [1, B + Tp, H, D]
        qd = rows[0, :B].unsqueeze(1).transpose(1, 2)  # [B, H, 1, D], no copy
        od = self.decode.attention(qd, kp, vp, spec, scales)
        qp = rows[:, B:].clone(memory_format=torch.contiguous_format).transpose(1, 2)  # [1, H, Tp, D]
        op = self.prefill.attention(qp, kp, vp, spec, scales)
        return torch.cat([od.squeeze(2).transpose(0, 1).unsqueeze(0), op], dim=2)


class GroupedStep(PoolStep):
    """A step of a model whose pages are held per layer slice (`fms_paged.kv.groups`): one step
    of the kernel per slice, each over its slice's page-table rows, and each layer attends
    through its slice's (dispatched here by its index). The one-call forwards (`forward_model`,
    `run_blocks`) are the kernel's joined step's, where it has one (`Kernel.join`: cpp)."""

    def __init__(self, steps: list, slice_of: tuple[int, ...], joined: PoolStep | None = None):
        self.steps, self.slice_of = steps, slice_of
        self.joined = joined  # the kernel's one step over every slice (`Kernel.join`), if it has one
        self.view = steps[0].view

    @property
    def slots(self) -> torch.Tensor:
        """Slice 0's slots of the new tokens (each slice has its own)."""
        return self.steps[0].slots

    @property
    def fused(self) -> bool:
        """Whether the joined step runs the forward in one call (`CppStep.fused`; False without one)."""
        return bool(getattr(self.joined, "fused", False))

    @fused.setter
    def fused(self, value: bool) -> None:
        if self.joined is not None:
            self.joined.fused = value

    def prepare(self) -> GroupedStep:
        return GroupedStep([s.prepare() for s in self.steps], self.slice_of, self.joined)

    def forward_model(self, model, tokens, positions, logits_at):
        return None if self.joined is None else self.joined.forward_model(model, tokens, positions, logits_at)

    def run_blocks(self, model, x, ropes):
        return None if self.joined is None else self.joined.run_blocks(model, x, ropes)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.steps[self.slice_of[layer]].attend(layer, q, k, v)

    def store(self, kp, vp, k, v) -> None:
        raise ValueError(_BY_LAYER)

    def attention(self, q, kp, vp, spec) -> torch.Tensor:
        raise ValueError(_BY_LAYER)


_BY_LAYER = ("a step of pages held per layer group is taken layer by layer (`attend`): a caller that "
             "hands in pools alone cannot say which group's page table they are read through")


class Kernel:
    """A paged-attention kernel: its capabilities, and the steps it builds from a step's host data
    over a `PoolView`. Each builder returns (tokens, positions, step) in the layout the kernel
    takes: decode rows [B, 1]; prefill and mixed steps one packed row [1, T'] (T' >= T: a kernel
    may pad; padding tokens belong to no sequence and write to the null page)."""

    name: ClassVar[str]
    compiles: ClassVar[bool] = False  # compile="auto" compiles the engine's steps around it
    always_compiles: ClassVar[bool] = False  # compiles its attention even in eager steps (warm-up)
    cuda_graphs: ClassVar[bool] = False  # its compiled decode step can be replayed from CUDA graphs
    zero_new_pages: ClassVar[bool] = True  # reads whole pages: a page handed out is zeroed first
    static_decode: ClassVar[bool] = True  # a decode step's shapes never change (compiled static)
    # its compiled decode graph takes the rows, the pools' size and the page size as dynamic inputs:
    # one graph per model shape, whatever the batch and the pool (Dynamo specializes a dim of 1,
    # so a lone request is padded to `min_rows` = 2 rows)
    dynamic_shapes: ClassVar[bool] = False
    min_rows: ClassVar[int] = 1  # fewest rows of a compiled decode batch (a lone request is padded)
    min_prefill_tokens: ClassVar[int] = 1  # fewest tokens of a compiled prefill step (padded)
    takes_score_mod: ClassVar[bool] = False  # applies a user score_mod (in logical positions)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def load(self, view: PoolView) -> None:
        """Load what its steps over `view` call, where a step loads it on first use in eager mode: what
        a compiled step needs before it is traced (nothing by default)."""

    def decodes_in_one_call(self, model: torch.nn.Module, view: PoolView) -> bool:
        """Whether `decode_greedy` runs `model`'s greedy decode steps over `view` in one call now
        (`one_call` kernels, where their operators are loaded; never by default)."""
        return False

    def join(self, view: PoolView, steps: list) -> PoolStep | None:
        """One step over every layer slice (`view`: every layer's) from the slices' own `steps`,
        for the kernel's one-call forward; None: the slices' steps run layer by layer."""
        return None

    def decode_greedy(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                      seqs: torch.Tensor, view: PoolView, steps: int) -> torch.Tensor | None:
        """`steps` greedy decode steps in one call -> the tokens [B, steps], or None where this
        kernel cannot (`decodes_in_one_call`; none by default)."""
        return None

    def decode_lookup(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                      seqs: torch.Tensor, view: PoolView, steps: int, history: torch.Tensor,
                      offsets: torch.Tensor, caps: torch.Tensor, n_max: int, n_min: int,
                      max_rows: int) -> tuple | None:
        """`decode_greedy` with prompt lookup speculation inside the call -> (tokens [B, steps],
        per row stats [B, 4], per step timings [S, 3]), or None where this kernel cannot (none by
        default)."""
        return None

    def decode_beams(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                     seqs: torch.Tensor, view: PoolView, steps: int, width: int, scores: torch.Tensor,
                     stops: torch.Tensor, keeps: torch.Tensor) -> tuple | None:
        """`steps` beam-search steps of groups of `width` rows (and greedy steps of the rows after
        them) in one call -> (candidate scores [steps, groups, keep], candidates [steps, groups, 2,
        keep], the rows' page table rows [slices, B, pages] after the call, the row of `seqs`
        holding each row's beam at the end, the greedy rows' tokens [rows, steps]), or None where
        this kernel cannot (none by default)."""
        return None

    def prefill(self, view: PoolView, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, PoolStep]:
        raise NotImplementedError

    def decode(self, view: PoolView, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, object]:
        raise NotImplementedError

    def mixed(self, view: PoolView, dec: DecodeBatch,
              pre: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, PoolStep]:
        """Decode rows, then the prefill chunks, in one packed row [1, B + T']."""
        B = len(dec.seq_ids)
        tok_d, pos_d, dstep = self.decode(view, dec)
        tok_p, pos_p, pstep = self.prefill(view, pre)
        tokens = torch.cat([tok_d.view(1, B), tok_p.to(tok_d.device)], dim=1)
        positions = torch.cat([pos_d.view(1, B), pos_p.to(pos_d.device)], dim=1)
        return tokens, positions, MixedStep(dstep, pstep, B)
