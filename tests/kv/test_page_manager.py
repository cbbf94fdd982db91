"""Unit tests of PageManager: bookkeeping, KV round trips, copy-on-write, bad input, no host sync.

References are independent of the implementation: plain dicts of what was written, slots recomputed
from the device page table with torch ops, and the attention-mask rule from the architecture.
Device views and pools live on the test device (`--device`).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from fms_paged.kv import OutOfPages, PageManager, _pool_ops
from fms_paged.kv import page_manager as page_manager_mod
from fms_paged.kv.page_manager import write_slots

H, D = 2, 3  # kv heads, head dim of the toy pools


def make_pools(pm: PageManager, layers: int = 1, dtype=torch.float32):
    # pool: [L, Hkv, num_pages*P, D]
    shape = (layers, H, pm.num_pages * pm.page_size, D)
    return (torch.zeros(shape, dtype=dtype, device=pm.device),
            torch.zeros(shape, dtype=dtype, device=pm.device))


def snapshot(pm: PageManager, *pools: torch.Tensor) -> dict:
    """Everything a failed call must leave untouched (host mirror, device views, pool, pools)."""
    return {
        "free": pm.free_pages,
        "refcounts": pm.refcounts.tolist(),
        "held": pm.held_pages,
        "live": pm.live_seqs,
        "lens": [pm.length(s) for s in range(pm.max_seqs)],
        "pages": [pm.pages_of(s) for s in range(pm.max_seqs)],
        "page_table": pm.page_table.clone(),
        "seq_lens": pm.seq_lens.clone(),
        "p2l": pm.phys_to_logical.clone(),
        "pools": [p.clone() for p in pools],
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        elif key == "pools":
            assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True)), key
        else:
            assert x == y, key


def ref_slots(pm: PageManager, seqs, positions) -> torch.Tensor:
    """Slot rule from the architecture, computed with torch from the DEVICE page table."""
    s, pos = torch.as_tensor(seqs, device=pm.device), torch.as_tensor(positions, device=pm.device)
    P = pm.page_size
    return pm.page_table[s, pos // P].long() * P + pos % P


def visible_pages(pm: PageManager, seq: int) -> set[int]:
    """Pages whose slots the attention mask shows to `seq` (rule: p2l >= 0 and table hit)."""
    p2l = pm.phys_to_logical
    out = set()
    for page in range(pm.num_pages):
        lp = int(p2l[page])
        if lp >= 0 and int(pm.page_table[seq, lp]) == page:
            out.add(page)
    return out


# ---------------------------------------------------------------------------- bookkeeping
def test_fresh_manager_views(device):
    pm = PageManager(10, 4, 3, device=device)
    assert pm.max_pages_per_seq == 9 and pm.max_seq_len == 36
    assert pm.page_table.shape == (3, 9) and pm.page_table.dtype == torch.int32
    assert pm.seq_lens.shape == (3,) and pm.seq_lens.dtype == torch.int32
    assert pm.phys_to_logical.shape == (10,) and pm.phys_to_logical.dtype == torch.int32
    assert pm.num_free_pages == 9 and 0 not in pm.free_pages
    assert pm.utilization == 0.0 and pm.live_seqs == []
    assert (pm.phys_to_logical == -1).all() and (pm.page_table == 0).all()


def test_max_seq_len_bounds_table_width(device):
    pm = PageManager(1000, 16, 4, max_seq_len=100, device=device)
    assert pm.max_pages_per_seq == math.ceil(100 / 16) == 7
    assert pm.page_table.shape == (4, 7)
    pm.reserve([0], [100])
    with pytest.raises(ValueError, match="101"):
        pm.reserve([1], [101])


@pytest.mark.parametrize("P", [1, 3, 4])
def test_reserve_takes_only_missing_pages(P, device):
    pm = PageManager(40, P, 4, device=device)
    pm.reserve([0, 1], [5, 0])
    assert pm.live_seqs == [0, 1]
    assert len(pm.pages_of(0)) == math.ceil(5 / P) and pm.pages_of(1) == []
    first = pm.pages_of(0)
    pm.reserve([0, 1], [9, 2])
    assert pm.pages_of(0)[: len(first)] == first  # old pages kept in place
    assert len(pm.pages_of(0)) == math.ceil(9 / P) and len(pm.pages_of(1)) == math.ceil(2 / P)
    assert pm.num_free_pages == 39 - math.ceil(9 / P) - math.ceil(2 / P)
    assert pm.length(0) == 9 and pm.seq_lens.tolist()[:2] == [9, 2]
    for s in (0, 1):
        pages = pm.pages_of(s)
        assert 0 not in pages
        assert pm.page_table[s, : len(pages)].tolist() == pages
        assert (pm.page_table[s, len(pages) :] == 0).all()
        assert [int(pm.phys_to_logical[p]) for p in pages] == list(range(len(pages)))
        assert visible_pages(pm, s) == set(pages)
    owned = pm.pages_of(0) + pm.pages_of(1)
    assert len(set(owned)) == len(owned) and not set(owned) & set(pm.free_pages)


def test_utilization_counts_distinct_pages(device):
    pm = PageManager(20, 4, 4, device=device)
    pm.reserve([0], [6])  # 2 pages, 6 tokens
    assert pm.utilization == pytest.approx(6 / 8)
    pm.fork(0, 1)  # shares both pages: still 6 tokens in 2 pages
    assert pm.utilization == pytest.approx(6 / 8)
    pm.reserve([1], [9])  # private copy of the half page (4 tokens now) + 1 new page (1 token)
    assert pm.utilization == pytest.approx((4 + 2 + 4 + 1) / (4 * 4))


def test_erase_frees_and_reset(device):
    pm = PageManager(16, 2, 4, device=device)
    pm.reserve([0, 1, 2], [3, 4, 0])
    pages0 = pm.pages_of(0)
    pm.erase([0, 2])
    assert pm.live_seqs == [1] and pm.length(0) == 0 and pm.pages_of(0) == []
    assert set(pages0) <= set(pm.free_pages)
    assert (pm.page_table[0] == 0).all() and int(pm.seq_lens[0]) == 0
    assert all(int(pm.phys_to_logical[p]) == -1 for p in pages0)
    pm.reserve([0], [5])  # a freed id can be reused
    pm.reset()
    assert pm.num_free_pages == 15 and sorted(pm.free_pages) == list(range(1, 16))
    assert pm.live_seqs == [] and (pm.page_table == 0).all() and (pm.seq_lens == 0).all()
    assert (pm.phys_to_logical == -1).all() and not pm.refcounts.any()


def test_out_of_pages_changes_nothing(device):
    pm = PageManager(8, 2, 4, device=device)
    k_pool, v_pool = make_pools(pm)
    pm.reserve([0], [5])  # 3 pages, 4 free
    before = snapshot(pm, k_pool, v_pool)
    with pytest.raises(OutOfPages, match=r"need 5 pages for seqs \[0, 1\], 4 free") as err:
        pm.reserve([0, 1], [7, 8])  # seq 0 alone (1 page) would fit: all-or-nothing
    assert isinstance(err.value, RuntimeError)
    assert (err.value.needed, err.value.free, err.value.seq_ids) == (5, 4, [0, 1])
    assert_same(before, snapshot(pm, k_pool, v_pool))
    with pytest.raises(OutOfPages, match=r"need 5 pages for seq 2, 4 free"):
        pm.reserve([2], [10])
    assert_same(before, snapshot(pm, k_pool, v_pool))
    pm.reserve([1], [8])  # exactly what is left
    assert pm.num_free_pages == 0


def test_no_lock_anywhere():
    for mod in (page_manager_mod, _pool_ops):
        src = inspect.getsource(mod)
        assert "threading" not in src and "Lock(" not in src
    doc = PageManager.__doc__
    assert "Concurrency contract" in doc and "one thread at a time" in doc


# ---------------------------------------------------------------------------- KV data
@pytest.mark.parametrize("P", [1, 3, 4])
@pytest.mark.parametrize("layers", [1, 2])
def test_assign_gather_round_trip(P, layers, device):
    pm = PageManager(32, P, 4, device=device)
    k_pool, v_pool = make_pools(pm, layers)
    lens = {0: 7, 2: 1, 3: 5}
    pm.reserve(list(lens), list(lens.values()))
    seqs = [s for s, n in lens.items() for _ in range(n)]
    pos = [p for n in lens.values() for p in range(n)]
    T = len(seqs)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(layers, T, H, D, generator=gen).to(device)  # k: [L, T, Hkv, D]
    v = torch.randn(layers, T, H, D, generator=gen).to(device)
    if layers == 1:
        pm.assign(seqs, pos, k[0], v[0], k_pool, v_pool)  # [T, Hkv, D] form
    else:
        pm.assign(seqs, pos, k, v, k_pool, v_pool)
    slots = pm.slots(seqs, pos)
    assert slots.dtype == torch.int64 and torch.equal(slots, ref_slots(pm, seqs, pos))
    assert len(set(slots.tolist())) == T and min(slots.tolist()) >= P  # never the null page
    for layer in range(layers):
        gk, gv, glens = pm.gather([3, 0, 2], k_pool, v_pool, layer=layer)
        assert gk.shape == (3, H, 7, D) and glens.tolist() == [5, 7, 1]
        for b, s in enumerate([3, 0, 2]):
            rows = [i for i, x in enumerate(seqs) if x == s]  # tokens of s, in position order
            assert torch.equal(gk[b, :, : lens[s]], k[layer, rows].transpose(0, 1))
            assert torch.equal(gv[b, :, : lens[s]], v[layer, rows].transpose(0, 1))
            assert not gk[b, :, lens[s] :].any() and not gv[b, :, lens[s] :].any()


def test_write_slots_per_layer_matches_stacked_assign(device):
    pm = PageManager(16, 4, 2, device=device)
    pm.reserve([0, 1], [6, 3])
    seqs, pos = [0] * 6 + [1] * 3, list(range(6)) + list(range(3))
    k = torch.randn(2, 9, H, D, device=device)
    stacked, stacked_v = make_pools(pm, 2)
    pm.assign(seqs, pos, k, -k, stacked, stacked_v)
    per_layer = [make_pools(pm, 1) for _ in range(2)]
    slots = pm.slots(seqs, pos)  # once per step, reused by every layer
    for layer, (kp, vp) in enumerate(per_layer):
        write_slots(kp, vp, slots, k[layer], -k[layer])
        assert torch.equal(kp[0], stacked[layer]) and torch.equal(vp[0], stacked_v[layer])


def test_fork_copy_on_write_diverges(device):
    pm = PageManager(20, 4, 4, device=device)
    k_pool, v_pool = make_pools(pm, 2)
    pm.reserve([0], [6])  # pages: full + half-full
    k = torch.arange(2 * 6 * H * D, dtype=torch.float32, device=device).view(2, 6, H, D)
    pm.assign([0] * 6, range(6), k, k + 0.5, k_pool, v_pool)
    pm.fork(0, 1)
    parent_pages = pm.pages_of(0)
    assert pm.pages_of(1) == parent_pages and pm.length(1) == 6
    assert pm.refcounts[parent_pages].tolist() == [2, 2]
    assert torch.equal(pm.page_table[1], pm.page_table[0])
    free_before = pm.num_free_pages
    copies = pm.reserve([1], [8])  # grows into the shared half page -> private copy
    full, half = parent_pages
    (src, dst), = copies  # fmt: skip
    assert src == half and pm.pages_of(1) == [full, dst] and pm.num_free_pages == free_before - 1
    assert pm.refcounts[[full, half, dst]].tolist() == [2, 1, 1]
    assert int(pm.phys_to_logical[dst]) == 1
    pm.apply_copies(copies, k_pool, v_pool)
    kc = torch.full((2, 2, H, D), 100.0, device=device)
    pm.assign([1, 1], [6, 7], kc, kc, k_pool, v_pool)  # child's new tokens
    assert pm.reserve([0], [7]) == []  # parent now holds its page alone: no copy
    assert pm.pages_of(0) == parent_pages
    kp = torch.full((2, 1, H, D), -7.0, device=device)
    pm.assign([0], [6], kp, kp, k_pool, v_pool)
    for layer in range(2):
        gk, gv, lens = pm.gather([0, 1], k_pool, v_pool, layer)
        assert lens.tolist() == [7, 8]
        prefix = k[layer].transpose(0, 1)  # [Hkv, 6, D]
        assert torch.equal(gk[0, :, :6], prefix) and torch.equal(gk[1, :, :6], prefix)
        assert torch.equal(gv[1, :, :6], prefix + 0.5)
        assert (gk[0, :, 6] == -7).all() and (gk[1, :, 6:8] == 100).all()
    assert visible_pages(pm, 0) == {full, half} and visible_pages(pm, 1) == {full, dst}
    pm.erase([0])
    assert pm.refcounts[full] == 1 and half in pm.free_pages and full not in pm.free_pages
    pm.erase([1])
    assert pm.num_free_pages == 19


def test_fork_on_page_boundary_needs_no_copy(device):
    pm = PageManager(20, 4, 4, device=device)
    pm.reserve([0], [8])
    pm.fork(0, 1)
    assert pm.reserve([0, 1], [9, 12]) == []
    assert pm.pages_of(0)[:2] == pm.pages_of(1)[:2] and pm.pages_of(0)[2] != pm.pages_of(1)[2]


def test_each_reserve_hands_back_only_its_own_copies(device):
    """Copy-on-write copies go to the caller whose reserve planned them (there is no shared queue
    another caller could take them from): two families forked from two parents, each growing into
    its shared partial page, get one copy each, of their own page, and applying one caller's
    copies leaves the other's destination untouched."""
    pm = PageManager(20, 4, 4, device=device)
    k_pool, v_pool = make_pools(pm)
    pm.reserve([0, 2], [6, 5])
    pm.fork(0, 1)
    pm.fork(2, 3)
    for s in (0, 2):
        page = pm.pages_of(s)[1]
        k_pool[:, :, page * 4 : page * 4 + 4] = 10.0 + s
    mine = pm.reserve([1], [7])
    theirs = pm.reserve([3], [6])
    assert [src for src, _ in mine] == [pm.pages_of(0)[1]]
    assert [src for src, _ in theirs] == [pm.pages_of(2)[1]]
    (_, dst_mine), (_, dst_theirs) = mine[0], theirs[0]
    pm.apply_copies(mine, k_pool, v_pool)
    assert (k_pool[:, :, dst_mine * 4 : dst_mine * 4 + 4] == 10.0).all()
    assert (k_pool[:, :, dst_theirs * 4 : dst_theirs * 4 + 4] == 0.0).all()
    pm.apply_copies(theirs, k_pool, v_pool)
    assert (k_pool[:, :, dst_theirs * 4 : dst_theirs * 4 + 4] == 12.0).all()


def test_free_pool_reuses_the_page_freed_last(device):
    """A stack, not a queue: a pool sized by memory is only touched up to the most pages ever in
    use at once, and a freed page is reused while it is still in the caches."""
    pm = PageManager(64, 4, 4, device=device)
    pm.reserve([0], [8])
    pm.reserve([1], [4])
    freed = pm.pages_of(1)
    pm.erase([1])
    pm.reserve([2], [4])
    assert pm.pages_of(2) == freed
    pm.erase([0, 2])
    for _ in range(20):  # churn: one sequence at a time never touches more than its own pages
        pm.reserve([3], [8])
        assert set(pm.pages_of(3)) <= {1, 2, 3}
        pm.erase([3])


def test_apply_copies_out_of_pages_counts_copy(device):
    pm = PageManager(5, 2, 4, device=device)  # 4 usable
    pm.reserve([0], [3])  # 2 pages
    pm.fork(0, 1)
    pm.reserve([2], [4])  # 2 pages, 0 free
    before = snapshot(pm)
    with pytest.raises(OutOfPages, match="need 1 pages for seq 1, 0 free"):
        pm.reserve([1], [4])  # no new logical page, but a private copy of page 2
    assert_same(before, snapshot(pm))


# ---------------------------------------------------------------------------- bad input
def _live_pm(device):
    pm = PageManager(12, 2, 4, max_seq_len=10, device=device)
    k_pool, v_pool = make_pools(pm)
    pm.reserve([0, 1], [3, 2])
    return pm, k_pool, v_pool


def ones(pool: torch.Tensor, *shape: int, **kw) -> torch.Tensor:
    return torch.ones(*shape, device=pool.device, **kw)


BAD_CALLS = {
    "id out of range": (lambda pm, kp, vp: pm.reserve([4], [1]), ValueError, "seq id 4"),
    "negative id": (lambda pm, kp, vp: pm.erase([-1]), ValueError, "seq id -1"),
    "id not int": (lambda pm, kp, vp: pm.reserve([1.5], [1]), ValueError, "1.5"),
    "duplicate id": (
        lambda pm, kp, vp: pm.reserve([2, 2], [1, 1]),
        ValueError,
        "duplicate seq id 2",
    ),
    "duplicate erase": (lambda pm, kp, vp: pm.erase([0, 0]), ValueError, "duplicate seq id 0"),
    "unknown erase": (lambda pm, kp, vp: pm.erase([0, 3]), ValueError, "seq id 3 is not live"),
    "negative length": (lambda pm, kp, vp: pm.reserve([2], [-1]), ValueError, "length -1"),
    "over capacity": (lambda pm, kp, vp: pm.reserve([0, 2], [4, 11]), ValueError, "length 11"),
    "shrink": (lambda pm, kp, vp: pm.reserve([0], [2]), ValueError, "reserve cannot shrink"),
    "lengths mismatch": (lambda pm, kp, vp: pm.reserve([2, 3], [1]), ValueError, "2 seq_ids but 1"),
    "fork dead parent": (lambda pm, kp, vp: pm.fork(3, 2), ValueError, "seq id 3 is not live"),
    "fork live child": (lambda pm, kp, vp: pm.fork(0, 1), ValueError, "child seq id 1"),
    "fork self": (lambda pm, kp, vp: pm.fork(0, 0), ValueError, "duplicate seq id 0"),
    "slot unknown seq": (lambda pm, kp, vp: pm.slots([0, 2], [0, 0]), ValueError, "seq id 2"),
    "position beyond": (
        lambda pm, kp, vp: pm.slots([0, 1], [0, 2]),
        ValueError,
        "position 2 of seq 1 out of range, expected 0 <= position < length 2",
    ),
    "negative position": (lambda pm, kp, vp: pm.slots([0], [-1]), ValueError, "position -1"),
    "assign beyond": (
        lambda pm, kp, vp: pm.assign([0], [3], ones(kp, 1, H, D), ones(kp, 1, H, D), kp, vp),
        ValueError,
        "position 3 of seq 0",
    ),
    "k dtype": (
        lambda pm, kp, vp: pm.assign(
            [0], [0], ones(kp, 1, H, D, dtype=torch.float16), ones(kp, 1, H, D), kp, vp
        ),
        TypeError,
        "k dtype torch.float16 does not match pool dtype torch.float32",
    ),
    "v shape": (
        lambda pm, kp, vp: pm.assign([0], [0], ones(kp, 1, H, D), ones(kp, 1, H, D + 1), kp, vp),
        ValueError,
        f"v shape [1, {H}, {D + 1}], expected [1, {H}, {D}]",
    ),
    "k token count": (
        lambda pm, kp, vp: pm.assign([0, 0], [0, 1], ones(kp, 1, H, D), ones(kp, 2, H, D), kp, vp),
        ValueError,
        "k shape [1,",
    ),
    "k device": (
        lambda pm, kp, vp: pm.assign(
            [0], [0], torch.ones(1, H, D, device="meta"), ones(kp, 1, H, D), kp, vp
        ),
        TypeError,
        "k device meta does not match pool device {pool}",
    ),
    "write_slots device": (
        lambda pm, kp, vp: write_slots(
            kp, vp, pm.slots([0], [0]), ones(kp, 1, H, D), torch.ones(1, H, D, device="meta")
        ),
        TypeError,
        "v device meta",
    ),
    "share live": (lambda pm, kp, vp: pm.share(0, pm.pages_of(1)), ValueError, "seq id 0 is already live"),
    "share wrong position": (
        lambda pm, kp, vp: pm.share(2, pm.pages_of(0)[1:]), ValueError, "holding logical pages 0..0"),
    "share free page": (lambda pm, kp, vp: pm.share(2, pm.free_pages[:1]), ValueError, "must be owned"),
    "hold free page": (lambda pm, kp, vp: pm.hold(pm.free_pages[:1]), ValueError, "distinct owned pages"),
    "hold twice": (lambda pm, kp, vp: pm.hold(pm.pages_of(1) * 2), ValueError, "distinct owned pages"),
    "unhold not held": (lambda pm, kp, vp: pm.unhold(pm.pages_of(0)), ValueError, "distinct held pages"),
    "gather unknown": (lambda pm, kp, vp: pm.gather([0, 3], kp, vp), ValueError, "seq id 3"),
    "gather layer": (lambda pm, kp, vp: pm.gather([0], kp, vp, layer=1), ValueError, "layer 1"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_typed_and_changes_nothing(case, device):
    call, exc, msg = BAD_CALLS[case]
    pm, k_pool, v_pool = _live_pm(device)
    pm.assign([0, 0, 0], [0, 1, 2], torch.randn(3, H, D, device=device), torch.randn(3, H, D, device=device),
              k_pool, v_pool)
    before = snapshot(pm, k_pool, v_pool)
    with pytest.raises(exc) as err:
        call(pm, k_pool, v_pool)
    assert msg.replace("{pool}", str(k_pool.device)) in str(err.value)
    assert_same(before, snapshot(pm, k_pool, v_pool))


def test_out_of_pages_is_runtime_error_and_exported():
    assert issubclass(OutOfPages, RuntimeError)
    import fms_paged.kv as kv

    assert {"PageManager", "OutOfPages"} <= set(kv.__all__)


# ---------------------------------------------------------------------------- no host sync
def test_no_host_sync_mode_catches_syncs(no_host_sync, device):
    t = torch.tensor([1, 2], device=device)
    syncs = (
        lambda: t[0].item(),
        lambda: bool(t[0]),
        lambda: int(t[0]),
        t.nonzero,
        lambda: t[t > 1],
    )
    for sync in syncs:
        with pytest.raises(AssertionError, match="host sync"), no_host_sync():
            sync()
    m = torch.zeros(2, device="meta")
    for read_back in (m.tolist, m.numpy, m.cpu):
        with pytest.raises((NotImplementedError, TypeError)):
            read_back()


def decode_steps(pm: PageManager, k_pool, v_pool, lens: dict[int, int], steps: int) -> dict:
    """The per-step hot path: reserve +1 token, copy-on-write, slots once, write every layer."""
    L = k_pool.shape[0]
    for _ in range(steps):  # crosses page boundaries and forces a copy-on-write
        batch = list(lens)
        copies = pm.reserve(batch, [lens[s] + 1 for s in batch])
        pm.apply_copies(copies, k_pool, v_pool)
        pos = [lens[s] for s in batch]
        slots = pm.slots(batch, pos)
        k = torch.randn(L, len(batch), H, D, device=k_pool.device)  # k: [L, T, Hkv, D]
        for layer in range(L):
            kp, vp = k_pool[layer : layer + 1], v_pool[layer : layer + 1]
            write_slots(kp, vp, slots, k[layer], k[layer])
        pm.assign(batch, pos, k, k, k_pool, v_pool)
        lens = {s: n + 1 for s, n in lens.items()}
    return lens


@pytest.mark.parametrize("where", ["test-device", "meta"])
def test_hot_path_has_no_host_sync(where, device, no_host_sync):
    """On the test device (on the CPU the mode cannot see `.tolist()`; on CUDA the banned ops are
    what a sync would dispatch), and on "meta", where any read of data raises."""
    if where == "meta":
        device = torch.device("meta")
    pm = PageManager(64, 4, 8, device=device)
    k_pool, v_pool = make_pools(pm, 2)
    seqs = [0, 1, 2, 5]
    pm.reserve(seqs, [3, 4, 1, 7])
    pm.fork(1, 6)
    pm.fork(0, 7)
    lens = {s: pm.length(s) for s in [*seqs, 6, 7]}
    with no_host_sync() as mode:
        lens = decode_steps(pm, k_pool, v_pool, lens, steps=6)
        pm.fork(2, 3)
        pm.erase([0, 3])
        gk, _, _ = pm.gather([1, 6], k_pool, v_pool, layer=1)
    assert "index_copy_" in mode.seen  # the mode saw the device writes
    assert gk.shape == (2, H, max(lens[1], lens[6]), D)
    assert [pm.length(s) for s in (1, 2, 5, 6, 7)] == [lens[s] for s in (1, 2, 5, 6, 7)]
    if device.type != "meta":
        assert pm.seq_lens.tolist() == [pm.length(s) for s in range(8)]


@pytest.mark.parametrize("P", [1, 4, 16])
def test_decode_fast_path_equals_the_general_reserve(P, device, monkeypatch):
    """`reserve` of a short batch takes a plain-Python path unless a row grows into a shared page:
    against a twin manager forced down the general (numpy) path, the same state after every step
    (host mirror, device views, copy-on-write copies, pages handed out, in order) through decode
    rows and prefill chunks that open several pages at once, a forked sequence growing into its
    shared partial page (copy-on-write), a sequence joining from length 0 and random subsets of
    rows."""
    rng = np.random.default_rng(P)
    fast, ref = (PageManager(96, P, max_seqs=6, max_seq_len=20 * P, device=device) for _ in range(2))
    monkeypatch.setattr(ref, "_reserve_in_place", lambda *a: None)
    for pm in (fast, ref):
        pm.reserve([0, 1], [P + 1, 3])
        pm.fork(0, 2)  # 2 shares 0's pages, the last one partly filled when P > 1
    lens = {0: P + 1, 1: 3, 2: P + 1}
    copies, opened = 0, []
    in_use = set(range(1, 96)) - set(ref.free_pages)
    for step in range(3 * P + 8):
        if step == 5:
            lens[4] = 0  # joins: its first token opens its first page
        ids = [s for s in lens if rng.random() < 0.8] or [1]
        rng.shuffle(ids)
        # a decode token, or now and then a chunk of up to two pages and a bit (within the limit)
        grow = {s: min(int(rng.integers(2, 2 * P + 3)) if rng.random() < 0.2 else 1, 20 * P - lens[s])
                for s in ids}
        got = fast.reserve(ids, [lens[s] + grow[s] for s in ids])
        want = ref.reserve(ids, [lens[s] + grow[s] for s in ids])
        assert got == want and got.opened == want.opened
        for s in ids:
            lens[s] += grow[s]
        assert_same(snapshot(fast), snapshot(ref))
        copies, opened = copies + len(want), opened + want.opened
    assert copies == (1 if P > 1 else 0)  # the shared partial page was copied once
    # every page taken from the pool was reported as opened, once
    assert len(set(opened)) == len(opened) and in_use | set(opened) == set(range(1, 96)) - set(ref.free_pages)


def test_reserve_rejects_bad_rows_and_changes_nothing(device):
    """Batches that would take the decode fast path but are wrong are refused by the general
    path's checks, naming the value; nothing changes."""
    pm = PageManager(32, 4, max_seqs=4, max_seq_len=40, device=device)
    pm.reserve([0, 1], [5, 2])
    before = snapshot(pm)
    for ids, lens, err, match in (
        ([0, 1], [6, 1], ValueError, "reserve cannot shrink: seq 1 has length 2, asked for 1"),
        ([0, 7], [6, 1], ValueError, "seq id 7 out of range"),
        ([1, 1], [3, 3], ValueError, "duplicate seq id 1"),
        ([0, 1], [6], ValueError, "got 2 seq_ids but 1 new_lengths"),
        ([0, 1], [6, 41], ValueError, "length 41 for seq 1 out of range"),
    ):
        with pytest.raises(err, match=match):
            pm.reserve(ids, lens)
        assert_same(before, snapshot(pm))


def test_share_and_hold_keep_pages_past_their_sequence(device):
    """A prefix cache's life cycle: HOLD a sequence's full pages, ERASE it (held pages stay, the
    rest return), SHARE them into a new sequence at the same logical positions, UNHOLD them (still
    referenced: not freed), ERASE the sharer (now freed)."""
    P = 4
    pm = PageManager(10, P, 3, max_seq_len=16, device=device)
    pm.reserve([0], [10])  # pages for positions 0..9: two full, one partial
    full = pm.pages_of(0)[:2]
    partial = pm.pages_of(0)[2]
    pm.hold(full)
    pm.erase([0])
    assert partial in pm.free_pages and not set(full) & set(pm.free_pages)
    assert pm.refcounts[full].tolist() == [1, 1] and pm.held_pages == sorted(full)
    assert pm.phys_to_logical[full].tolist() == [0, 1]  # still where a prefix hit expects them
    pm.share(1, full)
    assert pm.length(1) == 2 * P and pm.pages_of(1) == full and pm.seq_lens[1] == 2 * P
    assert pm.page_table[1, :2].tolist() == full and pm.refcounts[full].tolist() == [2, 2]
    assert pm.reserve([1], [2 * P + 1]) == []  # grows into a new page: nothing to copy
    pm.unhold(full)
    assert pm.held_pages == [] and not set(full) & set(pm.free_pages)
    pm.erase([1])
    assert set(full) <= set(pm.free_pages) and len(pm.free_pages) == pm.num_pages - 1
    assert pm.phys_to_logical.tolist() == [-1] * pm.num_pages and pm.refcounts.sum() == 0


@pytest.mark.parametrize("P", [1, 4, 16])
def test_planning_calls_count_what_reserve_takes(P, device):
    """Page growth has one rule (`geometry.pages_grown`): `pages_needed` (a running sequence's
    growth, a private copy of a shared partial page included) and `pages_to_admit` (a new sequence
    sharing a prefix-cache hit's full pages) count exactly the pages the RESERVE after them takes."""
    pm = PageManager(64, P, 4, max_seq_len=8 * P, device=device)
    for s, grow in ((0, [3, 3 * P, 3 * P + 1, 5 * P - 1]), (1, [P + 1])):
        for n in grow:
            want = pm.pages_needed(s, n)
            free = pm.num_free_pages
            pm.reserve([s], [n])
            assert free - pm.num_free_pages == want, (s, n)
    assert pm.pages_needed(0, 2) == 0  # no growth: nothing
    pm.fork(1, 2)  # 2 shares 1's pages; its partial last page (P > 1) is copied when it grows into it
    want = pm.pages_needed(2, P + 2)
    assert want == 1  # P > 1: a copy of the partial page; P = 1: no partial page, a new one
    free = pm.num_free_pages
    copies = pm.reserve([2], [P + 2])
    assert free - pm.num_free_pages == want and len(copies) == (P > 1)
    pm.hold(pm.pages_of(0)[:3])
    shared = pm.pages_of(0)[:3]
    for n in (3 * P, 3 * P + 1, 5 * P):
        assert pm.pages_to_admit(n, 3) == math.ceil(n / P) - 3
    pm.share(3, shared)
    free = pm.num_free_pages
    pm.reserve([3], [4 * P + 1])
    assert free - pm.num_free_pages == pm.pages_to_admit(4 * P + 1, 3) == 2


def test_release_behind_window_drops_each_page_once(device):
    """`release_behind_window` (the scheduler's and `PagedCache`'s one release rule): the pages
    wholly before `next - horizon + 1` go back, each once (a later call with nothing new behind
    the window changes nothing); sequences not live, and a horizon of None, are skipped."""
    P = 4
    pm = PageManager(20, P, 3, max_seq_len=32, device=device)
    pm.reserve([0, 1], [20, 6])
    pages = pm.pages_of(0)
    assert pm.release_behind_window([0, 1], [20, 6], None) == []
    # next query at 20 with a window of 9: keys 12.. are read, pages 0..2 (positions 0..11) are not
    assert pm.release_behind_window([0, 1, 2], [20, 6, 0], 9) == pages[:3]
    assert pm.pages_of(0) == [0, 0, 0, *pages[3:]] and pm.length(0) == 20
    assert pm.release_behind_window([0, 1], [20, 6], 9) == []  # nothing new fell behind
    pm.reserve([0], [21])
    assert pm.release_behind_window([0], [21], 9) == []  # keys 13..: page 3 (12..15) still read
    pm.reserve([0], [24])
    assert pm.release_behind_window([0], [24], 9) == [pages[3]]
    assert pm.num_free_pages == 19 - len(pm.pages_of(1)) - 2


def _shared_state(pm: PageManager) -> tuple:
    """What REPOINT must leave as ERASE + FORK would: tables, lengths, refcounts, the free set and
    phys_to_logical, host and device."""
    return (pm.host_table.tolist(), [pm.length(s) for s in range(pm.max_seqs)], pm.refcounts.tolist(),
            sorted(pm.free_pages), pm.phys_to_logical.cpu().tolist(), pm.page_table.cpu().tolist())


def test_repoint_matches_erase_then_fork(device):
    """REPOINT of a batch equals ERASE of the rows then FORK of each pair, on a second manager (the
    reference): beams 0 and 1 share a prefix; 2 (shares it too) takes 0's pages, 3 (private
    pages only) takes 1's; a page both the row and its parent hold keeps its reference."""
    made = []
    for _ in range(2):
        pm = PageManager(32, 4, 5, device=device)
        pm.reserve([0], [9])  # 2 full pages + 1 partial
        pm.fork(0, 1)
        pm.fork(0, 2)
        pm.reserve([1, 2], [11, 14])  # copy-on-write of the partial page; 2 opens a page more
        pm.reserve([3], [6])
        made.append(pm)
    pm, ref = made
    ref.erase([2, 3])
    ref.fork(0, 2)
    ref.fork(1, 3)
    free_before = pm.num_free_pages
    pm.repoint([2, 3], [0, 1])
    assert _shared_state(pm) == _shared_state(ref)
    assert pm.pages_of(2) == pm.pages_of(0) and pm.pages_of(3) == pm.pages_of(1)
    # 2's two private pages and 3's two pages go back; the shared prefix pages keep 4 references
    assert pm.num_free_pages == free_before + 4
    full = pm.pages_of(0)[:2]
    assert pm.refcounts[full].tolist() == [4, 4]
    assert visible_pages(pm, 3) == set(pm.pages_of(1))


def test_repoint_then_copy_on_write(device):
    """After REPOINT, growing into the parent's shared partial page copies it (the row's own
    page), as after FORK; the KV read back is the parent's prefix then the row's new tokens."""
    pm = PageManager(20, 4, 3, device=device)
    k_pool, v_pool = make_pools(pm, 1)
    pm.reserve([0, 1], [6, 3])
    k = torch.arange(9 * H * D, dtype=torch.float32, device=device).view(1, 9, H, D)
    pm.assign([0] * 6 + [1] * 3, list(range(6)) + list(range(3)), k, k + 0.5, k_pool, v_pool)
    pm.repoint([1], [0])
    full, half = pm.pages_of(0)
    assert pm.pages_of(1) == [full, half] and pm.length(1) == 6
    copies = pm.reserve([1], [7])
    (src, dst), = copies  # fmt: skip
    assert src == half and pm.pages_of(1) == [full, dst]
    assert pm.refcounts[[full, half, dst]].tolist() == [2, 1, 1]
    pm.apply_copies(copies, k_pool, v_pool)
    kn = torch.full((1, 1, H, D), 100.0, device=device)
    pm.assign([1], [6], kn, kn, k_pool, v_pool)
    gk, gv, lens = pm.gather([1], k_pool, v_pool, 0)
    assert lens.tolist() == [7]
    assert torch.equal(gk[0, :, :6], k[0, :6].transpose(0, 1)) and (gk[0, :, 6] == 100).all()
    assert torch.equal(gv[0, :, :6], k[0, :6].transpose(0, 1) + 0.5)
    pm.erase([0, 1])
    assert pm.num_free_pages == 19 and not pm.refcounts.any()


def test_repoint_rejects_bad_input_and_changes_nothing(device):
    pm = PageManager(20, 4, 4, device=device)
    pm.reserve([0, 1], [5, 2])
    before = _shared_state(pm)
    for ids, parents, msg in (([1], [2], "not live"), ([1, 2], [0], "2 seq_ids but 1 parents"),
                              ([1, 1], [0, 0], "duplicate"), ([0, 1], [1, 1], "also among"),
                              ([9], [0], "out of range")):
        with pytest.raises(ValueError, match=msg):
            pm.repoint(ids, parents)
        assert _shared_state(pm) == before
    pm.repoint([2, 3], [0, 0])  # rows not live take a live parent's pages (two FORKs)
    assert pm.pages_of(2) == pm.pages_of(3) == pm.pages_of(0)
    assert pm.refcounts[pm.pages_of(0)].tolist() == [3, 3]


def test_retable_trades_pages_within_a_family(device):
    """RETABLE (the rows' tables handed back by beam search's lookahead steps, which moved beams
    between rows inside one call): rows 0 and 1 share page f0 and own a and c, b and d; row 1 takes
    row 0's a but keeps its own d. Each page's references become the rows that hold it (counted
    from the tables, the references a prefix-cache hold adds kept), b, held by nobody now, goes back
    to the free pool (phys_to_logical -1), the device table is the host's, and the rows grow and
    ERASE as usual afterwards. Bad tables raise ValueError and change nothing."""
    pm = PageManager(32, 4, 5, device=device)
    pm.reserve([0], [4])
    pm.fork(0, 1)
    pm.reserve([0, 1], [10, 10])
    pm.reserve([3], [5])
    (f0, a, c), (_, b, d) = pm.pages_of(0), pm.pages_of(1)
    pm.hold([f0])  # (a prefix cache's reference)
    before = _shared_state(pm)
    free = set(pm.free_pages)
    C = pm.max_pages_per_seq
    row = lambda *pages: list(pages) + [0] * (C - len(pages))  # noqa: E731
    for tables, msg in (([row(f0, a, c)], "shape"),
                        ([row(f0, a, c), row(f0, pm.pages_of(3)[0], d)], "not a page of"),
                        ([row(f0, a, c), row(a, f0, d)], "logical index"),
                        ([row(f0, a, c, 7)] + [row(f0, a, d)], "not a page of")):
        with pytest.raises(ValueError, match=msg):
            pm.retable([0, 1], np.array(tables))
        assert _shared_state(pm) == before
    assert pm.retable([0, 1], np.array([row(f0, a, c), row(f0, a, d)])) == [b]
    assert pm.pages_of(0) == [f0, a, c] and pm.pages_of(1) == [f0, a, d] and pm.length(1) == 10
    counts = {p: sum(pm.pages_of(s).count(p) for s in (0, 1)) for p in (f0, a, c, d)}
    assert {p: pm.refcount(p) for p in counts} == {**counts, f0: counts[f0] + 1}
    assert set(pm.free_pages) == free | {b} and pm.refcount(b) == 0
    assert pm.phys_to_logical.cpu()[b] == -1
    assert pm.page_table.cpu().tolist() == pm.host_table.tolist()
    assert pm.retable([0, 1], np.array([row(f0, a, c), row(f0, a, d)])) == []  # nothing moves
    pm.reserve([0, 1], [13, 13])  # c and d are full: each row opens a page of its own
    assert pm.refcounts[[a, c, d]].tolist() == [2, 1, 1]
    pm.erase([0, 1, 3])
    pm.unhold([f0])
    assert pm.num_free_pages == 31 and not pm.refcounts.any()


@pytest.mark.parametrize("P", [1, 4])
def test_beam_steps_repoint_and_fast_reserve_equal_erase_fork_and_the_general_reserve(P, device, monkeypatch):
    """Beam-search-like steps: four rows grow by a token together, then random rows REPOINT to
    random other rows (several to one parent, so a partial page has up to four holders that grow in
    the same RESERVE). Against a twin that ERASEs and FORKs instead and is forced down the general
    (numpy) reserve: the same state after every step (host mirror, device views, free pool in
    order, copy-on-write copies in order, pages handed out)."""
    rng = np.random.default_rng(10 + P)
    fast, ref = (PageManager(128, P, max_seqs=4, max_seq_len=40 * P, device=device) for _ in range(2))
    monkeypatch.setattr(ref, "_reserve_in_place", lambda *a: None)
    for pm in (fast, ref):
        pm.reserve([0], [2 * P + 1])
        for c in (1, 2, 3):
            pm.fork(0, c)
    n, copies = 2 * P + 1, 0
    for _ in range(6 * P + 6):
        n += 1
        ids = [int(s) for s in rng.permutation(4)]
        got, want = fast.reserve(ids, [n] * 4), ref.reserve(ids, [n] * 4)
        assert got == want and got.opened == want.opened
        copies += len(want)
        assert_same(snapshot(fast), snapshot(ref))
        k = int(rng.integers(0, 4))  # rows that take another row's pages
        moved = [int(s) for s in rng.permutation(4)[:k]]
        kept = [s for s in range(4) if s not in moved]
        if moved:
            parents = [kept[int(rng.integers(0, len(kept)))] for _ in moved]
            fast.repoint(moved, parents)
            ref.erase(moved)
            for c, p in zip(moved, parents, strict=True):
                ref.fork(p, c)
        assert_same(snapshot(fast), snapshot(ref))
    assert copies > 0 if P > 1 else copies == 0
    for pm in (fast, ref):
        pm.erase([0, 1, 2, 3])
        assert pm.num_free_pages == 127 and not pm.refcounts.any()


@pytest.mark.parametrize("pairs", [[(1, 4), (3, 2)], [(1, 6), (3, 2), (5, 7), (8, 9), (10, 11), (4, 12)]])
def test_copy_pages_whole_pages_and_slot_by_slot_agree(pairs, device):
    """copy_pages copies a contiguous pool's pages as whole runs (a page at a time for a few
    copies, index ops for more) and a strided pool's slot by slot: each against a per-slot loop
    reference, pages copied exactly (a plain copy: no tolerance)."""
    P, N = 4, 13
    pool = torch.randn(2, H, N * P, D, device=device)
    strided = torch.randn(2, N * P, H, D, device=device).transpose(1, 2)  # [2, H, N*P, D], strided
    src, dst = (np.array(x) for x in zip(*pairs, strict=True))
    for x in (pool, strided):
        want = x.clone()
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            for j in range(P):
                want[:, :, d * P + j] = x[:, :, s * P + j]
        _pool_ops.copy_pages((x,), src, dst, P)
        assert torch.equal(x, want)
