"""The per-step attention objects of the paged backend (`AttentionStep`s), one family per kernel.

A step is built once per forward by `PagedBackend` (slots of the new tokens, masks or chunk lists)
and shared by every layer. Each layer calls `attend(layer, q, k, v)`: ASSIGN the new k/v to their
slots (`store`, through the page manager's validated `write_slots`), then attend over the pool
(`attention`). FMS's attention op calls `store` and `attention` on the pools it is handed
(`fms_paged.integrations.fms`).

- cpp:    `CppStep` (prefill chunks, decode rows and mixed steps alike: one chunk list).
- flex:   `FlexDecodeStep` -> `FlexStep` (decode; prefill on CUDA or with a score_mod).
- gather: `GatherDecodeStep` -> `PreparedGatherStep` (decode rows, padded to the longest),
          `GatherPrefillStep` (prefill chunks, packed). The flex kernel on the CPU prefills through
          `GatherPrefillStep` too: one SDPA call per chunk beats flex's one-page KV blocks there.
- `MixedStep`: decode rows and prefill chunks of one forward for the flex and gather kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fms_paged.flex.masks import decode_block_mask, logical_score_mod, paged_mask_mod
from fms_paged.kv import cpu_kernel  # noqa: F401 - registers the op torch.ops.fms_paged.paged_attention
from fms_paged.kv._pool_ops import read_slots, write_slots
from fms_paged.kv.geometry import pages_for, slot
from fms_paged.kv.kernels import compiled_flex

if TYPE_CHECKING:
    from fms_paged.kv.paged import PagedBackend


class PoolStep:
    """A prepared step over a backend's per-layer pools. `store` and `attention` work on pools
    handed in; `attend` runs both on layer `layer`'s pools (our own model)."""

    b: PagedBackend
    slots: torch.Tensor  # [B' * S'] pool slot of every new token, in the step's token order

    def prepare(self) -> PoolStep:
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B', H, S', D]; k, v: [B', Hkv, S', D]
        kp, vp = self.b.k_pools[layer], self.b.v_pools[layer]
        self.store(kp, vp, k, v)
        return self.attention(q, kp, vp)

    def store(self, kp: torch.Tensor, vp: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """ASSIGN the step's new k/v ([B', Hkv, S', D]) to their slots of pools kp, vp
        ([1, Hkv, NP, D]), in place."""
        B, H, S, D = k.shape  # -> [B' * S', Hkv, D], the token order of the slots
        write_slots(kp, vp, self.slots, k.transpose(1, 2).reshape(B * S, H, D),
                    v.transpose(1, 2).reshape(B * S, H, D))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        """q: [B', H, S', D] over pools kp, vp (already written) -> [B', H, S', D]"""
        raise NotImplementedError


class CppStep(PoolStep):
    """A step of the cpp kernel: the slots of its new tokens and its chunk list ([n, 4] int64:
    seq, first position, tokens, offset in the step's token order; a decode row is a chunk of one
    token, an inactive row has seq -1). One kernel call per layer attends every chunk."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, chunks: torch.Tensor):
        self.b, self.slots, self.chunks = backend, slots, chunks
        self.scale = backend.head_dim**-0.5

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [B', H, S', D]; kp, vp: [1, Hkv, NP, D] -> [B', H, S', D] (a view of [B', S', H, D])
        out = torch.ops.fms_paged.paged_attention(q, kp, vp, self.b.pm.page_table, self.chunks,
                                                  self.b.page_size_arg, self.scale)
        return out.transpose(1, 2)


class FlexStep(PoolStep):
    """One step over the pool with flex_attention: slots and BlockMask shared by all layers.

    Prefill: built ready by the backend (slots and BlockMask from the host's page lists).
    Decode: the backend makes a `FlexDecodeStep` (metadata only) whose `prepare` builds this.
    """

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, block_mask, q_pos: torch.Tensor,
                 gqa_group: int = 0):
        self.b = backend
        self.slots = slots  # [B' * S'] pool slot of every new token
        self.block_mask = block_mask
        self.gqa_group = gqa_group  # decode: the G query heads of each kv head packed into q
        self.score_mod = None
        if backend.score_mod is not None:  # q_pos: [B', S'] logical query positions
            self.score_mod = logical_score_mod(
                backend.score_mod, backend.pm.phys_to_logical, q_pos, backend.P, gqa_group
            )

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # kp, vp: [1, Hkv, NP, D]; inside a compiled forward flex_attention is traced with the step
        attn = flex_attention if torch.compiler.is_compiling() else compiled_flex(dynamic=False)
        opts = self.b.kernel_options
        if not self.gqa_group:
            return attn(q, kp, vp, score_mod=self.score_mod, block_mask=self.block_mask,
                        enable_gqa=True, kernel_options=opts)
        B, H, _, D = q.shape  # decode: S' = 1; query head h reads kv head h // G
        qg = q.reshape(B, H // self.gqa_group, self.gqa_group, D)  # [B, Hkv, G, D]
        out = attn(qg, kp, vp, score_mod=self.score_mod, block_mask=self.block_mask, kernel_options=opts)
        return out.reshape(B, H, 1, D)


class FlexDecodeStep:
    """A decode step's metadata: `decode_meta` ([6, B] int64 on device, see
    `fms_paged.flex.masks.decode_meta`) holds each row's sequence, query position and new slot.
    `prepare` builds the ready `FlexStep` (BlockMask from the metadata and the device page table)
    with device ops only, and returns a new object rather than writing attributes on this one: in
    a compiled step, writes to an input object are replayed in Python after the graph."""

    def __init__(self, backend: PagedBackend, decode_meta: torch.Tensor):
        self.b = backend
        self.decode_meta = decode_meta

    def prepare(self) -> FlexStep:
        b, meta = self.b, self.decode_meta
        q_seq, q_pos = meta[0][:, None], meta[1][:, None]  # [B, 1]
        mask_mod = paged_mask_mod(b.pm.page_table, b.pm.phys_to_logical, q_seq, q_pos, b.P,
                                  gqa_packed=True)
        block_mask = decode_block_mask(b.pm.page_table, meta, b.num_pages, b.P, mask_mod, b.gqa_group)
        return FlexStep(b, meta[2], block_mask, q_pos, b.gqa_group)


class GatherPrefillStep(PoolStep):
    """Prefill chunks attended by SDPA: each chunk's sequence, positions 0 .. start + n - 1, is
    GATHERed from the pool (after the step's ASSIGN) into one packed logical-order K/V, then each
    chunk runs one SDPA call over its own keys: causal when the chunk starts the sequence, else
    with a [n, start + n] mask whose first `start` columns (the cached prefix) are all visible.
    No padding: the chunks' tokens are packed as they come."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, seq_ids: Sequence[int],
                 counts: Sequence[int], starts: Sequence[int]):
        self.b, self.slots = backend, slots
        ctx = [s + n for s, n in zip(starts, counts)]
        # pool slot of every logical position 0 .. start + n - 1 of each chunk's sequence
        kv_seq = np.repeat(np.asarray(seq_ids, dtype=np.int64), ctx)
        kv_pos = np.concatenate([np.arange(n) for n in ctx])
        self.kv_slots = backend.pm.slots(kv_seq, kv_pos)
        q_off, k_off = np.cumsum([0, *counts]), np.cumsum([0, *ctx])
        self.chunks = []  # (query offset, n, key offset, keys, mask or None = causal)
        for i, (start, n) in enumerate(zip(starts, counts)):
            mask = None
            if start:  # query j (position start + j) sees keys 0 .. start + j
                mask = torch.ones(n, start + n, dtype=torch.bool, device=backend.device).tril(start)
            self.chunks.append((int(q_off[i]), n, int(k_off[i]), start + n, mask))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [1, H, T, D]; kp, vp: [1, Hkv, NP, D] -> [1, H, T, D]
        keys, values = read_slots(kp, vp, self.kv_slots)  # [1, Hkv, sum(start + n), D], logical order
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, qo : qo + n], keys[:, :, ko : ko + L], values[:, :, ko : ko + L],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            for qo, n, ko, L, mask in self.chunks
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class GatherDecodeStep:
    """Decode rows by GATHER + SDPA: each row's logical K/V (positions 0 .. span - 1) read from
    its pages, a causal mask per row. `prepare` returns a `PreparedGatherStep` (the gather indices
    and the mask, from the device page table by device ops only)."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, seqs: torch.Tensor,
                 positions: torch.Tensor, span: int, q_pos: torch.Tensor):
        self.b = backend
        self.slots = slots  # [B] pool slot of every new token
        self.seqs = seqs  # [B] sequence of each row (0 for inactive rows)
        self.positions = positions  # [B, 1]
        self.span = span  # host-known: 1 + the largest position this step
        self.q_pos = q_pos  # [B] query positions, -1 for inactive rows

    def prepare(self) -> PreparedGatherStep:
        P, dev = self.b.P, self.positions.device
        j = torch.arange(self.span, device=dev)
        pages = self.b.pm.page_table.index_select(0, self.seqs)  # [B, max_pages]
        col = (j // P).clamp(max=pages.shape[1] - 1)
        kv_slots = slot(pages[:, col].long(), j, P)  # [B, L]
        # mask: [B, 1, 1, L]; key position <= query position
        mask = (j[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)
        # inactive rows see only slot 0 of the null page (finite softmax; output discarded)
        inactive = (self.q_pos < 0)[:, None, None, None]
        mask = mask & ~inactive | (j == 0)[None, None, None, :] & inactive
        return PreparedGatherStep(self.b, self.slots, kv_slots, mask)


class PreparedGatherStep(PoolStep):
    """A `GatherDecodeStep` ready to attend: the gather indices and mask shared by all layers."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, kv_slots: torch.Tensor,
                 mask: torch.Tensor):
        self.b = backend
        self.slots = slots  # [B] pool slot of every new token
        self.kv_slots = kv_slots  # [B, L] pool slot of each row's logical positions 0..L-1
        self.mask = mask  # [B, 1, 1, L]

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        keys, values = read_slots(kp, vp, self.kv_slots)  # [1, Hkv, B, L, D]
        keys, values = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # [B, Hkv, L, D]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)


class MixedStep(PoolStep):
    """Decodes and prefill chunks in one forward: the packed row holds `B` decode tokens (one per
    row of a decode batch, padded) and then the prefill tokens. Linear layers run on all of them
    at once; attention runs each part on its own (decode rows through their own pages; the
    prefill part through its chunks' pages), so a decode token never scans the union of pages of
    the sequences sharing its query block."""

    def __init__(self, decode, prefill: PoolStep, rows: int, slots: torch.Tensor | None = None):
        self.decode, self.prefill, self.rows = decode, prefill, rows
        self.b = prefill.b
        self.slots = slots  # [B + Tp] pool slot of every token of the row (set by prepare)

    def prepare(self) -> MixedStep:
        if self.slots is not None:
            return self
        decode = self.decode.prepare()
        return MixedStep(decode, self.prefill, self.rows, torch.cat([decode.slots, self.prefill.slots]))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [1, H, B + Tp, D], a view of [1, B + Tp, H, D]. Compiled flex kernels are specialised
        # on strides: each part gets the strides a pure decode / pure prefill step gives it, so
        # mixed steps reuse their kernels (a plain slice's strides would depend on the other
        # part's length: one recompilation per new (B, Tp) pair)
        B = self.rows
        rows = q.transpose(1, 2)  # [1, B + Tp, H, D]
        qd = rows[0, :B].unsqueeze(1).transpose(1, 2)  # [B, H, 1, D], no copy
        od = self.decode.attention(qd, kp, vp)
        qp = rows[:, B:].clone(memory_format=torch.contiguous_format).transpose(1, 2)  # [1, H, Tp, D]
        op = self.prefill.attention(qp, kp, vp)
        return torch.cat([od.squeeze(2).transpose(0, 1).unsqueeze(0), op], dim=2)


def prefill_bucket(T: int) -> int:
    """Packed prefill length of the flex kernel rounded up, so few distinct shapes are compiled:
    powers of two from 128 to 1024, then multiples of 1024."""
    if T <= 1024:
        return max(128, 1 << (T - 1).bit_length())
    return pages_for(T, 1024) * 1024
