"""Layer groups (`fms_paged.kv.groups`) and their pages (`fms_paged.kv.page_groups`): how layers are
cut into slices of equal pages, and that the page manager's contract holds per slice over the one
pool: RESERVE all-or-nothing across slices, ERASE / FORK in every slice, a sliding slice releasing
only behind its own window, a released page reused before an untouched one, and exact accounting."""

import numpy as np
import pytest

from fms_paged.kv.geometry import NULL_PAGE, pages_for, pages_held
from fms_paged.kv.groups import layer_groups
from fms_paged.kv.page_groups import GroupedPages
from fms_paged.kv.page_manager import OutOfPages
from fms_paged.kv.spec import AttentionSpec

P = 16


def specs(windows):
    return [AttentionSpec(scale=0.1, window=w) for w in windows]


def gemma3_270m():  # 18 layers: every 6th full, the rest sliding at 512
    return specs([None if (i + 1) % 6 == 0 else 512 for i in range(18)])


def test_slices_have_equal_layers_and_keep_each_history():
    g = layer_groups(gemma3_270m())
    assert g.layers_per_slice == 3 and g.num_slices == 6
    assert g.windows == (None, 512, 512, 512, 512, 512)
    assert g.slice_layers[0] == (5, 11, 17)  # the full layers, one slice
    # every layer in exactly one slice, at a position < u; positions of one slice distinct
    seen = sorted(layer for layers in g.slice_layers for layer in layers)
    assert seen == list(range(18))
    for s, layers in enumerate(g.slice_layers):
        assert [g.slice_of[layer] for layer in layers] == [s] * 3
        assert sorted(g.position_of[layer] for layer in layers) == [0, 1, 2]
    alternating = layer_groups(specs([4096, None] * 13))  # Gemma 2: 13 + 13
    assert alternating.layers_per_slice == 13 and alternating.windows == (None, 4096)
    qwen = layer_groups(specs([None] * 21 + [4096] * 3))  # Qwen2, max_window_layers = 21
    assert qwen.layers_per_slice == 3 and qwen.windows == (None,) * 7 + (4096,)


def test_one_history_is_one_slice():
    for windows, window in (([None] * 4, None), ([64] * 4, 64)):
        g = layer_groups(specs(windows))
        assert not g.grouped and g.windows == (window,) and g.slice_layers == ((0, 1, 2, 3),)
    g = layer_groups(gemma3_270m(), grouped=False)  # a model that hands its pools in alone (FMS)
    assert not g.grouped and g.windows == (None,)


def test_pool_sizing_counts_what_each_slice_holds():
    g = layer_groups(gemma3_270m())
    L, chunk = 32768, 512
    # full: every page; each sliding slice: its chunk and the window before it
    sliding = pages_held(L, P, 512, chunk)
    assert sliding == pages_for(511 + chunk, P) + 1
    assert g.min_pool_pages(L, P, chunk) == pages_for(L, P) + 5 * sliding + 1
    # a pool of exactly that holds one such sequence, and no longer one
    need = g.min_pool_pages(L, P, chunk)
    assert g.capacity(need, P, chunk, L) == L
    assert g.capacity(need - 1, P, chunk, 10**6) == L - P


def manager(num_pages=64, max_seqs=4):
    return GroupedPages(layer_groups(specs([None, 32, 32])), num_pages, P, max_seqs, max_seq_len=256)


def held(pm, s):
    return [p for g in range(pm.num_slices) for p in pm.pages_of(s, g) if p != NULL_PAGE]


def check_accounting(pm):
    """Every page is free or held (refcounts = table references + holds), none twice."""
    table = pm.host_table
    refs = np.bincount(table[table != NULL_PAGE].ravel(), minlength=pm.num_pages)
    refs[pm.held_pages] += 1
    assert (refs[1:] == pm.refcounts[1:]).all()
    owned = set(np.flatnonzero(refs[1:]) + 1)
    free = pm.free_pages
    assert len(free) == len(set(free)) and not owned & set(free)
    assert len(owned) + len(free) == pm.num_pages - 1


def test_reserve_is_all_or_nothing_across_slices():
    pm = manager(num_pages=20)
    pm.reserve([0], [40])  # 3 pages in each of 3 slices
    assert len(held(pm, 0)) == 9 and pm.num_free_pages == 10
    assert pm.pages_needed(1, 40) == 9 and pm.pages_to_admit(40) == 9
    before = (pm.host_table.copy(), pm.num_free_pages)
    with pytest.raises(OutOfPages):
        pm.reserve([1, 2], [40, 40])  # 18 > 10: nothing taken in any slice
    assert (pm.host_table == before[0]).all() and pm.num_free_pages == before[1]
    check_accounting(pm)


def test_sliding_slices_release_behind_their_window_and_the_pages_come_back_first():
    pm = manager(num_pages=40)
    pm.reserve([0, 1], [100, 20])
    untouched = set(pm.free_pages)
    dropped = pm.release_behind_window([0, 1], [100, 20])  # next queries at 100 and 20: window 32
    # slice 0 (full) keeps everything; slices 1, 2 keep pages from (100 - 31) // 16 = 4 on
    assert pm.pages_of(0, 0).count(NULL_PAGE) == 0
    for g in (1, 2):
        assert pm.pages_of(0, g)[:4] == [NULL_PAGE] * 4 and NULL_PAGE not in pm.pages_of(0, g)[4:]
        assert NULL_PAGE not in pm.pages_of(1, g)  # its window starts at 0
    assert len(dropped) == 8 and set(dropped) <= set(pm.free_pages)
    check_accounting(pm)
    # growth takes the released pages before any page never handed out (resident memory follows
    # the pages held: the pool is allocated untouched)
    opened = pm.reserve([0], [100 + 2 * P]).opened  # 2 pages in each of 3 slices: 6 of the 8
    assert len(opened) == 6 and set(opened) <= set(dropped) and not set(opened) & untouched
    check_accounting(pm)


def test_fork_and_erase_act_on_every_slice():
    pm = manager(num_pages=40)
    pm.reserve([0], [40])
    pm.fork(0, 1)
    for g in range(3):
        assert pm.pages_of(1, g) == pm.pages_of(0, g)
    copies = pm.reserve([1], [41])  # grows into the shared partial page: a copy per slice
    assert len(copies) == 3 and len({src for src, _ in copies}) == 3
    check_accounting(pm)
    pm.erase([0, 1])
    assert pm.num_free_pages == pm.num_pages - 1
    check_accounting(pm)


def test_share_with_released_pages_of_a_sliding_slice():
    """A prefix-cache hit shares a sliding slice's window pages only (the null page before)."""
    pm = manager(num_pages=40)
    pm.reserve([0], [64])
    pages = [pm.pages_of(0, g) for g in range(3)]
    pm.hold([p for g in pages for p in g])
    hit = [pages[0], [NULL_PAGE, NULL_PAGE] + pages[1][2:], [NULL_PAGE, NULL_PAGE] + pages[2][2:]]
    pm.share(1, hit)
    assert pm.length(1) == 64 and pm.pages_of(1, 1)[:2] == [NULL_PAGE] * 2
    check_accounting(pm)
    with pytest.raises(ValueError, match="2 page lists for 3 slices"):
        pm.share(2, hit[:2])


def test_repoint_acts_on_every_slice():
    """REPOINT equals ERASE + FORK in every slice (a second manager as the reference)."""
    made = []
    for _ in range(2):
        pm = manager(num_pages=60)
        pm.reserve([0, 1], [40, 20])
        made.append(pm)
    pm, ref = made
    pm.repoint([1], [0])
    ref.erase([1])
    ref.fork(0, 1)
    for g in range(3):
        assert pm.pages_of(1, g) == pm.pages_of(0, g) == ref.pages_of(1, g)
    assert pm.refcounts.tolist() == ref.refcounts.tolist()
    assert sorted(pm.free_pages) == sorted(ref.free_pages)
    check_accounting(pm)
    copies = pm.reserve([1], [41])  # copy-on-write of the shared partial page, per slice
    assert len(copies) == 3
    check_accounting(pm)
    pm.erase([0, 1])
    assert pm.num_free_pages == pm.num_pages - 1
