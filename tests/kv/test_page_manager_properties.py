"""Stateful property test: PageManager vs a tiny pure-Python model of a paged pool.

The model keeps, per live sequence, the value written at each position (None = reserved, not yet
written) and a list of abstract page ids (shared by fork, replaced on copy-on-write). From it alone
we predict OutOfPages, the number of copy-on-write copies, the free count, the sharing pattern,
and what `gather` must return on every layer of a stacked pool (L = 2). The manager's device views
and the pools are on the test device (`--device`).
"""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fms_paged.kv import OutOfPages, PageManager

NUM_PAGES, MAX_SEQS, L, H, D = 12, 5, 2, 1, 2


def kv_of(values: list[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [L, T, H, D] encoding each value (and the layer) so every slot is distinguishable."""
    x = torch.tensor(values, dtype=torch.float32, device=device)
    layer = torch.arange(L, dtype=torch.float32, device=device)[:, None] * 1000.0
    k = torch.stack([x + layer, x + layer + 0.25], dim=-1)[:, :, None, :]  # [L, T, 1, D]
    return k, -k


class PagedPoolMachine(RuleBasedStateMachine):
    device = torch.device("cpu")  # the test device, set by `_on_the_test_device`

    @initialize(P=st.sampled_from([1, 2, 3, 4]), prefill=st.lists(st.integers(0, 9), max_size=2))
    def setup(self, P, prefill):
        self.P = P
        self.pm = PageManager(NUM_PAGES, P, MAX_SEQS, self.device)
        shape = (L, H, NUM_PAGES * P, D)
        # garbage where nothing was written
        self.k_pool = torch.full(shape, float("nan"), device=self.device)
        self.v_pool = torch.full(shape, float("nan"), device=self.device)
        self.tokens: dict[int, list[float | None]] = {}  # model: seq -> value per position
        self.mpages: dict[int, list[int]] = {}  # model: seq -> abstract page ids
        self.next_page = itertools.count(1)
        self.next_value = itertools.count(1)
        if self._reserve(list(range(len(prefill))), prefill):  # start with written prompts
            self._write(self._unwritten(range(len(prefill))))

    # ------------------------------------------------------------------ model helpers
    def model_free(self) -> int:
        return NUM_PAGES - 1 - len({p for ps in self.mpages.values() for p in ps})

    def sharers(self, page: int, mpages: dict[int, list[int]]) -> int:
        return sum(page in ps for ps in mpages.values())

    def host_state(self):
        pm = self.pm
        return (
            pm.free_pages,
            pm.refcounts.tolist(),
            pm.live_seqs,
            [pm.pages_of(s) for s in range(MAX_SEQS)],
            pm.page_table.clone(),
            pm.seq_lens.clone(),
            pm.phys_to_logical.clone(),
            self.k_pool.clone(),
        )

    def assert_unchanged(self, before) -> None:
        after = self.host_state()
        for a, b in zip(before, after, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.nan_to_num(-9.0), b.nan_to_num(-9.0))
            else:
                assert a == b

    def _reserve(self, ids: list[int], growth: list[int]) -> bool:
        """Reserve on both sides; predicts OutOfPages and copy-on-write from the model alone."""
        P, cap = self.P, self.pm.max_seq_len
        new_lens, need, cows = [], 0, []
        plan = {s: list(ps) for s, ps in self.mpages.items()}  # copy-on-write, in batch order
        for s, g in zip(ids, growth, strict=True):
            cur = len(self.tokens.get(s, []))
            new = min(cap, cur + g)
            cow = cur % P != 0 and new > cur and self.sharers(plan[s][-1], plan) > 1
            if cow:
                plan[s][-1] = -1 - s  # a private page, distinct from every other
            new_lens.append(new)
            need += math.ceil(new / P) - math.ceil(cur / P) + cow
            cows.append(cow)
        if need > self.model_free():
            event("reserve: OutOfPages")
            before = self.host_state()
            with pytest.raises(OutOfPages, match=f"need {need} pages"):
                self.pm.reserve(ids, new_lens)
            self.assert_unchanged(before)
            return False
        copies = self.pm.reserve(ids, new_lens)
        assert len(copies) == sum(cows)
        if any(cows):
            event("reserve: copy-on-write")
        self.pm.apply_copies(copies, self.k_pool, self.v_pool)  # protocol: right after reserve
        for s, new, cow in zip(ids, new_lens, cows, strict=True):
            toks, pages = self.tokens.setdefault(s, []), self.mpages.setdefault(s, [])
            if cow:
                pages[-1] = next(self.next_page)
            pages.extend(next(self.next_page) for _ in range(math.ceil(new / P) - len(pages)))
            toks.extend([None] * (new - len(toks)))
        return True

    def _write(self, pairs: list[tuple[int, int]]) -> None:
        """Assign fresh values at (seq, position) pairs, all layers at once."""
        if not pairs:
            return
        values = [float(next(self.next_value)) for _ in pairs]
        k, v = kv_of(values, self.device)
        self.pm.assign([s for s, _ in pairs], [p for _, p in pairs], k, v, self.k_pool, self.v_pool)
        for (s, p), x in zip(pairs, values, strict=True):
            self.tokens[s][p] = x

    def _unwritten(self, seqs) -> list[tuple[int, int]]:
        return [(s, p) for s in seqs for p, x in enumerate(self.tokens[s]) if x is None]

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def reserve(self, data):
        """Batch of new or growing sequences (positions left unwritten for `assign`)."""
        ids = data.draw(st.lists(st.integers(0, MAX_SEQS - 1), min_size=1, max_size=3, unique=True))
        growth = [data.draw(st.integers(0, 2 * self.P + 1)) for _ in ids]
        self._reserve(ids, growth)

    @rule(data=st.data())
    def decode(self, data):
        """One decode step: +1 token for some live seqs, reserved then written at once."""
        if not self.tokens:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        self._write(self._unwritten(ids))  # a decode step follows a fully written prefill
        old = {s: len(self.tokens[s]) for s in ids}
        if self._reserve(ids, [1] * len(ids)):
            self._write([(s, n) for s, n in old.items() if n < len(self.tokens[s])])

    @rule(data=st.data())
    def assign(self, data):
        todo = sorted(s for s, t in self.tokens.items() if None in t)
        if not todo:
            return
        chosen = data.draw(st.lists(st.sampled_from(todo), min_size=1, unique=True))
        pairs = data.draw(st.permutations(self._unwritten(chosen)))  # several seqs, any order
        self._write(pairs)

    @rule(data=st.data())
    def fork(self, data):
        free_ids = [s for s in range(MAX_SEQS) if s not in self.tokens]
        if not self.tokens or not free_ids:
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = data.draw(st.sampled_from(free_ids))
        self._write(self._unwritten([parent]))  # fork a fully written sequence (protocol)
        self.pm.fork(parent, child)
        event("fork")
        self.tokens[child] = list(self.tokens[parent])
        self.mpages[child] = list(self.mpages[parent])

    @rule(data=st.data())
    def fork_and_diverge(self, data):
        """Fork, then grow parent and child in one batch (either order): copy-on-write."""
        self.fork(data)
        live = sorted(self.tokens)
        if len(live) < 2:
            return
        pair = data.draw(st.lists(st.sampled_from(live), min_size=2, max_size=2, unique=True))
        old = {s: len(self.tokens[s]) for s in pair}
        if self._reserve(pair, [data.draw(st.integers(1, self.P)) for _ in pair]):
            self._write([(s, p) for s, n in old.items() for p in range(n, len(self.tokens[s]))])

    @rule(data=st.data())
    def erase(self, data):
        if not self.tokens:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        if any(self.sharers(p, self.mpages) > 1 for s in ids for p in self.mpages[s]):
            event("erase: a shared page")
        self.pm.erase(ids)
        for s in ids:
            del self.tokens[s], self.mpages[s]

    @rule(data=st.data())
    def bad_shrink(self, data):
        nonempty = sorted(s for s, t in self.tokens.items() if t)
        if not nonempty:
            return
        s = data.draw(st.sampled_from(nonempty))
        before = self.host_state()
        with pytest.raises(ValueError, match="reserve cannot shrink"):
            self.pm.reserve([s], [len(self.tokens[s]) - 1])
        self.assert_unchanged(before)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pool_accounting(self):
        pm = self.pm
        free = pm.free_pages
        owned = {s: pm.pages_of(s) for s in pm.live_seqs}
        distinct = {p for ps in owned.values() for p in ps}
        assert sorted(owned) == sorted(self.tokens)
        assert len(free) == len(set(free)) == pm.num_free_pages == self.model_free()
        assert len(free) + len(distinct) == NUM_PAGES - 1
        assert 0 not in free and 0 not in distinct and not set(free) & distinct
        rc = pm.refcounts
        for page in range(NUM_PAGES):
            assert rc[page] == sum(page in ps for ps in owned.values())
        assert sum(rc) == sum(len(ps) for ps in owned.values())

    @invariant()
    def sharing_matches_model(self):
        for s, t in itertools.combinations(sorted(self.tokens), 2):
            ps, pt = self.pm.pages_of(s), self.pm.pages_of(t)
            ms, mt = self.mpages[s], self.mpages[t]
            for i in range(min(len(ms), len(mt))):
                assert (ps[i] == pt[i]) == (ms[i] == mt[i])

    @invariant()
    def device_views(self):
        pm, C = self.pm, self.pm.max_pages_per_seq
        p2l = [-1] * NUM_PAGES
        for s in range(MAX_SEQS):
            pages = pm.pages_of(s)
            assert pm.page_table[s].tolist() == pages + [0] * (C - len(pages))
            assert int(pm.seq_lens[s]) == len(self.tokens.get(s, []))
            for i, page in enumerate(pages):
                p2l[page] = i
        assert pm.phys_to_logical.tolist() == p2l

    @invariant()
    def gather_returns_what_was_assigned(self):
        if not self.tokens:
            return
        seqs = sorted(self.tokens)
        for layer in range(L):
            gk, gv, lens = self.pm.gather(seqs, self.k_pool, self.v_pool, layer=layer)
            assert lens.tolist() == [len(self.tokens[s]) for s in seqs]
            for b, s in enumerate(seqs):
                n = len(self.tokens[s])
                known = [p for p, x in enumerate(self.tokens[s]) if x is not None]
                if known:
                    ek, ev = kv_of([self.tokens[s][p] for p in known], self.device)
                    assert torch.equal(gk[b, :, known], ek[layer].transpose(0, 1))
                    assert torch.equal(gv[b, :, known], ev[layer].transpose(0, 1))
                assert not gk[b, :, n:].any() and not gv[b, :, n:].any()


@pytest.fixture(autouse=True)
def _on_the_test_device(device, monkeypatch):
    """Hypothesis builds the machine itself (no fixtures): hand it the test device."""
    monkeypatch.setattr(PagedPoolMachine, "device", device)


TestPagedPool = PagedPoolMachine.TestCase
TestPagedPool.settings = settings(
    max_examples=1000,
    stateful_step_count=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
