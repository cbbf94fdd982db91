"""FlexAttention mask_mod / score_mod through the block table, and BlockMasks built from it.

Queries come in a layout [B', S'] (decode: one row per sequence, S' = 1; prefill: all prompts packed
into one row, B' = 1) described by two tables: `q_seq[b, i]` (the sequence id of query token i of
row b) and `q_pos[b, i]` (its logical position; -1 for padding). Keys/values are the whole page pool
`[1, Hkv, num_pages * P, D]`. A pool slot `kv` is visible to a query iff
  - its page is owned by the query's sequence: `lp = phys_to_logical[kv // P] >= 0` and
    `page_table[seq, lp] == kv // P` (freed or foreign pages, even with stale data, never match),
  - and it is causal: logical position `lp * P + kv % P <= q_pos` (which also bounds it by the
    sequence length, since every position up to the query's own has been written),
  - and, for a layer with a sliding window W, within it: `q_pos - (lp * P + kv % P) < W`.
A layer's soft-cap is a `score_mod` (`softcap_score_mod`), composed with a user's score_mod written
in logical positions (`logical_score_mod`).

The BlockMask (KV block = one page) lists, for each query block, the physical pages it may touch,
straight from the page table: no `create_block_mask` over the pool; with a window, only the pages
the window reaches. Pages that every query of the block sees entirely are "full" blocks (mask_mod
skipped); the rest are "partial". Its index tensors
hold as many entries per query block as a sequence can have pages (`spanning_view`), not one per
pool page: a pool sized by memory has tens of thousands of pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

Q_BLOCK = 128  # query block size of the prefill BlockMask (decode rows hold a single query)


def paged_mask_mod(page_table: torch.Tensor, phys_to_logical: torch.Tensor, q_seq: torch.Tensor,
                   q_pos: torch.Tensor, page_size: int, gqa_packed: bool = False,
                   window: int | None = None) -> Callable:
    """mask_mod(b, h, q_idx, kv_idx) for a page pool.

    page_table: [max_seqs, max_pages] int32; phys_to_logical: [num_pages] int32;
    q_seq, q_pos: [B', S'] int32 (the query layout). `gqa_packed`: decode with the G query heads of
    each kv head packed into the query dimension (q_idx is a head within the group, S' = 1).
    `window`: a sliding window, and-ed with the rest (None: every earlier position).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        qi = q_idx * 0 if gqa_packed else q_idx
        page = kv_idx // page_size
        lp = phys_to_logical[page]
        seq = q_seq[b, qi]
        owned = (lp >= 0) & (page_table[seq, lp.clamp(min=0)] == page)
        kv_pos, qp = lp * page_size + kv_idx % page_size, q_pos[b, qi]
        seen = owned & (kv_pos <= qp)
        return seen if window is None else seen & (qp - kv_pos < window)

    return mask_mod


def softcap_score_mod(softcap: float, inner: Callable | None = None) -> Callable:
    """score_mod of a logit soft-cap (Gemma 2): a scaled score s -> softcap * tanh(s / softcap),
    after `inner` (a score_mod over the same indices) where given."""

    def capped(score, b, h, q_idx, kv_idx):
        if inner is not None:
            score = inner(score, b, h, q_idx, kv_idx)
        return torch.tanh(score / softcap) * softcap

    return capped


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


def spanning_view(rows: torch.Tensor, num_blocks: int, lead: tuple[int, ...]) -> torch.Tensor:
    """[R, W] block lists (row r's used entries first) -> a view of shape `lead + (num_blocks,)`
    (prod(lead) == R) whose row r starts with rows[r].

    FlexAttention's kernels require the index tensors' last dim to span the whole KV axis (here:
    every page of the pool) but read only the first `num_blocks[r]` <= W entries of each row. So
    the rows overlap in one buffer of R * W + num_blocks - W entries (the tail never read) instead
    of R * num_blocks: with a pool of 50k pages and 64 rows, 12 MB a step less to write. On the
    CPU only: Triton's flex kernels (CUDA) read overlapping rows wrongly (a decode row past the
    first few pages attended to the wrong pages), so off the CPU the rows are written out whole
    (a few MB a step at most, negligible against a GPU's bandwidth).
    """
    R, W = rows.shape
    if rows.device.type != "cpu":
        return F.pad(rows, (0, max(0, num_blocks - W)))[:, :num_blocks].reshape(*lead, num_blocks)
    if W >= num_blocks:
        return rows[:, :num_blocks].reshape(*lead, num_blocks)
    flat = F.pad(rows.reshape(-1), (0, num_blocks - W))
    strides = [W * math.prod(lead[i + 1 :]) for i in range(len(lead))]
    return flat.as_strided((*lead, num_blocks), (*strides, 1))


def decode_meta(seq_ids: Sequence[int], q_pos: Sequence[int], slots: Sequence[int],
                page_size: int) -> torch.Tensor:
    """Host-known decode metadata -> [6, B] int64 (host tensor), rows: seq id, query position,
    pool slot of the new token, pages seen whole ((q_pos + 1) // P), partial pages (1 if the page
    holding q_pos is only partly visible), RoPE position (q_pos, 0 for an inactive row).
    q_pos = -1 marks an inactive row: pass seq 0 (any valid table row) and slot 0 (the null page's,
    never readable); it sees no page."""
    P = page_size
    full = [(q + 1) // P for q in q_pos]  # q = -1: no page
    part = [int((q + 1) % P > 0) for q in q_pos]
    rope = [q if q > 0 else 0 for q in q_pos]
    # via numpy: cheaper than torch.tensor on nested lists (a per-step host cost)
    return torch.from_numpy(np.array([seq_ids, q_pos, slots, full, part, rope], dtype=np.int64))


def decode_block_mask(page_table: torch.Tensor, meta: torch.Tensor, num_pages: int, page_size: int,
                      mask_mod: Callable, q_len: int = 1, window: int | None = None,
                      full_blocks: bool = True) -> BlockMask:
    """BlockMask for decode (one query row per sequence), from the page table by device ops alone.

    page_table: [max_seqs, C] int32; meta: [6, B] from `decode_meta`, on the table's device. Row b
    sees its sequence's first `(q_pos + 1) // P` pages whole (listed straight from the table row)
    and, if the page holding q_pos (the new token's, slot // P) is only partly visible, that page
    as the one partial block (mask_mod applied). With a `window`, the row sees the pages from the
    one holding q_pos - window + 1: those wholly inside the window are full, the first and the
    last partial where the window or q_pos cuts them (`window_blocks`). Shapes depend only on
    (B, num_pages), so a compiled decode step never recompiles; no host sync, no loop over pages.
    `q_len`: queries per row (G when GQA groups are packed into the query).
    `full_blocks=False`: every page the row reaches as a partial block (mask_mod on each, no full
    blocks), the same visible set. Triton's flex decoding template (torch 2.11) splits a row's
    blocks over its CTAs by the row's own block count only when the mask has no full blocks; with
    them it splits the KV axis, the whole pool here (`cdiv(KV_LEN, SPLIT_KV)` per CTA).
    """
    B, N, P = meta.shape[1], num_pages, page_size
    seq, slots = meta[0], meta[2]
    rows = page_table.index_select(0, seq)  # [B, C]
    if not full_blocks:
        q_pos, C = meta[1], rows.shape[1]
        first = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0) // P
        count = ((q_pos.clamp(min=0) // P - first + 1) * (q_pos >= 0)).to(torch.int32).view(B, 1, 1)
        if window is not None:  # each row's pages from the first the window reaches
            rows = rows.gather(1, (first[:, None] + torch.arange(C, device=rows.device)).clamp(max=C - 1))
        return BlockMask.from_kv_blocks(
            count, spanning_view(rows, N, (B, 1, 1)), BLOCK_SIZE=(Q_BLOCK, P), mask_mod=mask_mod,
            seq_lengths=(q_len, N * P), compute_q_blocks=False,
        )
    if window is None:
        # separate buffers: inductor's CPU flex template names its pointer arguments by storage
        full_num = meta[3].to(torch.int32).view(B, 1, 1)
        part_num = meta[4].to(torch.int32).view(B, 1, 1)
        part = (slots // P).to(torch.int32)[:, None]  # [B, 1]
    else:
        full_num, full_first, part_num, part = window_blocks(meta[1], rows, window, P)
        C = rows.shape[1]
        cols = (full_first[:, None] + torch.arange(C, device=rows.device)).clamp(max=C - 1)
        rows = rows.gather(1, cols)  # each row's full pages first
        full_num, part_num = full_num.view(B, 1, 1), part_num.view(B, 1, 1)
    # indices: [B, 1, 1, num_pages] views of [B, max_pages_per_seq] and [B, 1 or 2] lists
    full_idx = spanning_view(rows, N, (B, 1, 1))
    part_idx = spanning_view(part, N, (B, 1, 1))
    return BlockMask.from_kv_blocks(
        part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, P),
        mask_mod=mask_mod, seq_lengths=(q_len, N * P), compute_q_blocks=False,
    )


def window_blocks(q_pos: torch.Tensor, rows: torch.Tensor, window: int,
                  P: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages a decode row at `q_pos` ([B] int64, -1 for a row that sees nothing) sees through a
    window: positions lo = max(0, q_pos - window + 1) .. q_pos, on logical pages lo // P ..
    q_pos // P. -> (full count [B] int32, first full logical page [B], partial count [B] int32,
    partial pages [B, 2] int32: the page lo cuts, then the page q_pos cuts; a page cut at both
    ends is listed once). rows: [B, C] the rows' page-table rows."""
    lo = (q_pos - window + 1).clamp(min=0)
    first, last = lo // P, q_pos.clamp(min=0) // P
    head = lo % P != 0  # the first page starts before the window
    tail = (q_pos + 1) % P != 0  # the last page holds positions after q_pos
    active = q_pos >= 0
    n_full = (last - tail.long() - first - head.long() + 1).clamp(min=0)
    single = first == last
    n_part = torch.where(single, (head | tail).long(), head.long() + tail.long())
    n_full, n_part = n_full * active, n_part * active
    take = lambda lp: rows.gather(1, lp.clamp(max=rows.shape[1] - 1)[:, None])[:, 0]  # noqa: E731
    part = torch.stack([torch.where(head, take(first), take(last)), take(last)], dim=1)
    return n_full.to(torch.int32), first + head.long(), n_part.to(torch.int32), part.to(torch.int32)


def prefill_block_mask(
    seq_pages: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
    num_pages: int, page_size: int, mask_mod: Callable, device: torch.device,
    max_blocks: int | None = None, window: int | None = None,
) -> BlockMask:
    """BlockMask for packed prefill: sequence i contributes `counts[i]` query tokens at logical
    positions `starts[i] ..`, its pages are `seq_pages[i]` (host list, logical order).

    Built on the host from the page lists (prefill metadata is host-known): per query block, the
    union of pages its sequences can see (with a `window`, from the page holding its first
    query's position - window + 1); with a single sequence in the block, pages every query of the
    block sees whole are full blocks. `max_blocks` bounds that union (the backend's rows x pages
    a sequence can hold; default num_pages): a fixed width, so the index tensors' strides, which
    a compiled kernel is specialised on, do not change from step to step.
    """
    P = page_size
    T = int(sum(counts))
    nqb = max(1, -(-T // Q_BLOCK))
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

    def seen(i: int, pmin: int, pmax: int) -> tuple[int, np.ndarray]:
        """(first logical page, pages) that queries at pmin .. pmax of sequence i reach."""
        lo = 0 if window is None else max(0, pmin - window + 1) // P
        return lo, np.asarray(seq_pages[i][lo : pmax // P + 1], dtype=np.int32)

    lists: list[tuple[np.ndarray, np.ndarray]] = []  # (full, partial) pages of each query block
    empty = np.zeros(0, dtype=np.int32)
    for block in segs:
        block = [seg for seg in block if len(seq_pages[seg[0]])]  # the padding run has no pages
        if not block:
            lists.append((empty, empty))
            continue
        if len(block) == 1:
            i, pmin, pmax = block[0]
            lo, pages = seen(i, pmin, pmax)
            # full: logical pages j with j * P >= pmax - window + 1 (seen by the last query) and
            # (j + 1) * P - 1 <= pmin (seen by the first)
            j = np.arange(lo, lo + pages.size)
            whole = (j + 1) * P - 1 <= pmin
            if window is not None:
                whole &= j * P >= pmax - window + 1
            full, part = pages[whole], pages[~whole]
        else:
            full = np.zeros(0, dtype=np.int32)
            part = np.unique(np.concatenate([seen(i, pmin, pmax)[1] for i, pmin, pmax in block]))
        lists.append((full, part))
    full_num = np.array([len(f) for f, _ in lists], dtype=np.int32)
    part_num = np.array([len(p) for _, p in lists], dtype=np.int32)
    W = min(num_pages, max_blocks or num_pages)
    full_idx = np.zeros((nqb, W), dtype=np.int32)
    part_idx = np.zeros((nqb, W), dtype=np.int32)
    for j, (full, part) in enumerate(lists):
        full_idx[j, : len(full)] = full
        part_idx[j, : len(part)] = part

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return BlockMask.from_kv_blocks(
        dev(part_num).view(1, 1, nqb), spanning_view(dev(part_idx), num_pages, (1, 1, nqb)),
        dev(full_num).view(1, 1, nqb), spanning_view(dev(full_idx), num_pages, (1, 1, nqb)),
        BLOCK_SIZE=(Q_BLOCK, P), mask_mod=mask_mod, seq_lengths=(T, num_pages * P),
        compute_q_blocks=False,
    )
