"""The pages of a model whose layer groups keep different histories (`fms_paged.kv.groups`):
one `PageManager` whose rows are (slice, sequence) pairs, behind the page manager's own interface.

Row `g * max_seqs + s` is sequence `s`'s page table for slice `g`. Every operation on sequences
(RESERVE, ERASE, FORK, a prefix cache's share) is the page manager's on the sequence's rows of every
slice, so the one free pool, the refcounts, copy-on-write, the all-or-nothing RESERVE and its
`OutOfPages` work across groups unchanged. What differs per slice is the history it keeps: a sliding
slice's pages behind its window go back to the free pool (`release_behind_window`), where the
last freed page is the next one handed out: a released page is reused before an untouched one, so
on the CPU the pool's resident memory follows the pages held.

Planning counts what each slice will hold: a sequence growing by k pages takes k pages in every
slice (`pages_needed`, `pages_to_admit`); what a sliding slice gives back is released before the
step plans (the scheduler releases first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fms_paged.kv.groups import LayerGroups
from fms_paged.kv.page_manager import OutOfPages, PageManager, Reservation


class GroupedPages:
    """Page tables per slice over one pool; the sequence-level interface of `PageManager` (what the
    scheduler, the prefix cache and the static batches call) plus the per-slice views a step reads.

    Sequence ids are in [0, max_seqs); `rows(seq_ids, g)` are their rows in slice g's table.
    """

    def __init__(self, groups: LayerGroups, num_pages: int, page_size: int, max_seqs: int,
                 device: str | torch.device = "cpu", *, max_seq_len: int | None = None):
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        self.groups = groups
        self.num_slices = G = groups.num_slices
        self.inner = PageManager(num_pages, page_size, max_seqs * G, device, max_seq_len=max_seq_len)
        self.max_seqs = max_seqs
        self.num_pages, self.page_size, self.device = num_pages, page_size, self.inner.device
        self.max_pages_per_seq, self.max_seq_len = self.inner.max_pages_per_seq, self.inner.max_seq_len
        self.windows = groups.windows
        self._sliding = groups.sliding

    # ------------------------------------------------------------------ rows and views
    def rows(self, seq_ids: Sequence[int] | np.ndarray, g: int) -> list[int] | np.ndarray:
        """The rows of `seq_ids` in slice g's page table (an array for an array)."""
        if isinstance(seq_ids, np.ndarray):
            return seq_ids + g * self.max_seqs
        base = g * self.max_seqs
        return [base + int(s) for s in seq_ids]

    def _all_rows(self, seq_ids: Sequence[int]) -> list[int]:
        return [g * self.max_seqs + int(s) for g in range(self.num_slices) for s in seq_ids]

    def _check_seq(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < self.max_seqs:
                raise ValueError(f"seq id {s!r} out of range, expected 0 <= id < {self.max_seqs}")

    @property
    def page_table(self) -> torch.Tensor:
        """[num_slices * max_seqs, max_pages_per_seq] int32 on device: slice g's rows are
        g * max_seqs .. (g + 1) * max_seqs - 1."""
        return self.inner.page_table

    @property
    def host_table(self) -> np.ndarray:
        return self.inner.host_table

    @property
    def phys_to_logical(self) -> torch.Tensor:
        return self.inner.phys_to_logical

    @property
    def num_free_pages(self) -> int:
        return self.inner.num_free_pages

    @property
    def free_pages(self) -> list[int]:
        return self.inner.free_pages

    @property
    def live_seqs(self) -> list[int]:
        return [s for s in self.inner.live_seqs if s < self.max_seqs]

    def utilization(self) -> float:
        return self.inner.utilization()

    def refcount(self, page: int) -> int:
        return self.inner.refcount(page)

    @property
    def refcounts(self) -> np.ndarray:
        return self.inner.refcounts

    @property
    def held_pages(self) -> list[int]:
        return self.inner.held_pages

    def length(self, seq_id: int) -> int:
        self._check_seq([seq_id])
        return self.inner.length(seq_id)

    def pages_of(self, seq_id: int, g: int = 0) -> list[int]:
        """Slice g's pages of a sequence, in logical order (0 where released)."""
        self._check_seq([seq_id])
        return self.inner.pages_of(g * self.max_seqs + int(seq_id))

    def slots(self, seq_ids: Sequence[int], positions: Sequence[int], g: int = 0) -> torch.Tensor:
        """Slice g's pool slots of the tokens (`PageManager.slots` on the slice's rows)."""
        return self.inner.slots(np.asarray(seq_ids, dtype=np.int64) + g * self.max_seqs, positions)

    # ------------------------------------------------------------------ planning
    def pages_needed(self, seq_id: int, new_length: int) -> int:
        """Pages `reserve([seq_id], [new_length])` takes now, over every slice."""
        return sum(self.inner.pages_needed(g * self.max_seqs + seq_id, new_length)
                   for g in range(self.num_slices))

    def pages_to_admit(self, new_length: int, shared_pages: int = 0) -> int:
        """Pages a sequence not yet live takes to hold `new_length` tokens when it starts from a
        prefix-cache hit of `shared_pages` pages: the same growth in every slice."""
        return self.num_slices * self.inner.pages_to_admit(new_length, shared_pages)

    # ------------------------------------------------------------------ operations
    def reserve(self, seq_ids: Sequence[int], new_lengths: Sequence[int]) -> Reservation:
        """RESERVE in every slice at once (all-or-nothing: one reserve on the sequences' rows)."""
        self._check_seq(seq_ids)
        try:
            return self.inner.reserve(self._all_rows(seq_ids), list(new_lengths) * self.num_slices)
        except OutOfPages as e:  # (named by sequence, not by page-table row)
            seqs = list(dict.fromkeys(r % self.max_seqs for r in e.seq_ids))
            raise OutOfPages(e.needed, e.free, seqs) from None

    def erase(self, seq_ids: Sequence[int]) -> None:
        self._check_seq(seq_ids)
        self.inner.erase(self._all_rows(seq_ids))

    def fork(self, parent: int, child: int) -> None:
        """The child shares the parent's pages in every slice (copy-on-write per slice)."""
        self._check_seq([parent, child])
        for g in range(self.num_slices):
            base = g * self.max_seqs
            self.inner.fork(base + parent, base + child)

    def repoint(self, seq_ids: Sequence[int], parents: Sequence[int]) -> None:
        """REPOINT in every slice at once (one call on the sequences' rows; see
        `PageManager.repoint`)."""
        self._check_seq(seq_ids)
        self._check_seq(parents)
        self.inner.repoint(self._all_rows(seq_ids), self._all_rows(parents))

    def retable(self, seq_ids: Sequence[int], tables: np.ndarray | torch.Tensor) -> list[int]:
        """`PageManager.retable` of every slice at once: tables [num_slices, len(seq_ids),
        max_pages_per_seq], slice g's rows of the sequences in tables[g]."""
        self._check_seq(seq_ids)
        t = tables.cpu().numpy() if isinstance(tables, torch.Tensor) else np.asarray(tables)
        return self.inner.retable(self._all_rows(seq_ids), t.reshape(-1, t.shape[-1]))

    def release_behind_window(self, seq_ids: Sequence[int], next_positions: Sequence[int],
                              horizon: int | None = None) -> list[int]:
        """Each sliding slice releases the pages of each sequence wholly before the first key its
        next query (at `next_positions[i]`) sees under the slice's window (`horizon` is the
        single-group form's and is not used: each slice has its own). -> the pages whose
        reference was dropped."""
        dropped: list[int] = []
        for g in self._sliding:
            rows = self.rows(seq_ids, g)
            dropped += self.inner.release_behind_window(rows, next_positions, self.windows[g])
        return dropped

    def release_prefix(self, seq_ids: Sequence[int], positions: Sequence[int]) -> list[int]:
        """Release every slice's pages wholly before `positions` (as `PageManager.release_prefix`)."""
        self._check_seq(seq_ids)
        return self.inner.release_prefix(self._all_rows(seq_ids), list(positions) * self.num_slices)

    def truncate(self, seq_ids: Sequence[int], new_lengths: Sequence[int]) -> list[int]:
        """Shorten the sequences in every slice (as `PageManager.truncate`). A sliding slice's
        released pages lie before the first query's window, never past a length kept."""
        self._check_seq(seq_ids)
        return self.inner.truncate(self._all_rows(seq_ids), list(new_lengths) * self.num_slices)

    def share(self, seq_id: int, pages: Sequence[Sequence[int]]) -> None:
        """Seq `seq_id` (not live) starts with `pages[g]` as slice g's first pages (a prefix-cache
        hit; the null page where a sliding slice needs no page: behind the hit's window)."""
        self._check_seq([seq_id])
        if len(pages) != self.num_slices:
            raise ValueError(f"share: {len(pages)} page lists for {self.num_slices} slices")
        for g, p in enumerate(pages):
            self.inner.share(g * self.max_seqs + seq_id, p)

    def hold(self, pages: Sequence[int]) -> None:
        self.inner.hold(pages)

    def unhold(self, pages: Sequence[int]) -> None:
        self.inner.unhold(pages)

    def apply_copies(self, copies, *pools: torch.Tensor) -> None:
        self.inner.apply_copies(copies, *pools)

    def reset(self) -> None:
        self.inner.reset()

