"""Lock-free contract: 8 threads hammer one PageManager with reserve / erase / fork / slots.

Each thread owns a disjoint range of sequence ids (so each family is used by one thread), the
pool is small so threads race for the last pages, and the GIL switch interval is shortened to
interleave them mid-call. Afterwards every page must be free exactly once or owned with the right
refcount, and the device views must equal the host bookkeeping.
"""

from __future__ import annotations

import collections
import random
import sys
import threading
import time

import numpy as np
import pytest
import torch

from fms_paged.kv import OutOfPages, PageManager

THREADS, IDS_PER_THREAD, NUM_PAGES, P = 8, 12, 161, 4
RUN_SECONDS = 5.0


def worker(pm: PageManager, tid: int, deadline: float, stats: dict, errors: list) -> None:
    rng = random.Random(tid)
    ids = range(tid * IDS_PER_THREAD, (tid + 1) * IDS_PER_THREAD)
    lens: dict[int, int] = {}  # this thread's own model of its live sequences
    try:
        while time.monotonic() < deadline:
            op = rng.random()
            live, dead = sorted(lens), [s for s in ids if s not in lens]
            if op < 0.45 or not live:
                batch = rng.sample(list(ids), rng.randint(1, 4))
                new = [min(pm.max_seq_len, lens.get(s, 0) + rng.randint(0, 3 * P)) for s in batch]
                try:
                    copies = pm.reserve(batch, new)
                except OutOfPages:
                    stats["oop"] += 1
                    continue
                # a copy's source is a page of this thread's own family, still held by it
                for src, dst in copies:
                    assert pm.refcounts[src] >= 1 and pm.refcounts[dst] == 1
                lens.update(zip(batch, new, strict=True))
            elif op < 0.6 and dead:
                parent, child = rng.choice(live), rng.choice(dead)
                pm.fork(parent, child)
                lens[child] = lens[parent]
                stats["fork"] += 1
            else:
                batch = rng.sample(live, rng.randint(1, min(3, len(live))))
                pm.erase(batch)
                for s in batch:
                    del lens[s]
            stats["ops"] += 1
            check_own(pm, lens, rng)
    except Exception as e:  # noqa: BLE001 - reported to the main thread
        errors.append(e)
    stats["lens"] = lens


def check_own(pm: PageManager, lens: dict[int, int], rng: random.Random) -> None:
    """Only this thread writes its rows: they must match its model even while others run."""
    for s, n in lens.items():
        pages = pm.pages_of(s)
        assert pm.length(s) == n and len(pages) == -(-n // P)
        assert int(pm.seq_lens[s]) == n
        assert pm.page_table[s, : len(pages)].tolist() == pages
        # another thread's erase must never reset the phys_to_logical of a page we now own
        assert [int(pm.phys_to_logical[p]) for p in pages] == list(range(len(pages)))
    if lens:
        s = rng.choice(sorted(lens))
        if lens[s]:
            pos = rng.randrange(lens[s])
            slot = int(pm.slots([s], [pos])[0])
            assert slot == pm.pages_of(s)[pos // P] * P + pos % P


def check_global(pm: PageManager) -> None:
    free = pm.free_pages
    live = pm.live_seqs
    owned = {s: pm.pages_of(s) for s in live}
    holders = np.zeros(NUM_PAGES, dtype=np.int64)
    for pages in owned.values():
        assert len(set(pages)) == len(pages)
        holders[pages] += 1
    assert len(free) == len(set(free)), "a page is in the free pool twice"
    assert 0 not in free and holders[0] == 0, "the null page was handed out"
    assert not set(free) & set(np.flatnonzero(holders).tolist()), "a page is free and owned"
    assert sorted(free + np.flatnonzero(holders).tolist()) == list(range(1, NUM_PAGES)), "lost page"
    assert pm.refcounts.tolist() == holders.tolist()
    C = pm.max_pages_per_seq
    expected_table = torch.zeros(pm.max_seqs, C, dtype=torch.int32)
    expected_p2l = torch.full((NUM_PAGES,), -1, dtype=torch.int32)
    for s, pages in owned.items():
        expected_table[s, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        expected_p2l[pages] = torch.arange(len(pages), dtype=torch.int32)
    assert torch.equal(pm.page_table.cpu(), expected_table)  # the device views, read back
    assert torch.equal(pm.phys_to_logical.cpu(), expected_p2l)
    assert pm.seq_lens.tolist() == [pm.length(s) for s in range(pm.max_seqs)]


def test_threads_never_lose_or_double_own_a_page(device):
    pm = PageManager(NUM_PAGES, P, THREADS * IDS_PER_THREAD, device, max_seq_len=24 * P)
    stats = [{"ops": 0, "oop": 0, "fork": 0} for _ in range(THREADS)]
    errors: list[Exception] = []
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: interleave inside reserve/erase
    try:
        deadline = time.monotonic() + RUN_SECONDS
        threads = [
            threading.Thread(target=worker, args=(pm, t, deadline, stats[t], errors)) for t in range(THREADS)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors
    assert sum(s["ops"] for s in stats) > 500 and sum(s["fork"] for s in stats) > 0
    assert sum(s["oop"] for s in stats) > 0, "the pool never ran dry: no contention tested"
    for s in stats:  # every thread's own model agrees with the manager
        assert {k: pm.length(k) for k in s["lens"]} == s["lens"]
    assert sorted(k for s in stats for k in s["lens"]) == pm.live_seqs
    check_global(pm)
    pm.erase(pm.live_seqs)
    check_global(pm)
    assert sorted(pm.free_pages) == list(range(1, NUM_PAGES))
    assert not pm.refcounts.any() and not pm.page_table.any()


class _RacedDeque(collections.deque):
    """A free pool that another thread drains between the size check and the pops."""

    def __len__(self) -> int:
        return 10**6  # the size check passes; pop runs dry midway


def test_lost_race_returns_pages_and_changes_nothing(device):
    pm = PageManager(9, 2, 4, device)
    pm.reserve([0], [3])  # 2 pages, 6 free
    before = (sorted(pm.free_pages), pm.refcounts.tolist(), pm.page_table.clone(), pm.live_seqs)
    pm._free = _RacedDeque(pm._free)
    with pytest.raises(OutOfPages, match=r"need 8 pages for seqs \[1, 2\]"):
        pm.reserve([1, 2], [8, 8])  # pops all 6 free pages, then IndexError
    after = (sorted(pm.free_pages), pm.refcounts.tolist(), pm.page_table.clone(), pm.live_seqs)
    assert before[0] == after[0] and before[1] == after[1] and before[3] == after[3]
    assert torch.equal(before[2], after[2])
