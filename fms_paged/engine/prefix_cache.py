"""Automatic prefix caching: full pages identified by a chained hash of their tokens, shared by
every request whose tokens start the same way, and kept after their requests finish until the
pool needs the pages (vLLM's hashed blocks with an LRU free queue; nano-vllm's chained hashes).

A full page j of a request is keyed by `hash_fn(hash of page j - 1, its P token ids, extra key)`;
the chain makes the key stand for the whole prefix up to that page. The cache holds one reference
to each page it lists (`PageManager.hold`), so a page stays valid after its sequences are erased.
A hit is verified, never trusted: the cached page's own token ids, extra key and parent page must
equal the request's, so a hash collision can never serve another prompt's KV. Pages that no
sequence holds any more are evictable, least recently used first; a page a sequence holds is never
evicted. Host bookkeeping only (no tensors): the engine loop is its one owner.

Layer groups (`fms_paged.kv.page_groups`): a cached logical page is one page per layer slice. The
entry is named by its first slice's page (a full slice: groups are ordered full first) and lists
the other slices' pages with it; it is evictable, evicted and counted as all of them. A sliding
slice's page that its sequence releases behind the window leaves the cache at once (the cache's
reference is dropped, the page goes back to the pool for reuse), so a long request's resident
memory follows the pages it holds. A hit then needs, per sliding slice, only the pages its window
reads before the hit's end: the hit is the longest verified chain whose last pages are still there
in every sliding slice (vLLM's per-group prefix-cache rule).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from fms_paged.kv.geometry import NULL_PAGE
from fms_paged.kv.page_groups import GroupedPages
from fms_paged.kv.page_manager import PageManager

HashFn = Callable[[int | None, tuple[int, ...], Hashable], int]


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra: Hashable) -> int:
    """The key of a full page: Python's hash of (parent key, token ids, extra key). Deterministic
    for ints and tuples of them (no per-process salt); 64-bit, and every hit is verified anyway."""
    return hash((parent, tokens, extra))


@dataclass(frozen=True)
class CachedPage:
    key: int
    parent: int | None  # the page holding the previous P tokens (None for a first page)
    tokens: tuple[int, ...]
    extra: Hashable


class PrefixCache:
    def __init__(self, pm: PageManager | GroupedPages, hash_fn: HashFn = chain_hash):
        self.pm, self.P, self.hash_fn = pm, pm.page_size, hash_fn
        grouped = isinstance(pm, GroupedPages)
        if grouped and pm.windows[0] is not None:
            raise ValueError("prefix caching over layer groups needs a full-attention group (its pages name "
                             f"the cached entries); this model has {pm.groups.describe()}")
        # layer groups: the windows of slices 1.. , each entry's pages there (the null page where
        # released), and which entry a page of those slices belongs to
        self.windows = pm.windows[1:] if grouped else ()
        self.others: dict[int, list[int]] = {}
        self.owner: dict[int, int] = {}
        self._evictable_pages = 0  # pages of the evictable entries (an entry: 1 + its others)
        self.by_key: dict[int, int] = {}  # key -> page
        self.pages: dict[int, CachedPage] = {}  # page -> what it holds
        # cached pages no sequence holds: least recently used first
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.children: dict[int | None, set[int]] = {}  # page -> cached pages listed after it
        self.queries = self.hits = self.evictions = self.collisions = 0  # tokens, tokens, pages, pages

    def match(self, tokens: Sequence[int], extra: Hashable = None) -> list[tuple[int, int]]:
        """The longest run of cached pages that holds the first full pages of `tokens`, verified
        page by page -> its (key, page) chain. At most (len(tokens) - 1) // P pages, so the last
        token is always computed (its logits are needed) and never lands in a shared page."""
        P, chain = self.P, []
        for j in range((len(tokens) - 1) // P):
            parent_key, parent = chain[-1] if chain else (None, None)
            chunk = tuple(tokens[j * P : (j + 1) * P])
            key = self.hash_fn(parent_key, chunk, extra)
            page = self.by_key.get(key)
            if page is None:
                break
            if not self._same(page, chunk, parent, extra):
                self.collisions += 1  # same key, other content: never served
                break
            chain.append((key, page))
        return self._within_windows(chain) if self.windows else chain

    def _within_windows(self, chain: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The longest head of `chain` whose end every sliding slice can resume from: its pages
        from the first one the window of the next position reads are all still cached."""
        for n in range(len(chain), 0, -1):
            if all(self.others[chain[j][1]][g] != NULL_PAGE
                   for g, w in enumerate(self.windows) if w is not None
                   for j in range(self._first_read(n, w), n)):
                return chain[:n]
        return []

    def _first_read(self, n: int, window: int) -> int:
        """The first logical page a query at position n * P reads under `window`."""
        return max(0, n * self.P - window + 1) // self.P

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count an admitted request's lookup (tokens asked, tokens served from the cache)."""
        self.queries += query_tokens
        self.hits += hit_tokens

    def _same(self, page: int, chunk: tuple[int, ...], parent: int | None, extra: Hashable) -> bool:
        got = self.pages[page]
        return got.tokens == chunk and got.parent == parent and got.extra == extra

    def acquire(self, seq_id: int, chain: list[tuple[int, int]]) -> None:
        """Seq `seq_id` (not live) starts with the pages of `chain` (from `match`); they stop
        being evictable."""
        pages = [p for _, p in chain]
        if pages and self.windows:  # every slice: a sliding one its window's pages alone
            n = len(pages)
            per_slice = [pages] + [
                [self.others[p][g] if w is None or j >= self._first_read(n, w) else NULL_PAGE
                 for j, p in enumerate(pages)] for g, w in enumerate(self.windows)]
            self.pm.share(seq_id, per_slice)
        elif pages:  # (a miss: the sequence starts empty at its first RESERVE)
            self.pm.share(seq_id, pages)
        for p in pages:
            if self.evictable.pop(p, 0) is None:
                self._evictable_pages -= self._weight(p)

    def insert(self, seq_id: int, tokens: Sequence[int], num_computed: int,
               chain: list[tuple[int, int]], extra: Hashable = None) -> None:
        """List the full pages of `seq_id` whose KV is written (its first `num_computed` tokens;
        `tokens`: the sequence's tokens) beyond `chain`, the (key, page) pairs of its pages listed
        so far, which this extends in place. Where the content is cached already under another
        page (two requests computed the same prefix at once) or a key holds other content (a
        collision), the sequence's pages stay private from there on: a chain only goes through
        pages its sequence holds, so no page id in it can change content meanwhile."""
        P = self.P
        n = num_computed // P
        if n <= len(chain):
            return
        own = self.pm.pages_of(seq_id)
        others = [self.pm.pages_of(seq_id, g + 1) for g in range(len(self.windows))]
        for j in range(len(chain), n):
            if own[j] == NULL_PAGE:  # released behind a sliding window: the chain stops here
                return
            parent_key, parent = chain[-1] if chain else (None, None)
            chunk = tuple(tokens[j * P : (j + 1) * P])
            key = self.hash_fn(parent_key, chunk, extra)
            page = self.by_key.get(key)
            if page is None:
                page = own[j]
                extra_pages = [o[j] for o in others]
                self.pm.hold([page] + [o for o in extra_pages if o != NULL_PAGE])
                if self.windows:
                    self.others[page] = extra_pages
                    self.owner.update((o, page) for o in extra_pages if o != NULL_PAGE)
                self.by_key[key] = page
                self.pages[page] = CachedPage(key, parent, chunk, extra)
                self.children.setdefault(parent, set()).add(page)
            elif page != own[j]:
                self.collisions += not self._same(page, chunk, parent, extra)
                return
            chain.append((key, page))

    def release(self, pages: Sequence[int]) -> None:
        """After a sequence holding `pages` (logical order) was erased: those of them that no
        sequence holds now become evictable, the deepest first (a shared first page is more
        likely to be asked for again than the tail of one conversation)."""
        for p in reversed(pages):
            if p in self.owner:  # a sliding slice's page released behind its window: forgotten
                self._forget(p)
            elif p in self.pages and self.pm.refcount(p) == 1:  # the cache's own reference only
                if p not in self.evictable:
                    self._evictable_pages += self._weight(p)
                self.evictable[p] = None
                self.evictable.move_to_end(p)

    def _forget(self, page: int) -> None:
        """Drop a sliding slice's page from its entry (its window has passed it)."""
        lead = self.owner.pop(page)
        others = self.others[lead]
        others[others.index(page)] = NULL_PAGE
        if lead in self.evictable:
            self._evictable_pages -= 1
        self.pm.unhold([page])

    def _weight(self, page: int) -> int:
        """Pages an entry frees when evicted: its own and its other slices' still cached."""
        return 1 + sum(o != NULL_PAGE for o in self.others.get(page, ()))

    def evict(self, n: int) -> int:
        """Return at least `n` evictable pages (or all there are) to the free pool, least recently
        used entries first -> how many pages."""
        freed = k = 0
        while freed < n and self.evictable:
            page, _ = self.evictable.popitem(last=False)
            weight = self._weight(page)
            freed, k = freed + weight, k + 1
            self._evictable_pages -= weight
            got = self.pages.pop(page)
            if self.by_key.get(got.key) == page:
                del self.by_key[got.key]
            siblings = self.children.get(got.parent)
            if siblings is not None:  # (no empty sets left behind: every entry lists a cached page)
                siblings.discard(page)
                if not siblings:
                    del self.children[got.parent]
            self._orphan(page)
            extra_pages = [o for o in self.others.pop(page, ()) if o != NULL_PAGE]
            for o in extra_pages:
                del self.owner[o]
            self.pm.unhold([page, *extra_pages])
        self.evictions += k
        return freed

    def _orphan(self, page: int) -> None:
        """`page` leaves the cache: the pages listed after it can no longer be matched (their
        parent's id may soon hold other content); they stay held until evicted themselves."""
        stack = list(self.children.pop(page, ()))
        while stack:
            c = stack.pop()
            got = self.pages[c]
            if self.by_key.get(got.key) == c:
                del self.by_key[got.key]
            self.pages[c] = CachedPage(got.key, -1, got.tokens, got.extra)  # matches no chain
            stack.extend(self.children.pop(c, ()))

    def clear(self) -> None:
        """Drop every cached page no sequence holds (and forget the rest)."""
        self.evict(self.num_evictable)
        if self.pages:
            self.pm.unhold(list(self.pages) + list(self.owner))
        self.others.clear()
        self.owner.clear()
        self.by_key.clear()
        self.pages.clear()
        self.children.clear()

    @property
    def num_evictable(self) -> int:
        """Pages that evicting every evictable entry frees."""
        return self._evictable_pages if self.windows else len(self.evictable)

    def evictable_pages(self, chain: list[tuple[int, int]]) -> int:
        """Pages of `chain`'s entries that are evictable now (a hit on them takes them out)."""
        return sum(self._weight(p) for _, p in chain if p in self.evictable)

    def metrics(self) -> dict:
        return {
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
            "prefix_cache_pages": len(self.pages),
            "prefix_cache_evictable_pages": len(self.evictable),
            "prefix_cache_evictions": self.evictions,
            "prefix_cache_collisions": self.collisions,
        }
