"""Automatic prefix caching and parallel sampling in the engine.

References: the same requests with the cache off (the engine's own path, itself tested against
dense `generate()` in test_engine.py) and dense `generate()` of each prompt alone (contiguous cache,
no pages). The pool invariants are recomputed here from the page tables and the cache's listing,
not taken from the page manager's own counters. Models on the test device (`--device`), each
engine with the device's production kernel (cpp on the CPU, flex on CUDA).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fms_paged import Engine, SamplingParams, generate

P = 16
MAX_LEN = 256


def engine(paged, **kw) -> Engine:
    opts = dict(max_num_seqs=6, max_num_batched_tokens=64, num_pages=40, compile=False,
                max_model_len=MAX_LEN, kernel="cpp" if paged.device.type == "cpu" else "flex")
    opts.update(kw)
    return Engine(paged, **opts)


def run(eng: Engine, reqs, after_step=None, stats: list | None = None) -> list[list[int]]:
    """Submit (prompt, params) pairs, step to the end -> each request's tokens (completion 0);
    `stats` gets each request's final statistics (completion 0), in submission order."""
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    got: dict[tuple[int, int], list[int]] = {}
    final: dict[int, dict] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finished and out.index == 0:
                final[out.request_id] = out.stats
        if after_step is not None:
            after_step(eng)
    if stats is not None:
        stats += [final[i] for i in ids]
    return [got[(i, 0)] for i in ids]


def shared_prefix_requests(rng: random.Random, n: int, sampled: bool = False):
    """Requests whose prompts start with one of a few shared prefixes, cut at random lengths:
    mid-page, exactly on a page boundary (16, 32, 48), or not at all."""
    prefixes = [[rng.randrange(3, 256) for _ in range(70)] for _ in range(3)]
    cuts = [0, 5, 16, 17, 31, 32, 33, 48, 64, 70]
    reqs = []
    for i in range(n):
        prompt = rng.choice(prefixes)[: rng.choice(cuts)] + [
            rng.randrange(3, 256) for _ in range(rng.randint(0 if i % 4 else 1, 20))]
        if not prompt:
            prompt = [rng.randrange(3, 256)]
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=True,
                                **(dict(temperature=0.9, top_k=50, seed=i) if sampled else {}))
        reqs.append((prompt, params))
    return reqs


def check_pool(eng: Engine) -> None:
    """Every page is free, or referenced exactly as often as live page-table rows and the cache's
    listing say; cached pages nobody holds are the evictable ones; nothing is owned twice."""
    pm, cache = eng.pm, eng.prefix_cache
    holders = np.zeros(pm.num_pages, dtype=np.int64)
    for s in pm.live_seqs:
        pages = pm.pages_of(s)
        assert len(set(pages)) == len(pages), f"seq {s} holds a page twice"
        holders[pages] += 1
    seq_held = holders.copy()
    if cache is not None:
        holders[list(cache.pages)] += 1
        assert sorted(pm.held_pages) == sorted(cache.pages)
        evictable = set(cache.evictable)
        assert evictable <= set(cache.pages)
        unreferenced = {p for p in cache.pages if seq_held[p] == 0}
        assert evictable == unreferenced, "a page a sequence holds is evictable, or one is missing"
    free = pm.free_pages
    assert len(free) == len(set(free)), "a page is free twice"
    assert holders[0] == 0 and 0 not in free, "the null page was handed out"
    assert not set(free) & set(np.flatnonzero(holders).tolist()), "a page is free and referenced"
    assert sorted(free + np.flatnonzero(holders).tolist()) == list(range(1, pm.num_pages)), "lost page"
    assert pm.refcounts.tolist() == holders.tolist()


def test_100_requests_cache_on_equals_off_and_dense(models):
    """Greedy: 100 requests with shared prefixes of random lengths under page pressure (evictions
    and preemptions), cache on == cache off == dense alone, the pool consistent after every step."""
    dense, paged = models
    reqs = shared_prefix_requests(random.Random(0), 100)
    on = engine(paged, num_pages=16, max_model_len=128)
    got_on = run(on, reqs, after_step=check_pool)
    got_off = run(engine(paged, num_pages=16, max_model_len=128, enable_prefix_caching=False), reqs)
    assert got_on == got_off
    for (prompt, sp), toks in zip(reqs, got_on):
        assert toks == generate(dense, [prompt], sp.max_new_tokens, eos_id=None)[0]
    m = on.metrics()
    assert m["prefix_cache_hits"] > 0 and m["prefix_cache_evictions"] > 0 and m["preemptions"] > 0
    assert m["prompt_tokens_computed"] < sum(len(p) for p, _ in reqs)
    assert m["kv_pages_used"] == 0 and m["running"] == m["waiting"] == 0


def test_seeded_sampling_cache_on_equals_off_and_dense(models):
    dense, paged = models
    reqs = shared_prefix_requests(random.Random(1), 40, sampled=True)
    on = engine(paged)
    got = run(on, reqs, after_step=check_pool)
    assert got == run(engine(paged, enable_prefix_caching=False), reqs)
    for (prompt, sp), toks in zip(reqs, got):  # each request's own generator: dense alone agrees
        assert toks == generate(dense, [prompt], sp.max_new_tokens, temperature=sp.temperature,
                                top_k=sp.top_k, seed=sp.seed, eos_id=None)[0]
    assert on.metrics()["prefix_cache_hits"] > 0


def test_a_hit_skips_the_shared_pages_but_always_computes_the_last_token(models):
    dense, paged = models
    rng = random.Random(2)
    shared = [rng.randrange(3, 256) for _ in range(3 * P)]  # exactly 3 pages
    eng = engine(paged)
    stats: list[dict] = []  # each request's cached_tokens: what a usage report's cached_tokens says
    first = run(eng, [(shared, SamplingParams(max_new_tokens=4))], stats=stats)
    assert eng.metrics()["prompt_tokens_computed"] == 3 * P
    # the same prompt again: 2 pages shared, the last page (holding the last token) recomputed
    assert run(eng, [(shared, SamplingParams(max_new_tokens=4))], stats=stats) == first
    m = eng.metrics()
    assert m["prefix_cache_hits"] == 2 * P and m["prompt_tokens_computed"] == 3 * P + P
    # a longer prompt through the 3 cached pages: only its own tokens are computed
    longer = shared + [5, 6, 7]
    assert run(eng, [(longer, SamplingParams(max_new_tokens=4))], stats=stats) == generate(dense, [longer], 4)
    assert eng.metrics()["prompt_tokens_computed"] == 4 * P + 3
    # another salt shares nothing
    rid = eng.add_request(shared, SamplingParams(max_new_tokens=1), cache_salt="tenant-b")
    stats += [o.stats for o in eng.stream() if o.request_id == rid and o.finished]
    assert eng.metrics()["prompt_tokens_computed"] == 4 * P + 3 + 3 * P
    assert [r["cached_tokens"] for r in stats] == [0, 2 * P, 3 * P, 0]
    assert [r["prompt_tokens"] for r in stats] == [3 * P, 3 * P, 3 * P + 3, 3 * P]


def test_forced_hash_collision_is_detected_not_served(models):
    """With every key equal, a lookup finds another prompt's page under the key: the token check
    refuses it, and the outputs stay dense's."""
    dense, paged = models
    eng = engine(paged)
    eng.prefix_cache.hash_fn = lambda parent, tokens, extra: 0  # the test hook: all keys collide
    rng = random.Random(3)
    reqs = [([rng.randrange(3, 256) for _ in range(40)], SamplingParams(max_new_tokens=5))
            for _ in range(4)]
    assert run(eng, reqs) == [generate(dense, [p], 5)[0] for p, _ in reqs]
    m = eng.metrics()
    assert m["prefix_cache_collisions"] >= 3 and m["prefix_cache_hits"] == 0
    # the prompt whose page is listed under the key still hits its first page (its second page's
    # key collides with its first page, whose parent differs: refused)
    owner = next(eng.prefix_cache.pages[p] for p in eng.prefix_cache.by_key.values())
    prompt = next(p for p, _ in reqs if tuple(p[:P]) == owner.tokens)
    assert run(eng, [(prompt, SamplingParams(max_new_tokens=5))]) == [generate(dense, [prompt], 5)[0]]
    assert eng.metrics()["prefix_cache_hits"] == P


def test_eviction_is_lru_among_unreferenced_pages(models):
    """Randomized arrivals and aborts on a small pool: pages leave the cache least recently
    released first, never while a sequence holds them; the pool stays consistent after every
    step, and whole at the end once the cache is reset. The release
    times are recorded at the cache's entry points (pages released by one call tie)."""
    _, paged = models
    rng = random.Random(4)
    eng = engine(paged, num_pages=12, max_num_seqs=4, max_model_len=128)
    cache = eng.prefix_cache
    released_at: dict[int, int] = {}
    clock = iter(range(1 << 30))
    release = cache.release

    def timed_release(pages):
        release(pages)
        now = next(clock)
        for p in pages:
            if p in cache.pages and p not in eng.pm.held_pages or p in cache.evictable:
                released_at[p] = now

    cache.release = timed_release
    prefixes = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(4)]
    pending = [(rng.choice(prefixes)[: rng.choice([16, 20, 32, 48])] + [rng.randrange(3, 256)],
                SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True)) for _ in range(60)]
    evicted_total, live = 0, []
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                live.append(eng.add_request(*pending.pop()))
        if live and rng.random() < 0.1:  # abort a request, waiting or running
            rid = live.pop(rng.randrange(len(live)))
            try:
                eng.abort(rid)
            except ValueError:
                pass  # it finished meanwhile
        before_cached = set(cache.pages)
        before_unref = set(cache.evictable)
        start = next(clock)
        eng.step()
        check_pool(eng)
        evicted = before_cached - set(cache.pages)
        evicted_total += len(evicted)
        kept = [released_at[q] for q in before_unref - evicted if q in cache.evictable]
        for p in evicted:
            # unreferenced before the step, or released during it (a preemption) and not since taken
            assert p in before_unref or released_at.get(p, -1) > start, (
                f"page {p} was evicted while a sequence held it")
            assert all(released_at[p] <= t for t in kept), "evicted a page released after one kept"
    assert evicted_total > 0 and eng.metrics()["prefix_cache_hits"] > 0
    eng.reset_prefix_cache()
    check_pool(eng)
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1


def test_an_evicted_and_reused_page_never_serves_the_old_prompt(models):
    """A's pages are cached, then evicted and reused by other prompts; then every page outside the
    cache is poisoned with NaN. A again must compute, not read another prompt's (or NaN) KV."""
    dense, paged = models
    rng = random.Random(6)
    eng = engine(paged, num_pages=12, max_num_seqs=2, max_model_len=128)
    a = [rng.randrange(3, 256) for _ in range(3 * P + 4)]
    run(eng, [(a, SamplingParams(max_new_tokens=3))])
    a_pages = set(eng.prefix_cache.pages)
    assert len(a_pages) == 3
    others = [([rng.randrange(3, 256) for _ in range(5 * P)], SamplingParams(max_new_tokens=4))
              for _ in range(3)]
    run(eng, others)
    assert eng.metrics()["prefix_cache_evictions"] >= 3 and eng.prefix_cache.match(a) == []
    assert a_pages & set(eng.pm.free_pages + list(eng.prefix_cache.pages)) == a_pages
    free = torch.tensor(eng.pm.free_pages, device=paged.device)
    slots = (free[:, None] * P + torch.arange(P, device=paged.device)).flatten()
    for pool in eng.backend.k_pools + eng.backend.v_pools:
        pool[:, :, slots] = float("nan")
    assert run(eng, [(a, SamplingParams(max_new_tokens=6))]) == [generate(dense, [a], 6)[0]]


def test_multi_turn_computes_only_the_new_tokens(models):
    """Each turn resends the whole history: with the cache, only the tokens past the full pages
    the previous turn wrote (prompt and output) are computed: the new ones, plus the partial last
    page. Expected counts follow from that rule alone."""
    dense, paged = models
    rng = random.Random(7)
    eng = engine(paged)
    history: list[int] = []
    written = 0  # tokens whose KV the previous turn wrote (its last output token never is)
    for _ in range(5):
        new = [rng.randrange(3, 256) for _ in range(rng.randint(3, 20))]
        history = history + new
        before = eng.metrics()["prompt_tokens_computed"]
        [out] = run(eng, [(history, SamplingParams(max_new_tokens=8, ignore_eos=True))])
        assert out == generate(dense, [history], 8, eos_id=None)[0]
        computed = eng.metrics()["prompt_tokens_computed"] - before
        shared = min(written // P, (len(history) - 1) // P) * P
        assert computed == len(history) - shared
        assert computed <= len(new) + 1 + (P - 1)  # new tokens, the last output, a partial page
        written = len(history) + len(out) - 1
        history = history + out


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_n_completions_each_equal_the_single_request_with_its_seed(models, cache):
    """SamplingParams(n=5, seed=s): completion i equals the n=1 request with seed s + i, with
    fewer rows than completions (some wait, then run on their own); the prompt's pages are held
    once by the forked completions."""
    dense, paged = models
    rng = random.Random(8)
    prompt = [rng.randrange(3, 256) for _ in range(2 * P + 5)]
    sp = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, ignore_eos=True)
    eng = engine(paged, max_num_seqs=4, enable_prefix_caching=cache)
    rid = eng.add_request(prompt, SamplingParams(n=5, seed=11, **sp))
    got: dict[int, list[int]] = {}
    stats: dict[int, dict] = {}
    shared_refs = None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            got.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                stats[out.index] = out.stats
        if shared_refs is None and len(got) >= 4:  # right after the prefill and the FORKs
            first_page = eng.pm.pages_of(eng.scheduler.running[0].seq_id)[0]
            shared_refs = int(eng.pm.refcounts[first_page]) - (first_page in eng.pm.held_pages)
        check_pool(eng)
    assert shared_refs == 4  # one page, held by the 4 running completions
    assert sorted(got) == list(range(5))
    alone = [generate(dense, [prompt], 10, temperature=1.0, top_p=0.9, seed=11 + i, eos_id=None)[0]
             for i in range(5)]  # the n = 1 request with seed 11 + i, on the dense path
    assert [got[i] for i in range(5)] == alone
    assert len({tuple(t) for t in alone}) > 1  # the seeds differ, so do the completions
    assert sorted(stats) == list(range(5))  # each completion's final output has its statistics
    assert all(stats[i]["output_tokens"] == 10 and stats[i]["prompt_tokens"] == len(prompt)
               for i in range(5))
    assert eng.metrics()["finished_requests"] == 5 and not eng._live


def test_n_completions_abort_stops_every_completion(models):
    _, paged = models
    eng = engine(paged, max_num_seqs=2)
    rid = eng.add_request([5] * 20, SamplingParams(n=3, max_new_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort(rid)
    outs = eng.step()
    assert sorted(o.index for o in outs if o.finish_reason == "abort") == [0, 1, 2]
    assert not eng.has_unfinished() and eng.metrics()["kv_pages_used"] == 0


def test_aborting_one_completion_leaves_the_others(models):
    """abort(id, index): completion 0 aborted before its prefill (the others then prefill on their
    own), completion 1 mid-decode; the rest equal the n = 1 requests with their seeds."""
    dense, paged = models
    prompt = list(range(3, 3 + 2 * P + 3))
    sp = dict(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    eng = engine(paged, max_num_seqs=4)
    rid = eng.add_request(prompt, SamplingParams(n=4, seed=20, **sp))
    eng.abort(rid, 0)
    got: dict[int, list[int]] = {}
    ends: dict[int, str] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                ends[out.index] = out.finish_reason
        if len(got.get(1, [])) == 2 and 1 not in ends:
            eng.abort(rid, 1)
    assert ends == {0: "abort", 1: "abort", 2: "length", 3: "length"}
    assert got[0] == [] and len(got[1]) == 2
    for i in (1, 2, 3):
        want = generate(dense, [prompt], 8, seed=20 + i, eos_id=None, temperature=1.0)[0]
        assert got[i] == want[: len(got[i])]
    assert not eng._live and eng.metrics()["kv_pages_used"] == 0
    with pytest.raises(ValueError, match=f"request id {rid} is not live"):
        eng.abort(rid, 2)
    live = eng.add_request(prompt, SamplingParams(n=2, seed=1, **sp))
    with pytest.raises(ValueError, match=rf"completion 5 of request {live} is not live \(live: \[0, 1\]\)"):
        eng.abort(live, 5)


def test_bad_prefix_cache_arguments(models):
    _, paged = models
    with pytest.raises(ValueError, match="enable_prefix_caching='yes'; expected a bool"):
        engine(paged, enable_prefix_caching="yes")
    eng = engine(paged)
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got int"):
        eng.add_request([1, 2], cache_salt=3)
    with pytest.raises(ValueError, match=r"SamplingParams.n=0; expected an int >= 1"):
        SamplingParams(n=0)


def test_layer_groups_a_hit_needs_only_the_windows_pages(hf_family, device):
    """Gemma 3 (tiny: 1 full layer, 2 sliding at a 24-token window): pages held per layer group. A
    finished request leaves its full pages cached, and of its sliding pages only those its last
    window read (the rest went back to the pool as the window passed them). A follow-up hits as
    far as every sliding slice still has the pages its window reads before the hit's end; the
    tokens equal an engine without the cache; evicting everything gives every page back."""
    from fms_paged import get_model

    _, path = hf_family("gemma3")
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    assert paged.attention_specs()[0].window == 24 and paged.attention_specs()[1].window is None
    rng = random.Random(5)
    first = [rng.randrange(3, 256) for _ in range(100)]
    eng = engine(paged, num_pages=120)
    assert eng.backend.groups.grouped
    out = run(eng, [(first, SamplingParams(max_new_tokens=20, ignore_eos=True))])[0]
    # its last query was at position 118: the sliding slices kept pages from (118 - 23) // 16 = 5
    follow = first + out + [rng.randrange(3, 256) for _ in range(5)]  # 125 tokens: 7 full pages match
    other = first[:40] + [rng.randrange(3, 256) for _ in range(30)]  # 2 full pages match
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    stats: list = []
    got = run(eng, [(follow, params), (other, params)], stats=stats)
    # follow: a hit of 7 pages reads from page (112 - 23) // 16 = 5, kept; other: a hit of 2 or 1
    # pages would read pages 0.., released: no hit
    assert [s["cached_tokens"] for s in stats] == [112, 0]
    off = engine(paged, num_pages=120, enable_prefix_caching=False)
    assert got == run(off, [(follow, params), (other, params)])
    cache = eng.prefix_cache
    assert cache.num_evictable == len(cache.pages) + len(cache.owner) > 0
    eng.reset_prefix_cache()
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1
