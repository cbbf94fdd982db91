"""Page geometry: the one place that says how tokens map onto pages and pool slots.

A sequence's token at logical position `pos` lives on its logical page `pos // P`, at offset
`pos % P`; the physical page holding that logical page comes from the page table, and the token's
pool slot is `page * P + pos % P` (slot axis of a pool `[L, Hkv, num_pages * P, D]`). Page 0 is the
null page: never owned, the target of padding writes (and of the table entries of pages a sliding
window released). Everything else (page manager, scheduler,
budget, backends, kernels' Python side, benchmarks) calls these functions instead of writing the
arithmetic again. Each works on Python ints, numpy arrays and torch tensors alike.
"""

from __future__ import annotations

import numpy as np
import torch

NULL_PAGE = 0


def pages_for(num_tokens, page_size: int):
    """Pages that hold `num_tokens` tokens: ceil(num_tokens / P)."""
    return -(-num_tokens // page_size)


def slot(page, pos, page_size: int):
    """Pool slot of logical position `pos` on physical page `page` (the page holding `pos // P`)."""
    return page * page_size + pos % page_size


def page_slots(pages, page_size: int):
    """Every slot of each page: pages [K] (numpy or tensor) -> [K, P] of the same kind."""
    if isinstance(pages, np.ndarray):
        return pages.astype(np.int64)[:, None] * page_size + np.arange(page_size, dtype=np.int64)
    return pages.long()[:, None] * page_size + torch.arange(page_size, device=pages.device)


def opened_pages(old_len: int, new_len: int, page_size: int) -> range:
    """Logical pages a sequence opens when it grows from `old_len` to `new_len` tokens."""
    return range(pages_for(old_len, page_size), pages_for(new_len, page_size))


def grows_into_partial_page(old_len, new_len, page_size: int):
    """Whether growing from `old_len` to `new_len` writes into the partly filled last page. When
    that page is shared (a fork), copy-on-write gives the sequence a private copy first."""
    return (old_len % page_size != 0) & (new_len > old_len)


def pages_grown(old_len, new_len, page_size: int, shares_partial_page=False):
    """Pages a sequence takes from the pool growing from `old_len` to `new_len >= old_len`
    tokens: the logical pages it opens, plus a private copy of its partly filled last page when
    it writes into that page and the page is shared (`shares_partial_page`: copy-on-write).
    Page growth is this rule alone: the page manager's RESERVE and planning calls apply it."""
    if shares_partial_page is False:  # (nothing shared: no copy to count)
        return pages_for(new_len, page_size) - pages_for(old_len, page_size)
    copy = grows_into_partial_page(old_len, new_len, page_size) & shares_partial_page
    return pages_for(new_len, page_size) - pages_for(old_len, page_size) + copy


def pool_pages(max_seqs: int, max_seq_len: int, page_size: int) -> int:
    """Pages for `max_seqs` sequences of `max_seq_len` tokens each, plus the null page."""
    return max_seqs * pages_for(max_seq_len, page_size) + 1


def pages_held(num_tokens: int, page_size: int, horizon: int | None = None, chunk: int = 1) -> int:
    """The most pages a sequence of `num_tokens` tokens holds at once: all of them; or, when every
    layer is windowed (`horizon`: the widest window, `fms_paged.kv.spec.release_horizon`) and
    the pages behind the window are released, those of a step of at most `chunk` new tokens and
    of the window before it: positions s - horizon + 1 .. s + chunk - 1, at most
    pages_for(horizon - 1 + chunk) + 1 pages."""
    full = pages_for(num_tokens, page_size)
    if horizon is None:
        return full
    return min(full, pages_for(horizon - 1 + chunk, page_size) + 1)


def min_pool_pages(max_model_len: int, page_size: int, horizon: int | None = None, chunk: int = 1) -> int:
    """The fewest pages a pool needs to serve one sequence of `max_model_len` tokens: the most it
    holds at once (`pages_held`, with `horizon` and `chunk` as there) and the null page. The
    engine refuses a smaller `num_pages`, the memory budget a smaller pool, and `generate` sizes
    its own pool from it."""
    return pages_held(max_model_len, page_size, horizon, chunk) + 1
