"""PageManager: a lock-free, ref-counted page allocator for a paged KV cache (vLLM-style).

Bookkeeping lives on the host (a `collections.deque` free pool, numpy mirrors of the page table,
lengths, refcounts and page->logical index); the device holds the two views the attention kernels
read (`page_table`, `phys_to_logical`). Every device write is an index op fed by one host->device
copy, so nothing on the hot path waits for the device.

Its operations are the ones the engine runs: RESERVE (`reserve`, which also reports the pages it
handed out), ASSIGN (`assign` = the slots of the new tokens (`slots`), then `write_slots` at them:
the engine computes a step's slots once and writes each layer's keys and values through
`write_slots`), GATHER (`gather` = `slots`, then `read_slots`, which the GATHER + SDPA kernel
runs), ERASE (`erase`, and `release_prefix` for the pages a sliding window has left behind) and
FORK (`fork`, plus `share` / `hold` / `unhold` for a prefix cache). Tensor math on the pools (and
input conversion) lives in `fms_paged.kv._pool_ops`; slots, ASSIGN, GATHER and copy-on-write
copies in `page_data.PoolData`, FORK and the prefix cache's references in
`page_sharing.PageSharing` (mixins over the state kept here).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from fms_paged.kv import _pool_ops as ops
from fms_paged.kv._pool_ops import read_slots, write_slots
from fms_paged.kv.geometry import NULL_PAGE, grows_into_partial_page, pages_for, pages_grown
from fms_paged.kv.page_data import PoolData
from fms_paged.kv.page_sharing import PageSharing

__all__ = ["OutOfPages", "PageManager", "Reservation", "read_slots", "write_slots"]


class Reservation(list):
    """What a RESERVE did: the list of copy-on-write copies, (src_page, dst_page) pairs the caller
    runs (`PageManager.apply_copies`) before the next operation on those sequences (a plain list,
    as `reserve` has always returned), and `opened`: every page it handed out (copy destinations
    included), which a kernel that reads whole pages zeroes before use."""

    def __init__(self, copies=(), opened=()):
        super().__init__(copies)
        self.opened: list[int] = list(opened)

    def extend_with(self, other: Reservation) -> None:
        """Append another reservation's copies and pages (a step that reserves in several calls)."""
        self.extend(other)
        self.opened.extend(other.opened)


class OutOfPages(RuntimeError):
    """The free pool cannot serve a reserve; nothing was changed.

    Attributes: `needed` (pages the batch needed), `free` (pages free when it was refused),
    `seq_ids` (the sequences that needed new pages).
    """

    def __init__(self, needed: int, free: int, seq_ids: Sequence[int]):
        self.needed, self.free, self.seq_ids = needed, free, list(seq_ids)
        shown = self.seq_ids if len(self.seq_ids) <= 8 else [*self.seq_ids[:8], "..."]
        which = f"seq {shown[0]}" if len(shown) == 1 else f"seqs {shown}".replace("'", "")
        super().__init__(f"need {needed} pages for {which}, {free} free")


class PageManager(PageSharing, PoolData):
    """Ref-counted pages of `page_size` token slots shared by up to `max_seqs` sequences.

    Page 0 is the NULL page: never free, never owned; unused page-table entries point to it.
    Sequence ids are ints in [0, max_seqs) and are the rows of the page table. All ops take a batch.

    Device views (read-only, on `device`), what the attention kernels read:
        page_table:      [max_seqs, max_pages_per_seq] int32, 0 where unused or released
        phys_to_logical: [num_pages] int32, logical page index of an owned page, -1 otherwise
    Slot of token `pos` of seq `s`: page_table[s, pos // P] * P + pos % P.
    `seq_lens` ([max_seqs] int32 on `device`) is made from the host lengths when read.

    Sliding windows: `release_prefix` gives back a sequence's pages that lie wholly before a
    position no query of it will look behind again; the sequence keeps its length, and those
    entries of its table point to the null page.

    Errors: bad ids, lengths or positions raise ValueError (never IndexError); wrong k/v dtype or
    device raise TypeError, wrong shape ValueError; an unservable reserve raises OutOfPages. A call
    that raises changes nothing.

    Copy-on-write: `fork` shares pages. When `reserve` grows a sequence into a partly-filled page
    that is shared, the sequence gets a private page and `reserve` returns the (src, dst) copy to
    its caller, who runs it (`apply_copies(copies, *pools)`) before the next
    `assign`/`erase`/`reserve` that involves those sequences, while the shared source is intact.
    Each caller gets exactly its own copies (vLLM's `allocate_slots` hands back its blocks the same
    way), so concurrent callers never apply, or wait on, each other's.

    Free pool order: last freed, first reused (a stack). Pages freed a moment ago are still in the
    CPU caches, and a pool sized by memory is only touched (faulted in) up to the most pages ever
    used at once, not cycled through end to end.

    Concurrency contract (no locks anywhere):
        Any number of threads may call reserve / erase / release_prefix / fork / slots / assign /
        gather / apply_copies concurrently provided each sequence id, and every sequence forked from it (its
        "family": they share pages and refcounts), is used by one thread at a time. This rests on
        three things only:
        - the free pool is a `collections.deque`, whose `pop` and `extend` are atomic in CPython
          (each is one C call under the GIL). `reserve` checks the pool size, then takes pages one
          `pop` at a time; on a shortage it returns what it took and raises OutOfPages, so under
          contention a thread may see a spurious OutOfPages, but a page is never lost or owned
          twice;
        - every other host structure is a numpy array written only at the rows of the caller's
          sequences and at the pages it owns (a page is owned by one family at a time), so
          different families never write the same element;
        - `erase` updates host and device state of a page (phys_to_logical = -1, table entry = 0)
          BEFORE pushing it onto the free pool, so the next owner's writes are never overwritten.
        `reset` and the host views `utilization` / `live_seqs` / `refcounts` / `free_pages` are not
        meant to race with writers (they are consistent snapshots only when no other thread is
        mutating).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_seqs: int,
        device: str | torch.device = "cpu",
        *,
        max_seq_len: int | None = None,
    ):
        for name, val, low in (("num_pages", num_pages, 2), ("page_size", page_size, 1),
                               ("max_seqs", max_seqs, 1)):  # fmt: skip
            if not isinstance(val, int) or val < low:
                raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
        self.num_pages, self.page_size, self.max_seqs = num_pages, page_size, max_seqs
        self.device = torch.device(device)
        P = page_size
        self.max_pages_per_seq = pages_for(max_seq_len, P) if max_seq_len else num_pages - 1
        self.max_seq_len = max_seq_len if max_seq_len else self.max_pages_per_seq * P
        C = self.max_pages_per_seq
        # host mirror: the source of truth for validation and planning
        self._lens = np.zeros(max_seqs, dtype=np.int64)
        self._live = np.zeros(max_seqs, dtype=bool)
        self._table = np.zeros((max_seqs, C), dtype=np.int32)
        self._refcount = np.zeros(num_pages, dtype=np.int32)
        self._held = np.zeros(num_pages, dtype=bool)  # a reference held by no sequence (`hold`)
        self._p2l = np.full(num_pages, -1, dtype=np.int32)
        # a stack: pop() takes the page freed last (see the class docstring); page 1 on top first
        self._free: collections.deque[int] = collections.deque(range(num_pages - 1, 0, -1))
        # device views
        self._page_table_d = torch.zeros((max_seqs, C), dtype=torch.int32, device=self.device)
        self._p2l_d = torch.full((num_pages,), -1, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ read-only views
    @property
    def page_table(self) -> torch.Tensor:
        """[max_seqs, max_pages_per_seq] int32 on device; do not write to it."""
        return self._page_table_d

    @property
    def seq_lens(self) -> torch.Tensor:
        """[max_seqs] int32 on device, 0 for sequences that are not live: a copy of the host
        lengths made now (no kernel reads it, so it is not kept up to date on every step)."""
        return ops.to_device(self._lens.astype(np.int32), self.device)

    @property
    def host_table(self) -> np.ndarray:
        """[max_seqs, max_pages_per_seq] int32, the host page table (the source of the device one);
        read it, never write it (a step's slots are read off it)."""
        return self._table

    @property
    def phys_to_logical(self) -> torch.Tensor:
        """[num_pages] int32 on device: logical page index of an owned page, -1 otherwise."""
        return self._p2l_d

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def live_seqs(self) -> list[int]:
        """Sorted ids of live sequences (host)."""
        return np.flatnonzero(self._live).tolist()

    def refcount(self, page: int) -> int:
        """References to one page (sequences sharing it, plus `hold`)."""
        return int(self._refcount[page])

    @property
    def refcounts(self) -> np.ndarray:
        """[num_pages] host copy of the page refcounts (0 for free pages and the null page)."""
        return self._refcount.copy()

    @property
    def free_pages(self) -> list[int]:
        """Host snapshot of the free pool (debugging/tests; O(num_pages))."""
        return list(self._free)

    @property
    def utilization(self) -> float:
        """Tokens held in distinct used pages / (used pages * page_size); 0.0 when empty."""
        ids = np.flatnonzero(self._live)
        P = self.page_size
        fill = np.zeros(self.num_pages, dtype=np.int64)
        for s in ids.tolist():
            n = self._num_pages_for(self._lens[s])
            counts = np.clip(self._lens[s] - np.arange(n) * P, 0, P)
            np.maximum.at(fill, self._table[s, :n], counts)
        fill[NULL_PAGE] = 0  # entries a sliding window released
        used = int(np.count_nonzero(self._refcount))
        return float(fill.sum()) / (used * P) if used else 0.0

    def length(self, seq_id: int) -> int:
        """Host length of a sequence (0 if not live)."""
        return int(self._lens[self._check_ids([seq_id], "seq_id")[0]])

    def pages_of(self, seq_id: int) -> list[int]:
        """Host list of the physical pages of a sequence, in logical order (the null page, 0, for
        pages `release_prefix` gave back)."""
        s = int(self._check_ids([seq_id], "seq_id")[0])
        return self._table[s, : self._num_pages_for(self._lens[s])].tolist()

    def pages_needed(self, seq_id: int, new_length: int) -> int:
        """Pages `reserve([seq_id], [new_length])` would take from the pool now (`pages_grown`):
        the new logical pages plus a private copy of a shared, partly filled last page. Host ints
        only, no checks (a scheduler's planning call; the reserve itself validates)."""
        cur, P = int(self._lens[seq_id]), self.page_size
        if new_length <= cur:
            return 0
        shared = cur % P != 0 and bool(self._refcount[self._table[seq_id, cur // P]] > 1)
        return pages_grown(cur, new_length, P, shared)

    def pages_to_admit(self, new_length: int, shared_pages: int = 0) -> int:
        """Pages a sequence not yet live takes from the pool to hold `new_length` tokens when it
        starts by sharing `shared_pages` full pages (a prefix-cache hit: `share`): the scheduler's
        admission plans with this, as it plans a running sequence's growth with `pages_needed`.
        Host ints only, no checks."""
        return pages_grown(shared_pages * self.page_size, new_length, self.page_size)

    def release_behind_window(self, seq_ids: Sequence[int], next_positions: Sequence[int],
                              horizon: int | None) -> list[int]:
        """Sliding windows (every layer windowed; `horizon`: the widest window,
        `fms_paged.kv.spec.release_horizon`; None: no-op): ERASE the pages of each live sequence
        that lie wholly before the first key its next query (at `next_positions[i]`) sees,
        `next_positions[i] - horizon + 1`: no layer reads them again (`release_prefix`). The
        sequences with no such page still held are skipped. -> the pages whose reference was
        dropped (a prefix cache may hold some of them still). The engine's scheduler and the static
        batches' `PagedCache` both release through this."""
        if horizon is None:
            return []
        ids, first, P, C = [], [], self.page_size, self.max_pages_per_seq
        for s, pos in zip(seq_ids, next_positions):
            keep = pos - horizon + 1
            n = keep // P  # pages wholly before `keep`; the last of them still held: some to drop
            if n > 0 and 0 <= s < self.max_seqs and self._live[s] and (
                    n > C or self._table[s, n - 1] != NULL_PAGE):
                ids.append(s)
                first.append(keep)
        return self.release_prefix(ids, first) if ids else []

    # ------------------------------------------------------------------ validation helpers
    def _num_pages_for(self, length: np.ndarray | int) -> np.ndarray | int:
        return pages_for(length, self.page_size)

    def _check_ids(self, seq_ids, what: str = "seq_ids", *, unique: bool = True) -> np.ndarray:
        ids = ops.as_int_array(seq_ids, what)
        bad = (ids < 0) | (ids >= self.max_seqs)
        if bad.any():
            raise ValueError(f"seq id {ids[bad][0]} out of range, expected 0 <= id < {self.max_seqs}")
        if unique and ids.size > 1 and (np.diff(np.sort(ids)) == 0).any():
            vals, counts = np.unique(ids, return_counts=True)
            raise ValueError(f"duplicate seq id {vals[counts > 1][0]} in {what}")
        return ids

    def _check_live(self, ids: np.ndarray) -> None:
        dead = ~self._live[ids]
        if dead.any():
            raise ValueError(f"seq id {ids[dead][0]} is not live (reserve it first)")

    def _check_reserve(self, seq_ids, new_lengths) -> tuple[np.ndarray, np.ndarray]:
        ids = self._check_ids(seq_ids)
        lens = ops.as_int_array(new_lengths, "new_lengths")
        if ids.size != lens.size:
            raise ValueError(f"got {ids.size} seq_ids but {lens.size} new_lengths")
        bad = (lens < 0) | (lens > self.max_seq_len)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"length {lens[i]} for seq {ids[i]} out of range, expected 0 <= length <= "
                f"{self.max_seq_len} (max_pages_per_seq={self.max_pages_per_seq} * page_size="
                f"{self.page_size})"
            )
        shrink = lens < self._lens[ids]
        if shrink.any():
            i = int(np.argmax(shrink))
            raise ValueError(
                f"reserve cannot shrink: seq {ids[i]} has length {self._lens[ids[i]]}, asked for {lens[i]}"
            )
        return ids, lens

    # ------------------------------------------------------------------ free pool
    def _take(self, n: int, needers: np.ndarray) -> list[int]:
        """Pop n pages one atomic pop at a time; on shortage return them and raise OutOfPages."""
        free = self._free
        if len(free) < n:
            raise OutOfPages(n, len(free), needers.tolist())
        taken: list[int] = []
        try:  # n separate atomic pops, driven from C; extend keeps what it got on error
            taken.extend(itertools.starmap(free.pop, itertools.repeat((), n)))
        except IndexError:
            free.extend(taken)  # lost a race with another thread: give back, change nothing
            raise OutOfPages(n, len(free), needers.tolist()) from None
        return taken

    # ------------------------------------------------------------------ ops
    def reserve(self, seq_ids: Sequence[int], new_lengths: Sequence[int]) -> Reservation:
        """Make each seq hold new_lengths[i] token slots (all-or-nothing); see class docstring.

        Takes only the missing pages (ceil(len / P) in all) plus one private page per seq whose
        shared, partly-filled last page it grows into (copy-on-write). Returns a `Reservation`:
        the copies, (src_page, dst_page) pairs, for the caller to run with `apply_copies` ([]
        almost always), and the pages handed out (`opened`). Raises ValueError on bad input and
        OutOfPages when the pool is short; nothing changes then.

        A short batch (a step's rows, copy-on-write included) is a plain Python pass
        (`_reserve_in_place`): numpy calls cost more than the bookkeeping of a handful of rows.
        """
        fast = self._reserve_in_place(seq_ids, new_lengths)
        if fast is not None:
            return fast
        ids, lens = self._check_reserve(seq_ids, new_lengths)
        if ids.size == 0:
            return Reservation()
        P = self.page_size
        cur = self._lens[ids]
        have = self._num_pages_for(cur)
        cow = grows_into_partial_page(cur, lens, P)  # grows into a partly filled last page ...
        if cow.any():  # ... that is shared with a forked sequence
            cow &= self._refcount[self._table[ids, np.maximum(have - 1, 0)]] > 1
            if cow.any():
                cow = self._plan_cow(ids, have, cow)
        need = pages_grown(cur, lens, P, cow)
        total = int(need.sum())
        if total == 0:  # no page changes hands: only the lengths move
            self._lens[ids] = lens
            self._live[ids] = True
            return Reservation()
        pages = self._take(total, ids[need > 0])
        copies = self._copy_on_write(ids, have, cow, need, pages) if cow.any() else []
        self._commit(ids, lens, have - cow, need, np.asarray(pages, dtype=np.int64))
        return Reservation(copies, pages)

    def _reserve_in_place(self, seq_ids, new_lengths) -> Reservation | None:
        """`reserve` of a short batch in plain Python (a step's handful of rows: numpy calls cost
        more than their bookkeeping): each sequence grows within its own last page, or opens fresh
        pages, or copies a shared last page it grows into (copy-on-write: beam search's every
        step), planned as `_plan_cow` plans it; none asks past the limits. Takes the pages as the
        general path does (in batch order, one pop each), so both hand out the same pages and
        copies. -> the Reservation, or None where the general path must run (which also
        validates and raises), with nothing changed."""
        if len(seq_ids) > 32 or len(seq_ids) != len(new_lengths):
            return None
        P, lens, live, table, refs = self.page_size, self._lens, self._live, self._table, self._refcount
        opens = []  # (seq, its first new logical page, pages it takes, the page it copies or 0)
        left: dict[int, int] = {}  # shared partial page -> references not yet copied away
        try:
            for s, n in zip(seq_ids, new_lengths):
                if type(s) is not int or type(n) is not int or not 0 <= s < self.max_seqs:
                    return None
                cur = int(lens[s])
                if n < cur or n > self.max_seq_len or (not live[s] and cur):
                    return None  # a case to validate
                have, src = pages_for(cur, P), 0
                if cur % P and n > cur:  # grows into its partly filled last page: shared?
                    page = int(table[s, have - 1])
                    r = left.get(page, int(refs[page]))
                    if r > 1:  # copy it while another holder is left (the last one keeps it)
                        src, left[page], have = page, r - 1, have - 1
                k = pages_grown(cur, n, P) + (src != 0)
                if k:
                    opens.append((s, have, k, src))
        except TypeError:
            return None
        if len(set(seq_ids)) != len(seq_ids):
            return None
        total = sum(k for _, _, k, _ in opens)
        if total > len(self._free):
            return None  # the general path raises OutOfPages
        pages = self._take(total, np.asarray([s for s, _, _, _ in opens], dtype=np.int64)) if total else []
        flat, cols, copies, i, C = [], [], [], 0, self.max_pages_per_seq
        for s, have, k, src in opens:
            if src:  # its first page is the private copy (src stays >= 1: see above)
                copies.append((src, pages[i]))
                refs[src] -= 1
            for c in range(have, have + k):
                table[s, c] = pages[i]
                refs[pages[i]] = 1
                self._p2l[pages[i]] = c
                flat.append(s * C + c)
                cols.append(c)
                i += 1
        for s, n in zip(seq_ids, new_lengths):
            lens[s] = n
            live[s] = True
        if total:
            packed = ops.to_device(np.asarray(flat + pages + cols, dtype=np.int64), self.device)
            ops.scatter_int32(self._page_table_d, packed[:total], packed[total : 2 * total])
            ops.scatter_int32(self._p2l_d, packed[total : 2 * total], packed[2 * total :])
        return Reservation(copies, pages)

    def _plan_cow(self, ids: np.ndarray, have: np.ndarray, grows: np.ndarray) -> np.ndarray:
        """Which seqs need a private copy of their last page (loop over candidates only).

        In batch order, a seq copies while another holder of the page is left; when every holder
        grows in the same batch, the last one keeps the page (so no page is dropped mid-copy).
        """
        cow = np.zeros_like(grows)
        left: dict[int, int] = {}  # page -> references not yet copied away
        idx = np.flatnonzero(grows)
        for i, page in zip(idx.tolist(), self._table[ids[idx], have[idx] - 1].tolist(), strict=True):
            refs = left.get(page, int(self._refcount[page]))
            if refs > 1:
                cow[i], left[page] = True, refs - 1
        return cow

    def _copy_on_write(self, ids, have, cow, need, pages) -> list[tuple[int, int]]:
        """Drop one reference to each shared last page; -> the (src, dst) copies to run."""
        src = self._table[ids[cow], have[cow] - 1].astype(np.int64)
        first = np.cumsum(need) - need  # index in `pages` of each seq's first new page
        dst = np.asarray(pages, dtype=np.int64)[first[cow]]
        np.subtract.at(self._refcount, src, 1)  # src stays >= 1 (see _plan_cow)
        return list(zip(src.tolist(), dst.tolist(), strict=True))

    def _commit(self, ids, lens, start, need, pages: np.ndarray) -> None:
        """Write new pages (seq ids[i] gets need[i] pages from logical index start[i]) + lengths."""
        first = np.cumsum(need) - need
        rows = np.repeat(ids, need)
        cols = np.repeat(start - first, need) + np.arange(pages.size)
        self._refcount[pages] = 1
        self._table[rows, cols] = pages
        self._p2l[pages] = cols
        self._lens[ids] = lens
        self._live[ids] = True
        C, k = self.max_pages_per_seq, pages.size
        packed = ops.to_device(np.concatenate([rows * C + cols, pages, cols]), self.device)
        ops.scatter_int32(self._page_table_d, packed[:k], packed[k : 2 * k])
        ops.scatter_int32(self._p2l_d, packed[k : 2 * k], packed[2 * k :])

    def erase(self, seq_ids: Sequence[int]) -> None:
        """Drop the sequences: refcount -1 per page, pages reaching 0 return to the free pool."""
        ids = self._check_ids(seq_ids)
        self._check_live(ids)
        if ids.size == 0:
            return
        n = self._num_pages_for(self._lens[ids])
        m = int(n.max())
        held = np.arange(m) < n[:, None]  # [B, m]
        rows = np.broadcast_to(ids[:, None], held.shape)[held]
        cols = np.broadcast_to(np.arange(m), held.shape)[held]
        self._lens[ids] = 0
        self._live[ids] = False
        self._drop(rows, cols)

    def truncate(self, seq_ids: Sequence[int], new_lengths: Sequence[int]) -> list[int]:
        """Shorten live sequences to `new_lengths` (speculative decoding gives back the slots of
        rejected proposals): the pages wholly past a new length drop their reference (back to the
        free pool when nobody else holds them); a partly used last page stays, and the tokens that
        follow overwrite its tail. -> the pages whose reference was dropped. ValueError for a
        sequence that is not live or a length past its current one; nothing changes then."""
        ids = self._check_ids(seq_ids)
        self._check_live(ids)
        lens = ops.as_int_array(new_lengths, "new_lengths")
        if ids.size != lens.size:
            raise ValueError(f"got {ids.size} seq_ids but {lens.size} new_lengths")
        bad = (lens < 0) | (lens > self._lens[ids])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"truncate: length {lens[i]} for seq {ids[i]} out of range, expected "
                             f"0 <= length <= its length {self._lens[ids[i]]}")
        keep, have = self._num_pages_for(lens), self._num_pages_for(self._lens[ids])
        self._lens[ids] = lens
        m = int((have - keep).max()) if ids.size else 0
        if m <= 0:
            return []
        cols = keep[:, None] + np.arange(m)  # [B, m]: logical pages past each new length
        past = cols < have[:, None]
        rows = np.broadcast_to(ids[:, None], past.shape)[past]
        cols = cols[past]
        pages = [p for p in self._table[rows, cols].tolist() if p != NULL_PAGE]
        self._drop(rows, cols)
        return pages

    def release_prefix(self, seq_ids: Sequence[int], positions: Sequence[int]) -> list[int]:
        """ERASE the pages of each sequence that lie wholly before `positions[i]` (a sliding
        window: no query of the sequence looks behind that position again). The sequences keep
        their lengths; those entries of their tables point to the null page, and a later
        `slots` of a position on them raises. -> the pages whose reference was dropped (a prefix
        cache may hold some of them still). ValueError for a sequence that is not live or a
        position past its length; nothing changes then."""
        ids = self._check_ids(seq_ids)
        self._check_live(ids)
        pos = ops.as_int_array(positions, "positions")
        if ids.size != pos.size:
            raise ValueError(f"got {ids.size} seq_ids but {pos.size} positions")
        bad = (pos < 0) | (pos > self._lens[ids])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"release_prefix: position {pos[i]} of seq {ids[i]} out of range, expected "
                             f"0 <= position <= length {self._lens[ids[i]]}")
        n = pos // self.page_size  # pages wholly before each position
        m = int(n.max()) if n.size else 0
        if m == 0:
            return []
        before = np.arange(m) < n[:, None]  # [B, m]
        rows = np.broadcast_to(ids[:, None], before.shape)[before]
        cols = np.broadcast_to(np.arange(m), before.shape)[before]
        held = self._table[rows, cols] != NULL_PAGE  # (released by an earlier call: skipped)
        rows, cols = rows[held], cols[held]
        pages = self._table[rows, cols].tolist()
        self._drop(rows, cols)
        return pages

    def _drop(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """Drop the references of table entries (rows, cols) (null entries skipped): refcount -1,
        entries -> null page, pages reaching 0 back to the free pool."""
        pages = self._table[rows, cols].astype(np.int64)
        real = pages != NULL_PAGE
        if not real.all():
            rows, cols, pages = rows[real], cols[real], pages[real]
        if (self._refcount[pages] > 1).any():  # forked pages: may repeat within the batch
            np.subtract.at(self._refcount, pages, 1)
            freed = np.unique(pages[self._refcount[pages] == 0])
        else:  # every page appears once and drops to 0
            self._refcount[pages] = 0
            freed = pages
        # state of freed pages first, THEN push them on the free pool (concurrency contract)
        self._p2l[freed] = -1
        self._table[rows, cols] = NULL_PAGE
        C = self.max_pages_per_seq
        packed = ops.to_device(np.concatenate([rows * C + cols, freed]), self.device)
        k = rows.size
        ops.fill_int32(self._page_table_d, packed[:k], NULL_PAGE)
        ops.fill_int32(self._p2l_d, packed[k:], -1)
        self._free.extend(freed.tolist())

    def reset(self) -> None:
        """Free everything (not thread-safe)."""
        self._lens[:] = 0
        self._live[:] = False
        self._table[:] = NULL_PAGE
        self._refcount[:] = 0
        self._held[:] = False
        self._p2l[:] = -1
        self._free.clear()  # same deque object: references to the pool stay valid
        self._free.extend(range(self.num_pages - 1, 0, -1))
        self._page_table_d.zero_()
        self._p2l_d.fill_(-1)
