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
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from fms_paged.kv.geometry import NULL_PAGE
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
    def __init__(self, pm: PageManager, hash_fn: HashFn = chain_hash):
        self.pm, self.P, self.hash_fn = pm, pm.page_size, hash_fn
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
        return chain

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
        if pages:  # (a miss: the sequence starts empty at its first RESERVE)
            self.pm.share(seq_id, pages)
        for p in pages:
            self.evictable.pop(p, None)

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
        for j in range(len(chain), n):
            if own[j] == NULL_PAGE:  # released behind a sliding window: the chain stops here
                return
            parent_key, parent = chain[-1] if chain else (None, None)
            chunk = tuple(tokens[j * P : (j + 1) * P])
            key = self.hash_fn(parent_key, chunk, extra)
            page = self.by_key.get(key)
            if page is None:
                page = own[j]
                self.pm.hold([page])
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
            if p in self.pages and self.pm.refcount(p) == 1:  # the cache's own reference only
                self.evictable[p] = None
                self.evictable.move_to_end(p)

    def evict(self, n: int) -> int:
        """Return up to `n` evictable pages to the free pool, least recently used first -> how many."""
        k = min(n, len(self.evictable))
        for _ in range(k):
            page, _ = self.evictable.popitem(last=False)
            got = self.pages.pop(page)
            if self.by_key.get(got.key) == page:
                del self.by_key[got.key]
            siblings = self.children.get(got.parent)
            if siblings is not None:  # (no empty sets left behind: every entry lists a cached page)
                siblings.discard(page)
                if not siblings:
                    del self.children[got.parent]
            self._orphan(page)
            self.pm.unhold([page])
        self.evictions += k
        return k

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
        self.evict(len(self.evictable))
        if self.pages:
            self.pm.unhold(list(self.pages))
        self.by_key.clear()
        self.pages.clear()
        self.children.clear()

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

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
