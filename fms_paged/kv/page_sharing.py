"""The sharing side of `PageManager` (fms_paged/kv/page_manager.py): FORK (`fork`: a sequence takes
another's pages, copy-on-write in a later `reserve`; `repoint`: a batch of sequences drop their
pages and take others' at once, beam search's step), and a prefix cache's references (`share`:
a sequence takes cached pages; `hold` / `unhold`: references no sequence holds). A mixin: it
updates the manager's host mirrors and device tables (`_table`, `_lens`, `_live`, `_refcount`,
`_held`, `_p2l`) under the same concurrency contract, and keeps no state of its own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fms_paged.kv import _pool_ops as ops
from fms_paged.kv.geometry import NULL_PAGE


class PageSharing:
    """FORK, `share`, `hold` / `unhold` of a `PageManager`."""

    def fork(self, parent: int, child: int) -> None:
        """Child (not live) shares all pages of parent (live): same length, same table row.

        O(pages of parent); no KV data is copied (copy-on-write happens in a later reserve).
        """
        p, c = (int(x) for x in self._check_ids([parent, child], "fork(parent, child)"))
        self._check_live(np.array([p]))
        if self._live[c]:
            raise ValueError(f"fork child seq id {c} is already live (erase it first)")
        length = int(self._lens[p])
        n = self._num_pages_for(length)
        self._adopt(c, self._table[p, :n].astype(np.int64), length)

    def repoint(self, seq_ids: Sequence[int], parents: Sequence[int]) -> None:
        """REPOINT: each sequence `seq_ids[i]` (live or not) drops its pages and takes the pages
        and length of the live `parents[i]`, as ERASE of `seq_ids` then FORK of each pair would,
        in one pass (beam search's step: a beam continued twice takes the row of a beam continued
        by none). A page both hold keeps its reference; a page only the dropped rows held returns
        to the free pool. Parents may repeat, and none is among `seq_ids` (an order would matter
        then). ValueError on bad input; nothing changes then. No KV data moves (copy-on-write of a
        shared last page happens in a later reserve)."""
        ids, par = list(seq_ids), list(parents)  # (plain Python: a step's few rows, no numpy pass)
        if len(ids) != len(par):
            raise ValueError(f"repoint: got {len(ids)} seq_ids but {len(par)} parents")
        for what, rows in (("seq_ids", ids), ("parents", par)):
            for s in rows:
                if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < self.max_seqs:
                    raise ValueError(f"repoint: seq id {s!r} in {what} out of range, expected "
                                     f"0 <= id < {self.max_seqs}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"repoint: duplicate seq id in seq_ids {ids}")
        dead = [s for s in par if not self._live[s]]
        if dead:
            raise ValueError(f"seq id {dead[0]} is not live (reserve it first)")
        both = set(par) & set(ids)
        if both:
            raise ValueError(f"repoint: parent {min(both)} is also among seq_ids {ids}")
        if not ids:
            return
        # (a row's entries past its pages are the null page: whole rows copy, host and device)
        old, new = self._table[ids], self._table[par]
        differ = old != new  # an entry both hold keeps its reference: only the others count
        dropped, taken = old[differ].tolist(), new[differ].tolist()
        refs = self._refcount
        # ERASE frees pages in sorted order when one of them was shared, else in table order
        shared = len(dropped) - dropped.count(NULL_PAGE) < np.count_nonzero(old) or any(
            refs[p] > 1 for p in dropped if p != NULL_PAGE)
        freed = self._trade(taken, dropped)
        if shared:
            freed = sorted(freed)
        self._table[ids] = new
        self._lens[ids] = self._lens[par]
        self._live[ids] = True
        # state of freed pages first, THEN push them on the free pool (concurrency contract)
        self._p2l[freed] = -1
        k = len(ids)
        packed = ops.to_device(np.asarray(ids + par + freed, dtype=np.int64), self.device)
        self._page_table_d.index_copy_(0, packed[:k], self._page_table_d.index_select(0, packed[k : 2 * k]))
        ops.fill_int32(self._p2l_d, packed[2 * k :], -1)
        self._free.extend(freed)

    def retable(self, seq_ids: Sequence[int], tables: np.ndarray | torch.Tensor) -> list[int]:
        """Live sequences trade pages among themselves: `seq_ids[i]` takes the whole page table
        row `tables[i]` ([len(seq_ids), max_pages_per_seq], or [1, ...]), its length kept (beam
        search's lookahead steps, `fms_paged::decode_beams`, moved a group's beams between rows
        inside one call: a beam continued twice took a spare row, which took its parent's earlier pages and
        copied its later ones into its own). Every page of the new rows is one of these rows' pages
        now, at the same logical index; a page's references follow the rows that hold it, and a
        page none holds any more returns to the free pool. -> the pages whose references dropped,
        in their rows' logical order (a prefix cache's `release`). ValueError on bad input; nothing
        changes then. No KV data moves."""
        ids = self._check_ids(seq_ids)
        self._check_live(ids)
        new = np.asarray(tables.cpu() if isinstance(tables, torch.Tensor) else tables, dtype=np.int32)
        if new.ndim == 3 and new.shape[0] == 1:  # (one slice's [1, n, pages], as decode_beams gives)
            new = new[0]
        if new.shape != (ids.size, self.max_pages_per_seq):
            raise ValueError(f"retable: tables of shape {list(new.shape)}, expected "
                             f"[{ids.size}, {self.max_pages_per_seq}] for seq ids {ids.tolist()}")
        old = self._table[ids]
        differ = old != new  # an entry both hold keeps its reference: only the others count
        if not differ.any():
            return []
        dropped, taken = old[differ].tolist(), new[differ].tolist()
        mine = set(old[old != NULL_PAGE].tolist())
        cols = np.nonzero(differ)[1].tolist()
        for p, c in zip(taken, cols):
            if p == NULL_PAGE:
                continue
            if p not in mine:
                raise ValueError(f"retable: page {p} is not a page of seq ids {ids.tolist()}")
            if self._p2l[p] != c:
                raise ValueError(f"retable: page {p} at logical index {c}, but it holds logical page "
                                 f"{int(self._p2l[p])}")
        freed = sorted(self._trade(taken, dropped))
        dropped = [p for p in dropped if p != NULL_PAGE]
        self._table[ids] = new
        # state of freed pages first, THEN push them on the free pool (concurrency contract)
        self._p2l[freed] = -1
        k = ids.size
        packed = ops.to_device(np.concatenate([ids.astype(np.int64), np.asarray(freed, dtype=np.int64)]),
                               self.device)
        self._page_table_d.index_copy_(0, packed[:k], ops.to_device(new, self.device))
        ops.fill_int32(self._p2l_d, packed[k:], -1)
        self._free.extend(freed)
        return dropped

    def _trade(self, taken: list[int], dropped: list[int]) -> list[int]:
        """References of rows changing pages (REPOINT, RETABLE): +1 for each page of `taken`, then
        -1 for each of `dropped` (the taken first, so a page on both sides never reaches 0); the
        null page counts none. -> the dropped pages left with none, once each, in `dropped`'s
        order."""
        refs = self._refcount
        for p in taken:
            if p != NULL_PAGE:
                refs[p] += 1
        for p in dropped:
            if p != NULL_PAGE:
                refs[p] -= 1
        return list(dict.fromkeys(p for p in dropped if p != NULL_PAGE and refs[p] == 0))

    def _adopt(self, s: int, pages: np.ndarray, length: int) -> None:
        """Seq `s` (checked: not live) takes `pages` (checked: owned, or the null page where a
        window released one) as its logical pages 0..k-1 and holds `length` tokens: refcount +1
        each, host and device tables."""
        n = pages.size
        np.add.at(self._refcount, pages[pages != NULL_PAGE], 1)
        self._table[s, :n] = pages
        self._lens[s] = length
        self._live[s] = True
        flat = s * self.max_pages_per_seq + np.arange(n, dtype=np.int64)
        packed = ops.to_device(np.concatenate([flat, pages]), self.device)
        ops.scatter_int32(self._page_table_d, packed[:n], packed[n:])

    def share(self, seq_id: int, pages: Sequence[int]) -> None:
        """Seq `seq_id` (not live) starts with the full pages `pages` as its logical pages
        0..k-1 (length k * P), each refcount +1 (a prefix cache hit; the null page for a logical
        page a sliding window needs no more). Each page must be owned and
        hold logical page j of its sequences (`phys_to_logical[pages[j]] == j`): a prefix page
        sits at the same logical index in every sequence that shares it. No KV data moves."""
        s = int(self._check_ids([seq_id], "seq_id")[0])
        if self._live[s]:
            raise ValueError(f"share: seq id {s} is already live (erase it first)")
        pages = ops.as_int_array(pages, "pages")
        n = pages.size
        if n > self.max_pages_per_seq:
            raise ValueError(f"share: {n} pages > max_pages_per_seq={self.max_pages_per_seq}")
        real = pages != NULL_PAGE  # (a sliding window's slice: none behind the hit's window)
        if n and ((pages < 0) | (pages >= self.num_pages)).any():
            raise ValueError(f"share: pages {pages.tolist()} must be in [1, {self.num_pages}) or null")
        if n and ((self._refcount[pages[real]] < 1) | (self._p2l[pages[real]] != np.arange(n)[real])).any():
            raise ValueError(
                f"share: pages {pages.tolist()} must be owned pages holding logical pages 0..{n - 1} "
                f"(phys_to_logical {self._p2l[pages].tolist()})"
            )
        if np.unique(pages[real]).size != int(real.sum()):
            raise ValueError(f"share: duplicate page in {pages.tolist()}")
        self._adopt(s, pages, n * self.page_size)

    def hold(self, pages: Sequence[int]) -> None:
        """Take one reference to each owned page that belongs to no sequence (a prefix cache's):
        the page outlives its sequences until `unhold`. ValueError for a page not owned, or held
        already."""
        pages = ops.as_int_array(pages, "pages")
        if pages.size and (((pages < 1) | (pages >= self.num_pages)).any()
                           or (self._refcount[pages] < 1).any() or self._held[pages].any()
                           or np.unique(pages).size != pages.size):
            raise ValueError(f"hold: pages {pages.tolist()} must be distinct owned pages not held yet")
        self._refcount[pages] += 1
        self._held[pages] = True

    def unhold(self, pages: Sequence[int]) -> None:
        """Drop `hold`'s reference; a page no sequence holds either returns to the free pool."""
        pages = ops.as_int_array(pages, "pages")
        if pages.size and (((pages < 1) | (pages >= self.num_pages)).any() or not self._held[pages].all()
                           or np.unique(pages).size != pages.size):
            raise ValueError(f"unhold: pages {pages.tolist()} must be distinct held pages")
        self._held[pages] = False
        self._refcount[pages] -= 1
        freed = pages[self._refcount[pages] == 0]
        if freed.size:  # state first, THEN the free pool (concurrency contract)
            self._p2l[freed] = -1
            ops.fill_int32(self._p2l_d, ops.to_device(freed.astype(np.int64), self.device), -1)
            self._free.extend(freed.tolist())

    @property
    def held_pages(self) -> list[int]:
        """Pages referenced by `hold` (a prefix cache), whether or not a sequence shares them."""
        return np.flatnonzero(self._held).tolist()
