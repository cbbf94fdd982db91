"""The "gather" kernel: GATHER each sequence's keys and values into logical order (`read_slots`, the
page manager's GATHER at slots), then attend with SDPA (or, for a soft-cap or sinks, the same math
written out: `fms_paged.kv.spec.attend`). It needs no compiler, so it is the fallback where neither
cpp nor flex runs (MPS, a CPU without a C++ compiler) and, being the plainest, the tests' oracle.

- decode rows: `GatherDecodeStep` -> `PreparedGatherStep` (each row's keys 0 .. span - 1 read from
  its pages, a mask per window);
- prefill chunks: `GatherPrefillStep` (packed, one SDPA call per chunk over its sequence's keys;
  the flex kernel prefills this way on the CPU too).
"""

from __future__ import annotations

import numpy as np
import torch

from fms_paged.kv._pool_ops import read_slots, to_device
from fms_paged.kv.geometry import slot
from fms_paged.kv.kernels.base import Kernel, PoolStep, Scales
from fms_paged.kv.spec import AttentionSpec, attend, visible
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch


class GatherPrefillStep(PoolStep):
    """Prefill chunks attended one by one: each chunk's sequence, positions lo .. start + n - 1, is
    GATHERed from the pool (after the step's ASSIGN) into one packed logical-order K/V, then each
    chunk runs one attention call over its own keys: causal when the chunk starts the sequence and
    no window cuts it, else with a [n, start + n - lo] mask per window. lo is 0, or for a model
    whose every layer is windowed the first position a query of the chunk still sees (earlier pages
    may be released). No padding: the chunks' tokens are packed as they come."""

    def __init__(self, view: PoolView, batch: PrefillBatch):
        self.view, self.slots = view, batch.slots
        P, H = view.page_size, view.horizon
        kv_slots, self.chunks = [], []  # chunks: (query offset, n, key offset, keys, masks or None)
        q_off, k_off = 0, 0
        for pages, start, n in zip(batch.pages, batch.starts, batch.counts):
            lo = 0 if H is None else max(0, start - H + 1)
            pos = np.arange(lo, start + n)
            kv_slots.append(slot(np.asarray(pages, dtype=np.int64)[pos // P], pos, P))
            masks = None
            if start or any(w is not None and w < start + n for w in view.windows):
                q, k = torch.arange(start, start + n)[:, None], torch.from_numpy(pos)[None, :]
                masks = {w: visible(q, k, w).to(view.device) for w in view.windows}
            self.chunks.append((q_off, n, k_off, pos.size, masks))
            q_off, k_off = q_off + n, k_off + pos.size
        # pool slot of every key position of each chunk's sequence, packed
        self.kv_slots = to_device(np.concatenate(kv_slots), view.device)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
        # q: [1, H, T, D]; kp, vp: [1, Hkv, NP, D] -> [1, H, T, D]
        # [1, Hkv, sum(keys), D], logical order (8-bit pages: dequantized to q's dtype)
        keys, values = read_slots(kp, vp, self.kv_slots, *scales, dtype=q.dtype)
        outs = [
            attend(q[:, :, qo : qo + n], keys[:, :, ko : ko + L], values[:, :, ko : ko + L], spec,
                   mask=None if masks is None else masks[spec.window], is_causal=masks is None)
            for qo, n, ko, L, masks in self.chunks
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class GatherDecodeStep:
    """Decode rows by GATHER + SDPA: each row's logical K/V (positions 0 .. span - 1) read from
    its pages, a mask per row and window. `prepare` returns a `PreparedGatherStep` (the gather
    indices and the masks, from the device page table by device ops only)."""

    def __init__(self, view: PoolView, meta: torch.Tensor, span: int):
        self.view = view
        self.meta = meta  # [3, B] on device: sequence (0 for inactive rows), query position (-1), slot
        self.span = span  # host-known: 1 + the largest position this step

    def prepare(self) -> PreparedGatherStep:
        v, (seqs, q_pos, slots) = self.view, self.meta
        P, dev = v.page_size, q_pos.device
        j = torch.arange(self.span, device=dev)
        pages = v.page_table.index_select(0, seqs)  # [B, max_pages]
        col = (j // P).clamp(max=pages.shape[1] - 1)
        kv_slots = slot(pages[:, col].long(), j, P)  # [B, L]
        # inactive rows see only slot 0 of the null page (a finite softmax; output discarded)
        inactive = (q_pos < 0)[:, None, None, None]
        first = (j == 0)[None, None, None, :]
        masks = {}
        for w in v.windows:  # [B, 1, 1, L]: key position visible to the row's query
            seen = visible(q_pos[:, None, None, None], j[None, None, None, :], w)
            masks[w] = seen & ~inactive | first & inactive
        return PreparedGatherStep(v, slots, kv_slots, masks)


class PreparedGatherStep(PoolStep):
    """A `GatherDecodeStep` ready to attend: the gather indices and masks shared by all layers."""

    def __init__(self, view: PoolView, slots: torch.Tensor, kv_slots: torch.Tensor, masks: dict):
        self.view = view
        self.slots = slots  # [B] pool slot of every new token
        self.kv_slots = kv_slots  # [B, L] pool slot of each row's logical positions 0..L-1
        self.masks = masks  # window -> [B, 1, 1, L]

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
        keys, values = read_slots(kp, vp, self.kv_slots, *scales, dtype=q.dtype)  # [1, Hkv, B, L, D]
        keys, values = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # [B, Hkv, L, D]
        return attend(q, keys, values, spec, mask=self.masks[spec.window])


class GatherKernel(Kernel):
    name = "gather"

    def prefill(self, view: PoolView, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, PoolStep]:
        dev = view.device
        step = GatherPrefillStep(view, batch)
        return batch.tokens.to(dev), torch.from_numpy(batch.positions)[None].to(dev), step

    def decode(self, view: PoolView,
               batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, GatherDecodeStep]:
        B = len(batch.seq_ids)
        rows = batch.rows()
        meta = to_device(np.array(list(zip(*rows)), dtype=np.int64).reshape(3, B), view.device)
        positions = meta[1].clamp(min=0).view(B, 1)  # [B, 1] RoPE positions (0 for inactive rows)
        return batch.tokens.view(B, 1), positions, GatherDecodeStep(view, meta, max(batch.lengths) + 1)
