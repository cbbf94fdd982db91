"""The block-table mask and BlockMasks against an independent element-wise model of visibility.

For a PageManager holding scattered, shared (forked) and erased pages, the expected visibility of
every (query, pool slot) pair is computed in plain Python from the host page lists; the mask_mod,
the block lists (full/partial) and create_block_mask over the same mask_mod must all agree with it.
The manager's device views, the masks and the BlockMasks are on the test device (`--device`).
"""

import random

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from fms_paged.flex.masks import (
    Q_BLOCK,
    decode_block_mask,
    decode_meta,
    logical_score_mod,
    paged_mask_mod,
    prefill_block_mask,
)
from fms_paged.kv import PageManager


def scattered_manager(device, P, lengths, num_pages=64, seed=0):
    pm = PageManager(num_pages, P, max_seqs=8, device=device, max_seq_len=P * 48)
    random.Random(seed).shuffle(pm._free)  # scatter the pages
    pm.reserve([7], [3 * P])  # a sequence that will be erased: its pages hold stale data
    for s, n in lengths.items():
        pm.reserve([s], [n])
    pm.erase([7])
    return pm


def expected_visibility(pm, q_seq, q_pos, P):
    """E[b, i, kv]: slot kv holds a position <= q_pos of sequence q_seq (pure Python)."""
    B, S = q_seq.shape
    E = np.zeros((B, S, pm.num_pages * P), dtype=bool)
    for b in range(B):
        for i in range(S):
            s, qp = int(q_seq[b, i]), int(q_pos[b, i])
            if qp < 0:
                continue
            for lp, page in enumerate(pm.pages_of(s)):
                for off in range(P):
                    if lp * P + off <= qp:
                        E[b, i, page * P + off] = True
    return E


def listed_blocks(bm):
    """Dense [B, nqb, nkvb] of (full, partial) block membership from a BlockMask's lists."""
    def dense(num, idx):
        B, _, nq = num.shape
        out = np.zeros((B, nq, idx.shape[-1]), dtype=bool)
        for b in range(B):
            for j in range(nq):
                out[b, j, idx[b, 0, j, : num[b, 0, j]].numpy()] = True
        return out

    part = dense(bm.kv_num_blocks.cpu(), bm.kv_indices.cpu())
    if bm.full_kv_num_blocks is None:
        return np.zeros_like(part), part
    return dense(bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu()), part


def check_block_mask(bm, E, P, q_block):
    full, part = listed_blocks(bm)
    assert not (full & part).any(), "a block is listed both full and partial"
    B, S, KV = E.shape
    for b in range(B):
        for j in range(full.shape[1]):
            rows = E[b, j * q_block : (j + 1) * q_block]
            if rows.size == 0:
                continue
            for page in range(KV // P):
                blk = rows[:, page * P : (page + 1) * P]
                if blk.any():
                    assert full[b, j, page] or part[b, j, page], (b, j, page)
                if full[b, j, page]:
                    assert blk.all(), f"full block {page} is not fully visible"


@pytest.mark.parametrize("P", [1, 4, 16])
def test_decode_mask_and_blocks(P, device):
    lengths = {0: 1, 3: P - 1 if P > 1 else 2, 5: 2 * P + 1, 6: 4 * P}
    pm = scattered_manager(device, P, lengths)
    seq_ids = [5, 0, 3, 6, 2]  # non-contiguous rows, and an inactive row (2 is not live)
    active = [True, True, True, True, False]
    q_pos = [lengths[s] - 1 if a else -1 for s, a in zip(seq_ids, active)]
    slots = pm.slots([s for s, a in zip(seq_ids, active) if a], [q for q in q_pos if q >= 0]).tolist()
    slots.append(0)  # the inactive row's
    meta = decode_meta([s if a else 0 for s, a in zip(seq_ids, active)], q_pos, slots, P).to(device)
    q_seq, q_p = meta[0][:, None], meta[1][:, None]
    mm = paged_mask_mod(pm.page_table, pm.phys_to_logical, q_seq, q_p, P)
    E = expected_visibility(pm, q_seq, q_p, P)
    got = create_mask(mm, len(seq_ids), 1, 1, pm.num_pages * P, device=device)[:, 0]
    assert np.array_equal(got.cpu().numpy(), E)
    check_block_mask(decode_block_mask(pm.page_table, meta, pm.num_pages, P, mm), E, P, q_block=1)
    # every page a row reaches as a partial block (no full ones), with and without a window: the
    # pages listed are exactly those holding a visible slot
    for window in (None, P + 1, 3 * P):
        mm = paged_mask_mod(pm.page_table, pm.phys_to_logical, q_seq, q_p, P, window=window)
        seen = create_mask(mm, len(seq_ids), 1, 1, pm.num_pages * P, device=device)[:, 0].cpu().numpy()
        bm = decode_block_mask(pm.page_table, meta, pm.num_pages, P, mm, window=window, full_blocks=False)
        full, part = listed_blocks(bm)
        assert bm.full_kv_num_blocks is None
        assert np.array_equal(part[:, 0], seen[:, 0].reshape(len(seq_ids), -1, P).any(-1)), window


@pytest.mark.parametrize("P", [4, 16])
def test_prefill_mask_and_blocks(P, device):
    # chunked prefill: seq 1 already holds 5 tokens; seq 4 is new; a long one spans query blocks
    pm = scattered_manager(device, P, {1: 5}, num_pages=128)
    prompts = {1: 9, 4: 3, 2: 150}
    starts = {1: 5, 4: 0, 2: 0}
    for s, n in prompts.items():
        pm.reserve([s], [starts[s] + n])
    ids = list(prompts)
    q_seq = torch.tensor([s for s in ids for _ in range(prompts[s])], dtype=torch.int32, device=device)[None]
    q_pos = torch.tensor([starts[s] + k for s in ids for k in range(prompts[s])],
                         dtype=torch.int32, device=device)[None]
    mm = paged_mask_mod(pm.page_table, pm.phys_to_logical, q_seq, q_pos, P)
    bm = prefill_block_mask([pm.pages_of(s) for s in ids], [starts[s] for s in ids],
                            [prompts[s] for s in ids], pm.num_pages, P, mm, device)
    E = expected_visibility(pm, q_seq, q_pos, P)
    got = create_mask(mm, 1, 1, q_seq.shape[1], pm.num_pages * P, device=device)[:, 0]
    assert np.array_equal(got.cpu().numpy(), E)
    check_block_mask(bm, E, P, q_block=Q_BLOCK)
    # create_block_mask over the same mask_mod lists the same blocks (as a set, full or partial)
    ref = create_block_mask(mm, 1, None, q_seq.shape[1], pm.num_pages * P, device=device,
                            BLOCK_SIZE=(Q_BLOCK, P)).to_dense()[0, 0].cpu().numpy().astype(bool)
    full, part = listed_blocks(bm)
    assert np.array_equal((full | part)[0][:, : ref.shape[1]], ref)


def test_logical_score_mod_sees_logical_positions(device):
    P = 4
    pm = scattered_manager(device, P, {0: 10})
    q_pos = torch.full((1, 1), 9, dtype=torch.int32, device=device)
    seen = {}

    def record(score, b, h, qp, kvp):
        return score + 0 * qp + kvp.to(score.dtype)  # score + logical kv position

    mod = logical_score_mod(record, pm.phys_to_logical, q_pos, P)
    pages = pm.pages_of(0)
    for lp, page in enumerate(pages):
        for off in range(P):
            i = lambda x: torch.tensor(x, device=device)
            out = mod(i(0.0), i(0), i(0), i(0), i(page * P + off))
            seen[lp * P + off] = float(out)
    assert all(seen[pos] == pos for pos in seen)


def test_block_mask_indices_are_sized_by_a_sequence_not_the_pool(device):
    """A pool of 20,000 pages: the decode BlockMask's index tensors span the pool (the kernels
    require it) but on the CPU store B * max_pages_per_seq entries plus one shared tail, not
    B * num_pages (off the CPU the rows are whole: Triton misreads overlapping ones,
    `spanning_view`), and list the same blocks as a small pool's would."""
    P, N = 16, 20_000
    pm = PageManager(N, P, max_seqs=8, device=device, max_seq_len=P * 48)
    lengths = {0: 5, 3: 3 * P, 6: 40 * P + 7}
    for s, n in lengths.items():
        pm.reserve([s], [n])
    seq_ids = [0, 3, 6]
    q_pos = [lengths[s] - 1 for s in seq_ids]
    slots = pm.slots(seq_ids, q_pos).tolist()
    meta = decode_meta(seq_ids, q_pos, slots, P).to(device)
    mm = paged_mask_mod(pm.page_table, pm.phys_to_logical, meta[0][:, None], meta[1][:, None], P)
    bm = decode_block_mask(pm.page_table, meta, N, P, mm)
    B, C = len(seq_ids), pm.max_pages_per_seq
    for idx in (bm.full_kv_indices, bm.kv_indices):
        assert idx.shape == (B, 1, 1, N)
        assert idx.untyped_storage().nbytes() <= 4 * (B * C + N if device.type == "cpu" else B * N)
    full = [bm.full_kv_indices[b, 0, 0, : bm.full_kv_num_blocks[b, 0, 0]].tolist() for b in range(B)]
    assert full == [pm.pages_of(s)[: (q + 1) // P] for s, q in zip(seq_ids, q_pos)]
    part = [bm.kv_indices[b, 0, 0, : bm.kv_num_blocks[b, 0, 0]].tolist() for b in range(B)]
    assert part == [[pm.pages_of(s)[q // P]] if (q + 1) % P else [] for s, q in zip(seq_ids, q_pos)]
    bm = prefill_block_mask([pm.pages_of(6)], [lengths[6] - 10], [10], N, P, mm, device,
                            max_blocks=8 * C)
    assert bm.full_kv_indices.untyped_storage().nbytes() <= 4 * (8 * C + N)
    n_full = (lengths[6] - 10 + 1) // P  # pages wholly before the chunk's first query
    assert bm.full_kv_indices[0, 0, 0, : bm.full_kv_num_blocks[0, 0, 0]].tolist() == pm.pages_of(6)[:n_full]
