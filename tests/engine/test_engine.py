"""The continuous-batching engine against the dense static-batch path (`attn_impl="sdpa"`).

Every output is compared with dense `generate()` of that prompt alone on the same weights (an
independent path: contiguous cache + SDPA, no pages, no scheduler). Wide cases run the device's
production kernel (cpp on the CPU, eager: no compile cost; flex on CUDA); the zero-recompile cases
use the compiled steps. Models and engines are on the test device (`--device`).
"""

from __future__ import annotations

import json
import random
import threading

import pytest

from fms_paged import Engine, SamplingParams, generate, get_model

MAX_LEN = 256  # max_model_len of the test engines


def kernel_for(model) -> str:
    """The production kernel of the model's device: cpp on the CPU, flex on CUDA."""
    return "cpp" if model.device.type == "cpu" else "flex"


def cpu_only(model, why: str) -> None:
    if model.device.type != "cpu":
        pytest.skip(f"CPU only: {why}")


def engine(paged, **kw) -> Engine:
    """An engine for the tests: one-token steps (decode_steps=1) unless asked, since the tests count
    steps and per-token latencies; lookahead steps, and the default "auto", are tested by
    tests/engine/test_decode_steps.py and test_families.py."""
    opts = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=24, compile=False,
                max_model_len=MAX_LEN, kernel=kernel_for(paged), decode_steps=1)
    opts.update(kw)
    return Engine(paged, **opts)


def run(eng: Engine, stats: dict[int, dict] | None = None) -> dict[int, list[int]]:
    """Step to the end -> each request's tokens; `stats` collects each request's final statistics
    (`RequestOutput.stats`, n = 1 requests)."""
    got: dict[int, list[int]] = {}
    for out in eng.stream():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert (out.stats is not None) == out.finished  # statistics come with the final output only
        if out.finished and stats is not None:
            stats[out.request_id] = out.stats
    return got


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 256) for _ in range(n)]


def test_200_requests_under_page_pressure_equal_dense_alone(models):
    """A pool of 23 pages (368 tokens) for 8 rows: requests are preempted and recomputed, none is
    lost, and each request's greedy tokens equal dense generate() of its prompt alone."""
    dense, paged = models
    rng = random.Random(0)
    reqs = [(random_prompt(rng, rng.randint(1, 100)), rng.randint(1, 40)) for _ in range(200)]
    eng = engine(paged)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]
    stats: dict[int, dict] = {}
    got = run(eng, stats)
    m = eng.metrics()
    assert m["preemptions"] > 0, "the page budget never forced a preemption"
    assert sorted(got) == sorted(ids) and m["finished_requests"] == 200
    assert m["finished_by_reason"] == {"length": 200}
    for rid, (prompt, n) in zip(ids, reqs):
        assert got[rid] == generate(dense, [prompt], n, eos_id=None)[0], rid
    assert m["running"] == m["waiting"] == 0 and m["kv_pages_used"] == 0  # every page came back
    assert sorted(stats) == sorted(ids)
    assert all(r["finish_reason"] == "length" for r in stats.values())
    assert sum(r["preemptions"] for r in stats.values()) == m["preemptions"]


def test_gather_kernel_under_page_pressure_equals_dense_alone(models):
    """The GATHER fallback (decode rows padded to the longest, prefill chunks packed, both in one
    mixed forward): same tokens."""
    dense, paged = models
    rng = random.Random(5)
    reqs = [(random_prompt(rng, rng.randint(1, 60)), rng.randint(1, 25)) for _ in range(40)]
    eng = engine(paged, kernel="gather", num_pages=20)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]
    got = run(eng)
    assert eng.metrics()["preemptions"] > 0
    for rid, (prompt, n) in zip(ids, reqs):
        assert got[rid] == generate(dense, [prompt], n, eos_id=None)[0], rid


def test_seeded_sampling_alone_in_a_batch_after_preemption_and_dense(models):
    dense, paged = models
    rng = random.Random(1)
    prompt = random_prompt(rng, 37)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=50, top_p=0.9, seed=123,
                            ignore_eos=True)
    alone = engine(paged, num_pages=200)
    rid = alone.add_request(prompt, params)
    want = run(alone)[rid]
    # in a mixed batch with greedy and other seeded requests, under page pressure
    busy = engine(paged, num_pages=22)
    for i in range(6):
        busy.add_request(random_prompt(rng, 60), SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                temperature=0.7 * (i % 2), seed=i))
    rid = busy.add_request(prompt, params)
    stats: dict[int, dict] = {}
    got = run(busy, stats)
    assert stats[rid]["preemptions"] > 0, "the seeded request was not preempted"
    assert got[rid] == want
    assert generate(dense, [prompt], 30, temperature=1.0, top_k=50, top_p=0.9, seed=123,
                    eos_id=None)[0] == want
    other = engine(paged, num_pages=200)
    rid = other.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 124}))
    assert run(other)[rid] != want


def test_long_prompt_is_chunked_while_8_requests_keep_decoding(models):
    """A prompt of 5x the token budget joins 8 decoding requests: it is prefilled over several
    steps in the same forwards as their decodes, and each of them gets a token every step."""
    dense, paged = models
    rng = random.Random(2)
    budget = 32
    eng = engine(paged, max_num_seqs=9, max_num_batched_tokens=budget, num_pages=80)
    short = [random_prompt(rng, rng.randint(5, 20)) for _ in range(8)]
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in short]
    got = {i: [] for i in ids}
    while eng.scheduler.waiting or eng._submitted or any(not got[i] for i in ids):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    long_prompt = random_prompt(rng, 5 * budget)
    long_id = eng.add_request(long_prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    got[long_id] = []
    steps_until_first = 0
    while not got[long_id]:
        before = {i: len(got[i]) for i in ids}
        outs = eng.step()
        steps_until_first += 1
        for o in outs:
            got[o.request_id] += o.new_token_ids
        assert all(len(got[i]) == before[i] + 1 for i in ids)  # nobody stalled
    assert steps_until_first >= 5  # 160 tokens at most 32 - 8 a step
    for o in eng.stream():
        got[o.request_id] += o.new_token_ids
    for rid, p in zip(ids, short):
        assert got[rid] == generate(dense, [p], 30, eos_id=None)[0]
    assert got[long_id] == generate(dense, [long_prompt], 5, eos_id=None)[0]


def test_threads_submit_400_requests_while_the_loop_runs(models):
    _, paged = models
    eng = engine(paged, num_pages=60)
    submitted: list[int] = []
    lock = threading.Lock()

    def submit(tid: int) -> None:
        rng = random.Random(tid)
        for _ in range(50):
            rid = eng.add_request(random_prompt(rng, rng.randint(1, 8)),
                                  SamplingParams(max_new_tokens=rng.randint(1, 3), ignore_eos=True))
            with lock:
                submitted.append(rid)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    finished: list[int] = []
    while any(t.is_alive() for t in threads) or eng.has_unfinished():
        finished += [o.request_id for o in eng.step() if o.finished]
    for t in threads:
        t.join()
    assert len(submitted) == 400 and len(set(submitted)) == 400
    assert sorted(finished) == sorted(submitted)  # each finished exactly once


def test_stops_and_abort(models):
    dense, paged = models
    prompt = [5, 6, 7, 8]
    free = generate(dense, [prompt], 12, eos_id=None)[0]
    stop = free[4]
    eng = engine(paged)
    a = eng.add_request(prompt, SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))
    b = eng.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    c = eng.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    reasons, got = {}, {}
    for o in eng.step() + eng.step():
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    eng.abort(c)
    for o in eng.stream():
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            reasons[o.request_id] = o.finish_reason
    assert got[a] == free[: free.index(stop) + 1] and reasons[a] == "stop"
    assert got[b] == free[:3] and reasons[b] == "length"
    assert reasons[c] == "abort" and got[c] == free[:2]
    assert eng.metrics()["kv_pages_used"] == 0
    with pytest.raises(ValueError, match=f"request id {c} is not live"):
        eng.abort(c)
    d = eng.add_request(prompt, SamplingParams(max_new_tokens=5))
    eng.abort(d)  # before it was ever scheduled
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in eng.stream()] == [(d, [], "abort")]
    assert not eng.has_unfinished() and eng.metrics()["waiting"] == 0


def test_eos_stops_unless_ignored(models):
    dense, paged = models
    prompt = [9, 10, 11]
    free = generate(dense, [prompt], 8, eos_id=None)[0]
    eos = free[2]
    model_eos = get_model(variant="micro", device=paged.device, seed=0, attn_impl="paged",
                          eos_token_id=eos)
    eng = engine(model_eos)
    a = eng.add_request(prompt, SamplingParams(max_new_tokens=8))
    b = eng.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    got = run(eng)
    assert got[a] == free[:3] and got[b] == free


BAD_PARAMS = {
    "max_new_tokens": (0, "max_new_tokens=0"),
    "temperature": (-0.5, "temperature=-0.5"),
    "top_k": (0, "top_k=0"),
    "top_p": (1.5, "top_p=1.5"),
    "seed": ("x", "seed='x'"),
    "stop_token_ids": ("ab", "stop_token_ids='ab'"),
    "ignore_eos": (1, "ignore_eos=1"),
}


@pytest.mark.parametrize("field", list(BAD_PARAMS))
def test_bad_sampling_params_name_the_value(field):
    value, msg = BAD_PARAMS[field]
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_bad_requests_are_refused_and_the_engine_keeps_serving(models):
    from fms_paged.kv.cache import PagedCache

    dense, paged = models
    small = PagedCache(paged, 8, MAX_LEN, num_pages=10, kernel=kernel_for(paged))  # 9 pages: 144 tokens
    eng = engine(paged, backend=small)
    ok = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    cases = [
        ([], ValueError, "prompt is empty"),
        ([1, 256], ValueError, "prompt token 1 = 256 is outside the vocabulary [0, 256)"),
        ([1, -1], ValueError, "prompt token 1 = -1"),
        ([1, 2.5], TypeError, "prompt token 1 is 2.5"),
        ("hello", TypeError, "prompt must be a list of token ids, got str"),
    ]
    for prompt, exc, msg in cases:
        with pytest.raises(exc) as err:
            eng.add_request(prompt, SamplingParams(max_new_tokens=1))
        assert msg in str(err.value)
    with pytest.raises(ValueError) as err:
        eng.add_request([1] * 140, SamplingParams(max_new_tokens=5))
    assert "145 tokens > 144" in str(err.value) and "capacity (9 pages of 16)" in str(err.value)
    wide = engine(paged, num_pages=100)
    with pytest.raises(ValueError) as err:
        wide.add_request([1] * 250, SamplingParams(max_new_tokens=7))
    assert "257 tokens > 256, max_model_len" in str(err.value)
    with pytest.raises(TypeError, match="SamplingParams, got dict"):
        eng.add_request([1], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="request id 12345 is not live"):
        eng.abort(12345)
    assert run(eng) == {ok: generate(dense, [[1, 2, 3]], 4, eos_id=None)[0]}


def test_bad_engine_settings(models):
    dense, paged = models
    with pytest.raises(ValueError, match="attn_impl='paged', got attn_impl='sdpa'"):
        Engine(dense, num_pages=100)
    for kw, msg in (
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens=4 < max_num_seqs=8"),
        (dict(compile="yes"), "compile='yes'"),
        (dict(compile=2), "compile=2"),
        (dict(compile="tuned"), "compile='tuned'"),
        (dict(kernel="flex-eager"), "kernel='flex-eager'"),
        (dict(max_model_len=4096), r"max_model_len=4096; expected an int in \[1, 2048\]"),
        (dict(num_pages=1), "num_pages=1"),
    ):
        with pytest.raises(ValueError, match=msg):
            engine(paged, **kw)


def test_budget_refusal_states_memory_and_the_setting_that_works(models, monkeypatch):
    from fms_paged.kv.budget import CPU_KV_SPACE_ENV, KVBudgetError

    _, paged = models
    cpu_only(paged, "the pool is sized by the CPU KV space; other devices' budget: tests/kv/test_budget.py")
    page = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, 16 tokens, fp32
    monkeypatch.setenv(CPU_KV_SPACE_ENV, str(50 * page / 2**30))  # 50 pages
    with pytest.raises(KVBudgetError) as err:
        Engine(paged, max_model_len=2048, compile=False)
    msg = str(err.value)
    assert f"{CPU_KV_SPACE_ENV}=" in msg and "max_model_len=2048" in msg
    assert "129 pages of 16 tokens x 8192 bytes" in msg  # what one sequence of 2048 needs
    assert "num_pages>=129" in msg and "max_model_len<=784" in msg  # (50 - 1) * 16
    eng = Engine(paged, max_model_len=784, compile=False, kernel="cpp")  # what it said fits (CPU)
    assert eng.pm.num_pages == 50
    with pytest.raises(KVBudgetError, match="num_pages=20 cannot hold one sequence of max_model_len=2048"):
        Engine(paged, num_pages=20, compile=False)


def test_cpu_pool_sized_by_memory_is_not_touched_until_used(models, monkeypatch):
    """2 GiB of KV space: the engine starts and serves without its RSS growing by the pool."""
    psutil = pytest.importorskip("psutil")
    from fms_paged.kv.budget import CPU_KV_SPACE_ENV

    dense, paged = models
    cpu_only(paged, "the RSS of a host-memory pool")
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "2")
    rss = psutil.Process().memory_info().rss
    eng = Engine(paged, max_num_seqs=4, max_num_batched_tokens=64, compile=False, kernel="gather")
    assert eng.budget.kv_bytes == 2 << 30 and eng.backend.kv_bytes > (2 << 30) - eng.budget.page_bytes
    rid = eng.add_request([4, 5, 6], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert run(eng)[rid] == generate(dense, [[4, 5, 6]], 5, eos_id=None)[0]
    assert psutil.Process().memory_info().rss - rss < 256 << 20


def test_decode_step_has_no_host_sync(models, no_host_sync):
    """Inside a decode step nothing reads device memory back but the sampled tokens (`tolist`,
    which on the CPU dispatches no op: the mode sees every other read; on CUDA it is a copy, and
    the mode catches the banned ops: item, nonzero, boolean-mask indexing). The GATHER kernel: the
    dispatch mode cannot run inside flex_attention's compiled wrapper; the host path (scheduler,
    RESERVE, step metadata) is the same for every kernel."""
    _, paged = models
    eng = engine(paged, num_pages=60, kernel="gather")
    for n in (5, 17, 30):
        eng.add_request(list(range(3, 3 + n)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    eng.step()  # prefill
    with no_host_sync() as mode:
        for _ in range(18):  # crosses page boundaries (page openings on the host)
            assert len(eng.step()) == 3
    assert "index_copy_" in mode.seen


@pytest.mark.parametrize("kernel", ["cpp", "flex"])
def test_zero_recompiles_over_500_engine_steps_compiled(models, kernel, require_kernel):
    """compile=True, the cpp kernel and the compiled flex kernel: after `warmup()` (decode buckets
    2 and 4 for cpp, whose graph has the batch dynamic past one row; 1 and 4 for flex), 500 steps
    with requests joining and leaving recompile nothing."""
    import torch._dynamo

    require_kernel(kernel)
    dense, paged = models
    rng = random.Random(3)
    eng = Engine(paged, max_num_seqs=4, max_num_batched_tokens=64, num_pages=160, compile=True,
                 max_model_len=160, kernel=kernel)

    def submit():
        prompt = random_prompt(rng, rng.randint(1, 40))
        n = rng.randint(2, 30)
        return eng.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)), prompt, n

    assert eng.runner.buckets == ([2, 4] if kernel == "cpp" else [1, 4])
    eng.warmup(progress=False)
    reqs = [submit() for _ in range(4)]
    got: dict[int, list[int]] = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(500):
            if rng.random() < 0.15:
                reqs.append(submit())
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
    finished = [r for r, _, _ in reqs if r not in eng._live]
    assert len(finished) > 30
    for rid, prompt, n in reqs[:10]:
        assert got[rid] == generate(dense, [prompt], n, eos_id=None)[0]


def test_metrics_report_state_and_latencies(models):
    _, paged = models
    eng = engine(paged, num_pages=60)
    rids = [eng.add_request([3 + i] * (10 + i), SamplingParams(max_new_tokens=4, ignore_eos=True))
            for i in range(3)]
    eng.step()
    m = eng.metrics()
    assert m["running"] == 3 and m["waiting"] == 0 and m["kv_pages_used"] == 3
    assert m["kv_pages_used"] + m["kv_pages_free"] == m["kv_pages_total"] == 59
    stats: dict[int, dict] = {}
    run(eng, stats)
    m = eng.metrics()
    assert m["finished_requests"] == 3 and m["output_tokens"] == 12 and m["steps"] == 4
    assert m["finished_by_reason"] == {"length": 3} and "requests" not in m
    for i, rid in enumerate(rids):
        r = stats[rid]
        assert r["output_tokens"] == 4 and len(r["itl"]) == 3
        assert r["prompt_tokens"] == 10 + i and r["cached_tokens"] == 0 and r["preemptions"] == 0
        assert 0 <= r["queue"] < r["ttft"] <= r["e2e"] and r["tpot"] == pytest.approx(sum(r["itl"]) / 3)
    # the means are those of the requests' own figures
    for key in ("ttft", "tpot", "e2e"):
        want = sum(stats[rid][key] for rid in rids) / 3
        assert m[f"mean_{key}_s"] == pytest.approx(want)


def test_forward_hook_reports_each_forward_and_changes_no_token(models):
    """`ModelRunner.forward_hook` (opt-in instrumentation): called once per model forward with its
    kind and wall seconds: a lone prefill, then prefill chunks beside decodes ("mixed"), then
    decodes; the tokens are those of an engine without the hook. Unset (the default), nothing
    is reported."""
    _, paged = models
    reqs = [([3 + i] * (10 + 30 * i), 3) for i in range(2)]

    def serve(hook) -> tuple[dict[int, list[int]], int]:
        eng = engine(paged, num_pages=60)
        assert eng.runner.forward_hook is None
        eng.runner.forward_hook = hook
        eng.add_request(reqs[0][0], SamplingParams(max_new_tokens=reqs[0][1], ignore_eos=True))
        eng.step()  # the first prompt alone
        eng.add_request(reqs[1][0], SamplingParams(max_new_tokens=reqs[1][1], ignore_eos=True))
        got = run(eng)
        return got, eng.metrics()["steps"]

    calls: list[tuple[str, float]] = []
    got, steps = serve(lambda kind, seconds: calls.append((kind, seconds)))
    assert [k for k, _ in calls] == ["prefill", "mixed", "decode", "decode"] and len(calls) == steps
    assert all(isinstance(s, float) and s > 0 for _, s in calls)
    assert got == serve(None)[0]


def test_generate_paged_runs_on_the_engine_and_equals_dense(models):
    """generate() for attn_impl="paged" is the engine (a pool sized by memory): mixed lengths,
    per-sequence EOS, streaming, seeded sampling all equal the dense static batch."""
    dense, paged = models
    prompts = [[5, 6, 7], list(range(10, 60)), [9]]
    assert generate(paged, prompts, 12, eos_id=None) == generate(dense, prompts, 12, eos_id=None)
    free = generate(dense, prompts, 10, eos_id=None)
    eos = free[1][3]
    assert generate(paged, prompts, 10, eos_id=eos) == generate(dense, prompts, 10, eos_id=eos)
    kw = dict(temperature=0.9, top_p=0.95, seed=5, eos_id=None)
    seen = []
    out = generate(paged, prompts, 10, on_token=lambda i, t: seen.append((i, t)), **kw)
    assert out == generate(dense, prompts, 10, **kw)
    assert [[t for j, t in seen if j == i] for i in range(3)] == out
    assert generate(paged, [prompts[1]], 10, **kw) == [out[1]]  # alone or in a batch


def test_generate_through_a_small_cache_queues_the_rest(models):
    """A backend with 2 rows serves 5 prompts: the engine queues what does not fit."""
    from fms_paged.kv.cache import PagedCache

    dense, paged = models
    prompts = [[3 + i] * (4 + 7 * i) for i in range(5)]
    cache = PagedCache(paged, 2, 128, num_pages=40, kernel=kernel_for(paged))
    assert generate(paged, prompts, 9, eos_id=None, cache=cache) == generate(dense, prompts, 9, eos_id=None)
    assert cache.pm.live_seqs == []


def test_generate_sizes_max_model_len_by_its_prompts(models, monkeypatch):
    """A long-context model whose full length does not fit the KV space: an Engine for the full
    length is refused, but generate() asks only for what its prompts need (rounded up to a power of
    two) and runs."""
    from fms_paged.kv.budget import CPU_KV_SPACE_ENV, KVBudgetError

    dense, paged = models
    cpu_only(paged, "the refusal comes from the CPU KV space ($FMS_PAGED_CPU_KV_SPACE)")
    long_ctx = get_model(variant="micro", device=paged.device, seed=0, attn_impl="paged",
                         max_expected_seq_len=131_072)
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "0.01")  # 1280 pages of 8 KiB: 20k tokens
    with pytest.raises(KVBudgetError, match="max_model_len=131072"):
        Engine(long_ctx, compile=False)
    prompts = [[5, 6, 7], list(range(10, 60))]
    assert generate(long_ctx, prompts, 8, eos_id=None) == generate(dense, prompts, 8, eos_id=None)


def test_random_submissions_and_aborts_never_leak_a_page(models):
    """Random arrivals, aborts (waiting or running requests) and preemptions: after every step the
    pages in use are exactly those of the running requests, each owned once, and at the end the
    pool is whole again. (Without the prefix cache, whose pages outlive their requests: the same
    with the cache on is checked in test_prefix_cache.py.)"""
    dense, paged = models
    rng = random.Random(7)
    eng = engine(paged, num_pages=26, max_num_seqs=6, max_num_batched_tokens=48,
                 enable_prefix_caching=False)
    live: list[int] = []
    done: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    reqs: dict[int, tuple[list[int], int]] = {}
    for step in range(300):
        if step < 200 and rng.random() < 0.4:
            prompt, n = random_prompt(rng, rng.randint(1, 70)), rng.randint(1, 30)
            rid = eng.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
            live.append(rid)
            reqs[rid] = (prompt, n)
        if live and rng.random() < 0.05:
            eng.abort(live.pop(rng.randrange(len(live))))
        for o in eng.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
                if o.request_id in live:
                    live.remove(o.request_id)
        pm, running = eng.pm, eng.scheduler.running
        pages = [p for r in running if r.seq_id is not None for p in pm.pages_of(r.seq_id)]
        assert len(pages) == len(set(pages)) == pm.num_pages - 1 - pm.num_free_pages
        assert sorted(pm.live_seqs) == sorted(r.seq_id for r in running if pm.length(r.seq_id))
    for o in eng.stream():
        done.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            reasons[o.request_id] = o.finish_reason
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1 and eng.metrics()["preemptions"] > 0
    finished = {rid for rid, r in reasons.items() if r == "length"}
    assert len(finished) > 40
    for rid in sorted(finished)[:15]:
        prompt, n = reqs[rid]
        assert done[rid] == generate(dense, [prompt], n, eos_id=None)[0]


def test_warmup_compiles_then_leaves_an_idle_engine(models):
    """warmup() runs synthetic requests through the compiled kernels, then forgets them: no stats,
    no pages held, no cached prefix; a real request then gives dense's tokens. Nothing to warm
    in eager steps of the cpp and gather kernels."""
    dense, paged = models
    assert engine(paged, kernel="gather").warmup() == 0.0
    if paged.device.type == "cpu":
        assert engine(paged, kernel="cpp").warmup() == 0.0
    eng = engine(paged, kernel="flex", max_num_seqs=3)
    assert eng.warmup(progress=False) > 0
    m = eng.metrics()
    assert m["steps"] == m["output_tokens"] == m["finished_requests"] == m["prompt_tokens_computed"] == 0
    assert m["finished_by_reason"] == {} and m["mean_ttft_s"] is None
    assert m["kv_pages_used"] == 0 and eng.pm.num_free_pages == eng.pm.num_pages - 1
    assert m["prefix_cache_pages"] == m["prefix_cache_queries"] == 0
    rid = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert run(eng)[rid] == generate(dense, [[5, 6, 7]], 6, eos_id=None)[0]
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.add_request([1, 2], SamplingParams(max_new_tokens=2))
        eng.warmup()


def test_compiled_steps_get_their_own_recompile_limit(monkeypatch):
    """Every builder of a compiled step compiles through `compile_shape_variants`, which allows the
    step more than Dynamo's default 8 shape variants (a process meets more: one per pool and
    bucket) without raising Dynamo's process-wide limits. The builders are cached, so their uncached
    bodies are called here, from Dynamo's defaults; torch.compile only records what it is asked."""
    import torch._dynamo

    from fms_paged.engine import model_step
    from fms_paged.kv.kernels import compiled_flex, flex

    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append((fn, kw)) or fn)
    for build in (lambda: model_step.compiled_decode.__wrapped__(True, True),
                  model_step.compiled_prefill.__wrapped__, lambda: compiled_flex.__wrapped__(False)):
        with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
            build()
            assert torch._dynamo.config.recompile_limit == 8  # the process's own, untouched
            assert torch._dynamo.config.accumulated_recompile_limit == 256
    assert len(asked) == 3
    if flex._PER_CALL_LIMIT:  # else each call is wrapped (tests/kv/test_torch_compat.py)
        assert [kw["recompile_limit"] for _, kw in asked] == [flex.RECOMPILE_LIMIT] * 3


@pytest.mark.parametrize("kernel", ["cpp", "flex"])
def test_warmup_covers_a_prefill_beside_every_decode_bucket(models, kernel, require_kernel):
    """compile=True: pure decode steps run the whole-step graph, a mixed step's decode rows (flex)
    the flex kernel alone. After warmup(), a request joining a lone decoding one (a prefill beside
    a 1-row decode batch, which the all-rows wave does not produce when the budget admits all its
    prompts at once) compiles no new graph (a first compile is not a recompile: graphs are
    counted)."""
    from torch._dynamo.utils import counters

    require_kernel(kernel)
    dense, paged = models
    eng = engine(paged, kernel=kernel, compile=True, max_num_seqs=3, max_num_batched_tokens=1024,
                 num_pages=64)
    assert eng.runner.buckets == ([2, 3] if kernel == "cpp" else [1, 3])
    eng.warmup(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    a = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    got: dict[int, list[int]] = {}
    for _ in range(2):
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    b = eng.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    for k, v in run(eng).items():
        got.setdefault(k, []).extend(v)
    assert counters["stats"]["unique_graphs"] == graphs
    assert got[a] == generate(dense, [[5, 6, 7]], 8, eos_id=None)[0]
    assert got[b] == generate(dense, [list(range(3, 60))], 4, eos_id=None)[0]


def test_cpp_decode_graphs_are_shared_by_pools_page_sizes_and_buckets(models):
    """The cpp kernel's compiled decode step takes the pool length, the page table's size, the page
    size and the batch (past 1) as dynamic, and its projections pick their CPU path when they run:
    after one engine's warmup() (buckets 2 and 4), engines with another pool and max_model_len,
    with decode buckets 8 and 16 (past the GEMV kernel's rows: another path of the projections),
    and on a twin of another page size compile no new graph, and their greedy tokens equal dense's."""
    from torch._dynamo.utils import counters

    from fms_paged.bench.latency import with_config
    from fms_paged.modules.linear import GEMV_MAX_ROWS, cpu_path

    dense, paged = models
    cpu_only(paged, "the cpp kernel's graphs and the CPU projections' paths")
    rng = random.Random(11)
    engine(paged, kernel="cpp", compile=True, max_num_seqs=4, num_pages=64).warmup(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    w = paged.layers[0].ff_sub_module.w2.weight.detach()
    x16, x4 = w.new_zeros(16, w.shape[1]), w.new_zeros(4, w.shape[1])
    assert cpu_path(x16, w) != cpu_path(x4, w) == "gemv" and GEMV_MAX_ROWS < 16
    for model, kw in ((paged, dict(max_num_seqs=16, num_pages=60, max_model_len=200)),
                      (with_config(paged, page_size=32), dict(max_num_seqs=4, num_pages=20))):
        eng = engine(model, kernel="cpp", compile=True, **kw)
        eng.warmup(progress=False)
        reqs = [(random_prompt(rng, rng.randint(1, 90)), rng.randint(2, 12)) for _ in range(6)]
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=k, ignore_eos=True)) for p, k in reqs]
        got = run(eng)
        for rid, (prompt, k) in zip(ids, reqs):
            assert got[rid] == generate(dense, [prompt], k, eos_id=None)[0]
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_lone_request_and_a_short_prefill_share_the_larger_graphs(models):
    """cpp kernel, max_num_seqs=1: a lone request decodes beside an inactive row (bucket 2, the
    graph of every batch past one row), and a prefill of a few tokens (the projections' GEMV path)
    runs the graph of longer ones: after warmup(), a 5-token prompt compiles no new graph, and its
    greedy tokens equal dense's."""
    from torch._dynamo.utils import counters

    from fms_paged.modules.linear import GEMV_MAX_ROWS

    dense, paged = models
    cpu_only(paged, "the cpp kernel's decode buckets and the CPU projections' GEMV path")
    eng = engine(paged, kernel="cpp", compile=True, max_num_seqs=1, num_pages=64)
    assert eng.runner.buckets == [2] and 5 <= GEMV_MAX_ROWS
    eng.warmup(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    rid = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True))
    got = run(eng)
    assert counters["stats"]["unique_graphs"] == graphs
    assert got[rid] == generate(dense, [[5, 6, 7, 8, 9]], 6, eos_id=None)[0]


@pytest.mark.parametrize("kernel", ["cpp", "flex"])
def test_compiled_prefill_equals_the_eager_forward_and_dense(models, kernel, require_kernel):
    """compile=True runs prefill and mixed steps through one graph with the token count dynamic,
    attention an opaque op (`fms_paged::step_attend`) that runs the step in effect. On the same
    steps its logits equal the eager forward's, below and above `PACK_MIN_ROWS` tokens (where
    `Linear` switches to its packed path: a graph each), a mixed step and a continuation chunk
    included; after warmup() a served run compiles nothing new and gives dense's tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fms_paged.engine.model_step import compiled_prefill, prefill_hidden
    from fms_paged.kv.cache import PagedCache
    from fms_paged.modules.linear import PACK_MIN_ROWS

    require_kernel(kernel)
    dense, paged = models
    dev = paged.device
    rng = random.Random(11)
    eng = engine(paged, kernel=kernel, compile=True, max_num_seqs=4, max_num_batched_tokens=512,
                 num_pages=120, max_model_len=600)
    assert eng.runner._prefill is compiled_prefill()
    b = PagedCache.on(eng.backend)  # static steps over the engine's pools

    def same_logits(tokens, positions, step, at):
        want = paged(tokens, positions, step, logits_at=at)  # eager; writes the step's K/V
        got = paged.logits(prefill_hidden(compiled_prefill(), paged, tokens, positions, step), at)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # same K/V written again
        return want

    long, short = random_prompt(rng, PACK_MIN_ROWS + 44), random_prompt(rng, 40)
    with torch.inference_mode():
        tokens, positions, step, last = b.prefill([1, 2], [long[:200], short], [0, 0])
        same_logits(tokens, positions, step, last)  # 240 tokens
        tokens, positions, step, last = b.prefill([1], [long[200:]], [200])  # continuation
        same_logits(tokens, positions, step, last)
        more = random_prompt(rng, 300)  # a prefill beside the decodes of seqs 1 and 2
        tokens, positions, step, last = b.mixed([1, 2], torch.tensor([5, 6], device=dev),
                                                [len(long), len(short)], [True, True], [3], [more], [0])
        assert tokens.shape[1] >= PACK_MIN_ROWS
        same_logits(tokens, positions, step, torch.cat([torch.arange(2, device=dev), last]))
    b.release([1, 2, 3])

    eng.warmup(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    reqs = [(random_prompt(rng, n), k) for n, k in ((450, 5), (30, 9), (300, 4), (3, 12), (120, 6))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=k, ignore_eos=True)) for p, k in reqs]
        got = run(eng)
    assert counters["stats"]["unique_graphs"] == graphs
    for rid, (prompt, k) in zip(ids, reqs):
        assert got[rid] == generate(dense, [prompt], k, eos_id=None)[0]


def fresh_interpreter(code: str) -> str:
    """The last line `code` prints, run by a fresh Python interpreter (nothing of this one's
    imports or loaded libraries); its stderr's end where it fails."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()[-1]


def test_an_eager_start_does_not_import_the_compiler():
    """A model loaded from a checkpoint (built on the meta device first) and from a variant, and an
    eager engine's steps, never import torch._dynamo (~1 s of a start: torch's meta normal_ and
    marking the pools' dims dynamic imported it); a compiled step marks the pools when it is made
    (`test_cpp_decode_graphs_are_shared_by_pools_page_sizes_and_buckets`). In a fresh interpreter:
    this one has imported it long ago."""
    code = (
        "import sys, torch\n"
        "from fms_paged import Engine, SamplingParams, get_model\n"
        "for model in (get_model(attn_impl='paged', dtype=torch.bfloat16),\n"
        "              get_model(variant='micro', attn_impl='paged')):\n"
        "    eng = Engine(model, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)\n"
        "    eng.add_request(list(range(3, 40)), SamplingParams(max_new_tokens=3, ignore_eos=True))\n"
        "    assert sum(len(o.new_token_ids) for _ in range(8) for o in eng.step()) == 3\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert fresh_interpreter(code) == "False"


def test_a_first_start_serves_by_torch_while_its_builds_compile(models):
    """While a first start's builds compile (`native.deferred`), an engine's steps run by torch's
    operations on one thread (the projections F.linear, the norms, attention by GATHER + SDPA, one
    token a step, torch's argmax) instead of waiting for the compilers, and once the builds are done
    its next steps take the operators and kernels (the one-call forward and lookahead steps): the
    fp32 tokens are dense generate()'s of each prompt alone. In a fresh interpreter (this one has
    loaded them), with the builds' end simulated mid-run."""
    if models[1].device.type != "cpu":
        pytest.skip("the CPU's operators and kernels")
    prompts, new = [list(range(3, 40)), list(range(50, 61))], 12
    code = (
        "import json, torch\n"
        "from fms_paged import Engine, SamplingParams, get_model, native\n"
        "building, seen = [True], []\n"
        "native.deferred = lambda: building[0]\n"
        "model = get_model(variant='micro', attn_impl='paged', page_size=16, seed=0)\n"
        "eng = Engine(model, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96, decode_steps=4)\n"
        "model.register_forward_pre_hook(lambda m, a: seen.append(\n"
        "    (building[0], torch.get_num_threads(), native.kernel_ready('gemv', torch.float32))))\n"
        f"params = SamplingParams(max_new_tokens={new}, ignore_eos=True)\n"
        f"ids = [eng.add_request(p, params) for p in {prompts}]\n"
        "out, one_call = {i: [] for i in ids}, []\n"
        "for o in eng.stream():\n"
        "    out[o.request_id] += o.new_token_ids\n"
        "    one_call.append(eng.runner.decodes_in_one_call())\n"
        "    building[0] = building[0] and sum(map(len, out.values())) < 6  # the builds end here\n"
        "print(json.dumps([[out[i] for i in ids], seen, one_call, torch.get_num_threads()]))\n"
    )
    tokens, seen, one_call, threads = json.loads(fresh_interpreter(code))
    during = [s for s in seen if s[0]]
    assert during and all(t == 1 and not gemv for _, t, gemv in during)  # torch's operations, one thread
    after = [s for s in seen if not s[0]]
    assert after and all(t == threads and gemv for _, t, gemv in after)
    assert not one_call[0] and one_call[-1]  # lookahead steps once the kernels are loaded
    assert tokens == [generate(models[0], [p], new, eos_id=None)[0] for p in prompts]
