"""FlexAttention mask_mod / score_mod through the block table, and BlockMasks built from it.

Queries come in a layout [B', S'] (decode: one row per sequence, S' = 1; prefill: all prompts packed
into one row, B' = 1) described by two tables: `q_seq[b, i]` (the sequence id of query token i of
row b) and `q_pos[b, i]` (its logical position; -1 for padding). Keys/values are the whole page pool
`[1, Hkv, num_pages * P, D]`. A pool slot `kv` is visible to a query iff
  - its page is owned by the query's sequence: `lp = phys_to_logical[kv // P] >= 0` and
    `page_table[seq, lp] == kv // P` (freed or foreign pages, even with stale data, never match),
  - and it is causal: logical position `lp * P + kv % P <= q_pos` (which also bounds it by the
    sequence length, since every position up to the query's own has been written).

The BlockMask (KV block = one page) lists, for each query block, the physical pages it may touch,
straight from the page table: no `create_block_mask` over the pool. Pages that every query of the
block sees entirely are "full" blocks (mask_mod skipped); the rest are "partial".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

Q_BLOCK = 128  # query block size of the prefill BlockMask (decode rows hold a single query)


def paged_mask_mod(page_table: torch.Tensor, phys_to_logical: torch.Tensor, q_seq: torch.Tensor,
                   q_pos: torch.Tensor, page_size: int, gqa_packed: bool = False) -> Callable:
    """mask_mod(b, h, q_idx, kv_idx) for a page pool.

    page_table: [max_seqs, max_pages] int32; phys_to_logical: [num_pages] int32;
    q_seq, q_pos: [B', S'] int32 (the query layout). `gqa_packed`: decode with the G query heads of
    each kv head packed into the query dimension (q_idx is a head within the group, S' = 1).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        qi = q_idx * 0 if gqa_packed else q_idx
        page = kv_idx // page_size
        lp = phys_to_logical[page]
        seq = q_seq[b, qi]
        owned = (lp >= 0) & (page_table[seq, lp.clamp(min=0)] == page)
        return owned & (lp * page_size + kv_idx % page_size <= q_pos[b, qi])

    return mask_mod


def logical_score_mod(score_mod: Callable, phys_to_logical: torch.Tensor, q_pos: torch.Tensor,
                      page_size: int, gqa_group: int = 0) -> Callable:
    """Wrap a user `score_mod(score, b, h, q_pos, kv_pos)` written in logical positions (as for a
    dense cache) so it runs over the pool: physical kv index -> logical position of its sequence.
    `gqa_group` = G for GQA-packed decode (flex's h is then the kv head, q_idx the head in it)."""

    def paged_score_mod(score, b, h, q_idx, kv_idx):
        page = kv_idx // page_size
        kv_pos = phys_to_logical[page].clamp(min=0) * page_size + kv_idx % page_size
        if gqa_group:
            return score_mod(score, b, h * gqa_group + q_idx, q_pos[b, q_idx * 0], kv_pos)
        return score_mod(score, b, h, q_pos[b, q_idx], kv_pos)

    return paged_score_mod


class DecodeBlockMask:
    """Persistent BlockMask tensors for decode: B rows, one query each, fixed shapes (no recompiles).

    Row b attends to the pages of sequence `seq_ids[b]`: its first `len // P` pages are full blocks,
    the page holding position `len - 1` (if not full) the one partial block. Inactive rows: none.
    """

    def __init__(self, max_batch: int, num_pages: int, max_pages: int, page_size: int,
                 device: torch.device, q_len: int = 1):
        B, N = max_batch, num_pages
        self.q_len = q_len  # queries per row: 1, or G when GQA groups are packed into it
        i32 = dict(dtype=torch.int32, device=device)
        self.page_size = page_size
        self.max_pages = max_pages
        self.num_pages = num_pages
        # one int32 buffer holds every per-row scalar, refilled by a single host->device copy:
        # rows q_seq, q_pos, full_num, part_num; the BlockMask/mask_mod tensors are views of it
        self._meta = torch.zeros(4, B, **i32)
        self._meta[1] = -1
        self.q_seq = self._meta[0].view(B, 1)  # [B, 1]
        self.q_pos = self._meta[1].view(B, 1)  # [B, 1]
        self.full_num = self._meta[2].view(B, 1, 1)
        self.part_num = self._meta[3].view(B, 1, 1)
        self._last = torch.zeros(B, 1, dtype=torch.int64, device=device)  # index of the partial page
        self.full_idx = torch.zeros(B, 1, 1, N, **i32)  # CPU flex wants the KV dim to span the pool
        self.part_idx = torch.zeros(B, 1, 1, N, **i32)

    def update(self, page_table: torch.Tensor, seq_ids: Sequence[int], lengths: Sequence[int],
               active: Sequence[bool]) -> None:
        """Refill in place from host-known ids/lengths (after this step's tokens are reserved) and
        the device page table: two small host->device copies plus two device gathers, no sync."""
        P, B = self.page_size, len(seq_ids)
        lens = np.asarray(lengths, dtype=np.int64) * np.asarray(active, dtype=np.int64)
        host = np.empty((4, B), dtype=np.int32)
        host[0] = seq_ids
        host[1] = lens - 1
        host[2] = lens // P
        host[3] = lens % P > 0
        self._meta[:, :B].copy_(torch.from_numpy(host), non_blocking=True)
        last = np.minimum(host[2], self.max_pages - 1).astype(np.int64)[:, None]
        self._last[:B].copy_(torch.from_numpy(last), non_blocking=True)
        rows = page_table.index_select(0, self._meta[0, :B])  # [B, max_pages]
        self.full_idx[:B, 0, 0, : self.max_pages] = rows
        self.part_idx[:B, 0, 0, :1] = rows.gather(1, self._last[:B])

    def block_mask(self, mask_mod: Callable, B: int | None = None) -> BlockMask:
        B = B or self.q_seq.shape[0]
        return BlockMask.from_kv_blocks(
            self.part_num[:B], self.part_idx[:B], self.full_num[:B], self.full_idx[:B],
            BLOCK_SIZE=(Q_BLOCK, self.page_size), mask_mod=mask_mod,
            seq_lengths=(self.q_len, self.num_pages * self.page_size), compute_q_blocks=False,
        )


def prefill_block_mask(
    seq_pages: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
    num_pages: int, page_size: int, mask_mod: Callable, device: torch.device,
) -> BlockMask:
    """BlockMask for packed prefill: sequence i contributes `counts[i]` query tokens at logical
    positions `starts[i] ..`, its pages are `seq_pages[i]` (host list, logical order).

    Built on the host from the page lists (prefill metadata is host-known): per query block, the
    union of pages its sequences can see; with a single sequence in the block, pages wholly before
    its first query are full blocks.
    """
    P = page_size
    T = int(sum(counts))
    nqb = max(1, -(-T // Q_BLOCK))
    full_idx = np.zeros((nqb, num_pages), dtype=np.int32)
    part_idx = np.zeros((nqb, num_pages), dtype=np.int32)
    full_num = np.zeros(nqb, dtype=np.int32)
    part_num = np.zeros(nqb, dtype=np.int32)
    # segments: the run of each sequence's tokens inside each query block
    offsets = np.concatenate([[0], np.cumsum(counts)])
    segs: list[list[tuple[int, int, int]]] = [[] for _ in range(nqb)]  # (seq index, min pos, max pos)
    for i, (start, n) in enumerate(zip(starts, counts)):
        if n == 0:
            continue
        lo, hi = offsets[i], offsets[i] + n  # token range [lo, hi)
        for j in range(lo // Q_BLOCK, (hi - 1) // Q_BLOCK + 1):
            a, b = max(lo, j * Q_BLOCK), min(hi, (j + 1) * Q_BLOCK)
            segs[j].append((i, start + a - lo, start + b - 1 - lo))
    for j, block in enumerate(segs):
        block = [seg for seg in block if len(seq_pages[seg[0]])]  # the padding run has no pages
        if not block:
            continue
        if len(block) == 1:
            i, pmin, pmax = block[0]
            pages = np.asarray(seq_pages[i][: pmax // P + 1], dtype=np.int32)
            n_full = (pmin + 1) // P  # pages entirely at positions <= pmin
            full, part = pages[:n_full], pages[n_full:]
        else:
            full = np.zeros(0, dtype=np.int32)
            part = np.unique(np.concatenate(
                [np.asarray(seq_pages[i][: pmax // P + 1], dtype=np.int32) for i, _, pmax in block]
            ))
        full_num[j], part_num[j] = len(full), len(part)
        full_idx[j, : len(full)] = full
        part_idx[j, : len(part)] = part

    def dev(a: np.ndarray, shape) -> torch.Tensor:
        return torch.from_numpy(a).reshape(shape).to(device)

    return BlockMask.from_kv_blocks(
        dev(part_num, (1, 1, nqb)), dev(part_idx, (1, 1, nqb, num_pages)),
        dev(full_num, (1, 1, nqb)), dev(full_idx, (1, 1, nqb, num_pages)),
        BLOCK_SIZE=(Q_BLOCK, P), mask_mod=mask_mod, seq_lengths=(T, num_pages * P),
        compute_q_blocks=False,
    )
