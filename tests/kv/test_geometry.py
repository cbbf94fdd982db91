"""Page geometry against a brute-force walk over token positions."""

import numpy as np
import torch

from fms_paged.kv.geometry import (
    grows_into_partial_page,
    min_pool_pages,
    opened_pages,
    page_slots,
    pages_for,
    pages_grown,
    pages_held,
    pool_pages,
    slot,
)


def test_geometry_matches_a_walk_over_positions():
    for P in (1, 3, 16, 64):
        for n in range(0, 3 * P + 2):
            pages = sorted({pos // P for pos in range(n)})
            assert pages_for(n, P) == len(pages)
            for m in range(n, n + 2 * P + 1):
                new = sorted({pos // P for pos in range(m)} - set(pages))
                assert list(opened_pages(n, m, P)) == new
                # a write at position n lands on the page holding n - 1 iff that page is not full
                assert bool(grows_into_partial_page(n, m, P)) == (m > n and n > 0 and (n - 1) // P == n // P)
        table = [7, 2, 9]  # physical page of each logical page
        for pos in range(3 * P):
            assert slot(table[pos // P], pos, P) == table[pos // P] * P + pos - (pos // P) * P
        assert pool_pages(3, 2 * P + 1, P) == 3 * 3 + 1


def test_vectorised_forms_agree_with_scalars(device):
    P = 16
    lens = np.array([0, 1, 15, 16, 17, 33])
    assert pages_for(lens, P).tolist() == [pages_for(int(n), P) for n in lens]
    assert grows_into_partial_page(lens, lens + 1, P).tolist() == [
        bool(grows_into_partial_page(int(n), int(n) + 1, P)) for n in lens]
    pages = np.array([3, 0, 5])
    want = [[p * P + o for o in range(P)] for p in pages.tolist()]
    assert page_slots(pages, P).tolist() == want
    assert page_slots(torch.tensor(pages, device=device), P).tolist() == want


def test_page_growth_and_the_smallest_pool():
    """`pages_grown` is the pages opened plus a copy of a shared partial page written into (the
    copy-on-write rule), scalar and vectorised; `min_pool_pages` is one sequence's most pages at
    once and the null page."""
    for P in (1, 3, 16):
        for n in range(0, 3 * P + 2):
            for m in range(n, n + 2 * P + 1):
                for shared in (False, True):
                    want = len(opened_pages(n, m, P)) + (shared and bool(grows_into_partial_page(n, m, P)))
                    assert pages_grown(n, m, P, shared) == want
        old = np.arange(0, 3 * P)
        new = old + np.arange(3 * P) % 4
        shared = np.arange(3 * P) % 2 == 0
        assert pages_grown(old, new, P, shared).tolist() == [
            pages_grown(int(a), int(b), P, bool(c)) for a, b, c in zip(old, new, shared)]
        assert min_pool_pages(10 * P, P) == 11
        assert min_pool_pages(10 * P, P, horizon=2 * P, chunk=P) == pages_held(10 * P, P, 2 * P, P) + 1
