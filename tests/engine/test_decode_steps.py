"""Lookahead decode steps (`Engine(decode_steps=k)`: up to k greedy decode steps in one forward,
`fms_paged::decode_greedy` on the cpp kernel) against dense `generate()` of each prompt alone (an
independent path: contiguous cache, SDPA, no pages, no scheduler) and against the engine's own
one-token steps: the same tokens and finish reasons, the tokens after a stop dropped, every page
back in the pool at the end."""

from __future__ import annotations

import inspect
import itertools
import random

import pytest
import torch

from fms_paged import Engine, SamplingParams, generate, get_model
from fms_paged.kv.cache import PagedCache
from tests.engine.test_engine import cpu_only, engine, random_prompt
from tests.engine.test_speculative import repeating_prompt


def lookahead_outputs(eng: Engine) -> tuple[dict[int, list[int]], dict[int, str], int]:
    """Step to the end -> each request's tokens, its finish reason, and how many outputs carried
    more than one token (lookahead steps that ran)."""
    got, reasons, multi = {}, {}, 0
    for out in eng.stream():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        multi += len(out.new_token_ids) > 1
        if out.finished:
            reasons[out.request_id] = out.finish_reason
    return got, reasons, multi


def test_lookahead_steps_equal_dense_alone_under_page_pressure(models):
    """40 greedy requests of 1..40 new tokens through 8 rows and 24 pages (preemptions), prefix
    caching on, 8 steps at a time once nothing waits: each request's tokens are dense generate()'s
    of its prompt alone; a seeded sampled request and one asking for log-probabilities (which keep
    their batches to one step) get the tokens they get with one-token steps."""
    dense, paged = models
    cpu_only(paged, "the cpp kernel's one-call steps")
    rng = random.Random(3)
    reqs = [(random_prompt(rng, rng.randint(1, 70)), rng.randint(1, 40)) for _ in range(40)]
    special = [SamplingParams(max_new_tokens=30, temperature=0.8, seed=5, ignore_eos=True),
               SamplingParams(max_new_tokens=20, logprobs=2, ignore_eos=True)]
    results = []
    for steps in (1, 8):
        eng = engine(paged, decode_steps=steps)
        ids = [eng.add_request(reqs[i][0], sp) for i, sp in enumerate(special)]  # (first: done early)
        ids += [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]
        got, reasons, multi = lookahead_outputs(eng)
        m = eng.metrics()
        assert m["kv_pages_used"] == 0 and m["running"] == m["waiting"] == 0  # every page came back
        results.append(([got[i] for i in ids], [reasons[i] for i in ids], multi, m["preemptions"]))
    (one, one_reasons, one_multi, _), (eight, eight_reasons, multi, preemptions) = results
    assert one_multi == 0 and multi > 0 and preemptions > 0
    assert eight == one and eight_reasons == one_reasons == ["length"] * len(eight)
    for toks, (prompt, n) in zip(eight[len(special):], reqs):
        assert toks == generate(dense, [prompt], n, eos_id=None)[0]


def test_auto_steps_fit_the_lookahead_budget(models, monkeypatch):
    """decode_steps="auto" (the default): a micro model's decode step takes ~1 ms, so lookahead
    steps run (outputs of several tokens) and give dense generate()'s tokens; with the budget below
    any step's time, every output carries one token; the steps chosen stay within 1 to
    AUTO_DECODE_STEPS."""
    import fms_paged.engine.engine as engine_module

    dense, paged = models
    cpu_only(paged, "the cpp kernel's one-call steps")
    rng = random.Random(4)
    reqs = [(random_prompt(rng, rng.randint(1, 30)), 40) for _ in range(3)]
    want = [generate(dense, [p], n, eos_id=None)[0] for p, n in reqs]
    for budget, lookahead in ((engine_module.LOOKAHEAD_BUDGET_S, True), (1e-7, False)):
        monkeypatch.setattr(engine_module, "LOOKAHEAD_BUDGET_S", budget)
        eng = engine(paged, max_num_seqs=4, decode_steps="auto")  # (the default; the helper sets 1)
        assert inspect.signature(Engine).parameters["decode_steps"].default == eng.decode_steps == "auto"
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]
        got, _, multi = lookahead_outputs(eng)
        assert [got[i] for i in ids] == want
        assert (multi > 0) == lookahead, (budget, multi)
        steps = eng.scheduler.decode_steps
        assert 1 <= steps <= engine_module.AUTO_DECODE_STEPS and (steps > 1) == lookahead


def test_lookahead_steps_stop_where_one_token_steps_stop(models):
    """A stop token, the end of max_new_tokens and the model's EOS inside a lookahead of 8 steps:
    each request ends at the same token with the same reason as dense generate() gives, and the
    tokens the lookahead computed past it are dropped."""
    dense, paged = models
    cpu_only(paged, "the cpp kernel's one-call steps")
    prompt = [5, 6, 7, 8]
    free = generate(dense, [prompt], 20, eos_id=None)[0]
    stop = free[5]
    eng = engine(paged, decode_steps=8)
    a = eng.add_request(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=[stop]))
    b = eng.add_request(prompt, SamplingParams(max_new_tokens=11, ignore_eos=True))
    got, reasons, multi = lookahead_outputs(eng)
    assert multi > 0
    assert got[a] == free[: free.index(stop) + 1] and reasons[a] == "stop"
    assert got[b] == free[:11] and reasons[b] == "length"
    model_eos = get_model(variant="micro", device=paged.device, seed=0, attn_impl="paged", page_size=16,
                          eos_token_id=free[3])
    eng = engine(model_eos, decode_steps=8)
    c = eng.add_request(prompt, SamplingParams(max_new_tokens=20))
    got, reasons, _ = lookahead_outputs(eng)
    assert got[c] == free[:4] and reasons[c] == "stop" and eng.metrics()["kv_pages_used"] == 0


def test_a_model_without_one_call_steps_decodes_a_token_a_step(models):
    """decode_steps on a model whose forward is not one call (`linear_impl="torch"`: no packed
    projections, so no stack ends): the engine plans no lookahead (it had RESERVEd pages for steps
    the model then ran as one, and the next step's RESERVE refused to shrink the sequence) and
    gives dense generate()'s tokens, every page back in the pool."""
    dense, paged = models
    prompt = [5, 6, 7, 8]
    free = generate(dense, [prompt], 12, eos_id=None)[0]
    model = get_model(variant="micro", device=paged.device, seed=0, attn_impl="paged", page_size=16,
                      linear_impl="torch")
    eng = engine(model, decode_steps=4)
    a = eng.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    got, reasons, multi = lookahead_outputs(eng)
    assert got[a] == free and reasons[a] == "length" and multi == 0
    assert eng.metrics()["kv_pages_used"] == 0


@pytest.mark.parametrize("value", [0, 1.5, True, "2"])
def test_bad_decode_steps_name_the_value(models, value):
    _, paged = models
    with pytest.raises(ValueError, match=rf"decode_steps={value!r}; expected an int >= 1"):
        engine(paged, decode_steps=value)


def test_decode_greedy_refuses_positions_without_pages(models):
    """The operator writes only slots the page table gives a row for every step's position: a row
    whose later steps fall on pages not RESERVEd, or a sequence outside the table, is a ValueError
    before anything is written."""
    _, paged = models
    cpu_only(paged, "the cpp kernel")
    cache = PagedCache(paged, 2, 64, kernel="cpp")
    with torch.inference_mode():
        tokens, positions, step, _ = cache.prefill([0], [[5, 6, 7]])
        paged(tokens, positions, step)  # loads the operators; sequence 0 holds one page (16 slots)
        before = [p.clone() for p in cache.k_pools]
        view, one, kernel = cache.backend.view, torch.tensor([9]), cache.backend.kernel

        def call(pos, seq=0, steps=4):
            return kernel.decode_greedy(paged, one, torch.tensor([pos]), torch.tensor([seq]), view, steps)

        with pytest.raises(ValueError, match=r"row 0: sequence 0 holds no pages for positions 14\.\.17 .* "
                                             r"RESERVE them first"):
            call(14)
        with pytest.raises(ValueError, match=r"row 0: sequence 5 holds no pages"):
            call(3, seq=5)
        with pytest.raises(ValueError, match=r"steps=0, page_size=16; expected both >= 1"):
            call(3, steps=0)
        # bit for bit: the pool is uninitialised (torch.empty) outside the pages written, and stale
        # bytes may read as NaN, which torch.equal never calls equal
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(cache.k_pools, before))
        assert call(3).shape == (1, 4)


def test_decode_lookup_gives_greedy_tokens_for_every_cap(models):
    """`fms_paged::decode_lookup` (prompt lookup proposed and verified inside the lookahead call):
    two rows' tokens equal dense generate()'s of each prompt alone for every cap on proposals and
    every limit on a step's rows; proposals are kept and rejected; a row proposes at most its cap a
    step, a step takes at most its row limit (or its unfinished rows), and a row that may not
    propose runs the steps of `decode_greedy` (one row a step, nothing proposed)."""
    dense, paged = models
    cpu_only(paged, "the cpp kernel")
    rng = random.Random(5)
    prompts = [repeating_prompt(rng, 40), repeating_prompt(rng, 23)]
    steps = 12
    want = [generate(dense, [p], steps, eos_id=None)[0] for p in prompts]
    cache = PagedCache(paged, 2, 64, kernel="cpp")
    with torch.inference_mode():
        # the prompts but their last tokens computed; those tokens are the rows' inputs
        tokens, positions, step, _ = cache.prefill([0, 1], [p[:-1] for p in prompts])
        paged(tokens, positions, step)
        cache.backend.prepare_pages(cache.pm.reserve([0, 1], [len(p) - 1 + steps for p in prompts]))
        view, kernel = cache.backend.view, cache.backend.kernel
        last = torch.tensor([p[-1] for p in prompts])
        pos, seqs = torch.tensor([len(p) - 1 for p in prompts]), torch.tensor([0, 1])
        history = torch.tensor(prompts[0] + prompts[1])
        offsets = torch.tensor([0, len(prompts[0]), len(prompts[0]) + len(prompts[1])])

        def call(caps, max_rows, hist=history):
            return kernel.decode_lookup(paged, last, pos, seqs, view, steps, hist, offsets,
                                        torch.tensor(caps), 3, 1, max_rows)

        kept = rejected = 0
        for caps, max_rows in [((0, 0), 8), ((1, 1), 8), ((4, 2), 8), ((7, 7), 8), ((7, 7), 3), ((0, 5), 8)]:
            toks, stats, times = call(caps, max_rows)
            assert toks.tolist() == want, (caps, max_rows)
            for b in range(2):  # verifying steps, proposed, kept, rejecting steps
                v, proposed, a, rej = stats[b].tolist()
                assert proposed <= caps[b] * v and a <= proposed and rej <= v
                kept, rejected = kept + a, rejected + proposed - a
            rows, total = times[:, 0], times[:, 1]
            assert (total <= torch.clamp(rows, min=max_rows)).all() and (times[:, 2] > 0).all()
            assert int(total.sum()) == steps * 2 + int(stats[:, 1].sum()) - int(stats[:, 2].sum())
            if caps == (0, 0):  # decode_greedy's steps
                assert stats.sum() == 0 and len(times) == steps and (total == rows).all()
        assert kept > 0 and rejected > 0
        bad = history.clone()
        bad[len(prompts[0]) - 1] += 1
        with pytest.raises(ValueError, match=r"row 0's history \[0, 40\) of 63 tokens must end with its "
                                             r"last token"):
            call((1, 1), 8, bad)
        with pytest.raises(ValueError, match=r"n_max=1, n_min=3, max_rows=8; expected 1 <= n_min <= n_max"):
            kernel.decode_lookup(paged, last, pos, seqs, view, steps, history, offsets, torch.tensor([1, 1]),
                                 1, 3, 8)


def test_a_short_chunk_computes_what_decoding_its_tokens_one_by_one_does():
    """In bf16, on the cpp kernel's one-call forward: the logits of a chunk of 2..8 tokens (a
    speculative verify's: its last token and the proposals) equal, bit for bit, those of decode
    steps of the same tokens one at a time (the GEMV sums a row in the same order whatever rows its
    call has, and a chunk of at most 8 tokens takes the attention kernel's decode path token by
    token); so decode_lookup with up to 7 proposals a step gives decode_greedy's tokens exactly.
    A random micro model whose bf16 logits any difference in rounding would move."""
    paged = get_model(variant="micro", seed=1, attn_impl="paged", page_size=16, dtype=torch.bfloat16)
    rng = random.Random(8)
    prompts = [repeating_prompt(rng, 50), repeating_prompt(rng, 31), repeating_prompt(rng, 9)]
    steps, B = 24, len(prompts)
    with torch.inference_mode():
        for n in (2, 5, 8):
            extra = [rng.randrange(3, 256) for _ in range(n)]
            got = []
            for by_one in (False, True):
                cache = PagedCache(paged, 1, 96, kernel="cpp")
                tokens, positions, step, _ = cache.prefill([0], [prompts[0]])
                paged(tokens, positions, step)
                if by_one:
                    rows = []
                    for i, t in enumerate(extra):
                        at = len(prompts[0]) + i
                        tokens, positions, step = cache.decode([0], torch.tensor([t]), [at], [True])
                        rows.append(paged(tokens, positions, step).view(1, -1))
                    got.append(torch.cat(rows))
                else:
                    tokens, positions, step, _ = cache.prefill([0], [extra], [len(prompts[0])])
                    got.append(paged(tokens, positions, step).view(n, -1))
            assert torch.equal(got[0], got[1]), n
        cache = PagedCache(paged, B, 96, kernel="cpp")
        tokens, positions, step, _ = cache.prefill(list(range(B)), [p[:-1] for p in prompts])
        paged(tokens, positions, step)
        cache.backend.prepare_pages(cache.pm.reserve(list(range(B)), [len(p) - 1 + steps for p in prompts]))
        view, kernel = cache.backend.view, cache.backend.kernel
        last, seqs = torch.tensor([p[-1] for p in prompts]), torch.arange(B)
        pos = torch.tensor([len(p) - 1 for p in prompts])
        want = kernel.decode_greedy(paged, last, pos, seqs, view, steps)
        history = torch.tensor([t for p in prompts for t in p])
        offsets = torch.tensor([0, *itertools.accumulate(len(p) for p in prompts)])
        got, stats, _ = kernel.decode_lookup(paged, last, pos, seqs, view, steps, history, offsets,
                                             torch.tensor([7] * B), 3, 1, 16)
    assert stats[:, 2].sum() > 0 and (stats[:, 1] > stats[:, 2]).any()  # proposals kept and rejected
    assert torch.equal(got, want)
