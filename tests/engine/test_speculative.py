"""Speculative decoding by prompt lookup (`Engine(speculative={"method": "ngram", ...})`).

References, all independent of the engine's speculative path:
- greedy: dense `generate()` of each prompt alone (contiguous cache, SDPA, no pages, no scheduler)
  gives the tokens, exactly; on every family we load, under preemption, chunked prefill, prefix
  hits, stop tokens, EOS and max_new_tokens inside a proposal;
- sampled: the exact distribution of the generated tokens, computed from the dense model's
  probabilities (float64 sums over every history); a chi-square test bounds the distance;
- the n-gram lookup: a brute-force scan;
- the page pool: every page free, held by a running request or by the prefix cache, after every
  step (`check_pool`), with freed pages poisoned with NaN (`poison_free`) and outputs unchanged.
Prompts repeat short token runs so that proposals exist; each greedy test asserts that proposals
were accepted and rejected.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from fms_paged import Engine, SamplingParams, generate, get_model
from fms_paged.engine.draft import DraftModelError
from fms_paged.engine.request import Request
from fms_paged.engine.speculative import (
    BLOCK,
    EXPLORE,
    PRIOR_VERIFY_COST,
    NgramIndex,
    SpeculativeConfig,
    SpeculativeConfigError,
    Speculator,
    StepCost,
    ngram_propose,
    proposal_length,
)
from fms_paged.kv.page_manager import PageManager
from fms_paged.kv.paged import model_groups
from tests.conftest import HF_FAMILIES, make_hf_family
from tests.engine.test_engine import engine
from tests.engine.test_families import check_pool, kernel_for, poison_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repeating_prompt(rng: random.Random, n: int, vocab: int = 256) -> list[int]:
    """n tokens made of a short random run repeated (with an edit now and then): prompt lookup
    finds n-grams in it, and the model's continuation sometimes follows them."""
    run = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
    out = []
    while len(out) < n:
        out += run
        if rng.random() < 0.3:
            out[-1] = rng.randrange(3, vocab)
    return out[:n]


def step_all(eng: Engine, pool_check=None) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Step to the end, checking the pool after every step where asked -> tokens and finish reasons."""
    got, reasons = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if pool_check is not None:
            pool_check(eng)
    return got, reasons


def accepted_and_rejected(eng: Engine) -> None:
    m = eng.metrics()
    assert m["spec_accepted_tokens"] > 0, m  # some proposals were kept ...
    assert m["spec_proposed_tokens"] > m["spec_accepted_tokens"], m  # ... and some rejected


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("spec, match", [
    ("ngram", "expected a dict"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "model=3"),
    ({"method": "draft_model", "num_speculative_tokens": 0, "model": "x"}, "num_speculative_tokens=0"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "prompt_lookup_max": 2},
     "apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "applies to method 'draft_model'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 3},
     "min=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, "prompt_lookup_max=2.5"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown key"),
])
def test_bad_settings_raise_typed_errors(spec, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeConfig.parse(spec)


def test_lookup_defaults_follow_vllm():
    """One of prompt_lookup_max / _min sets both; neither: 5."""
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)


def test_engine_refuses_a_bad_setting(models):
    _, paged = models
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens=-1"):
        engine(paged, speculative={"method": "ngram", "num_speculative_tokens": -1})


# ------------------------------------------------------------------ the lookup
def brute_force_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= L:
            continue
        tail = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):  # the last earlier occurrence that a token follows
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_lookup_equals_brute_force():
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        toks = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        want = brute_force_lookup(toks, k, hi, lo)
        assert ngram_propose(toks, k, hi, lo) == want, (toks, k, hi, lo)
        hits += bool(want)
    assert 300 < hits < 2900  # both outcomes were exercised
    # the engine's incremental index: the same proposals as the sequence grows by 1..3 tokens
    # between calls (a verify step appends several)
    for _ in range(200):
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        req = Request(0, [rng.randrange(3) for _ in range(rng.randint(1, 6))], SamplingParams(), frozenset())
        index = NgramIndex(hi, lo)
        while req.num_tokens < 40:
            assert index.propose(req, k) == brute_force_lookup(req.prompt + req.output, k, hi, lo)
            req.output += [rng.randrange(3) for _ in range(rng.randint(1, 3))]
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 3, 1) == [7, 1, 2]  # the last match


# ------------------------------------------------------------------ how many to propose
def test_proposal_length_maximizes_tokens_per_cost():
    """Hand-computed cases of E(k) / (fixed + per_row * k), E(k) = 1 + a + ... + a^k: a = 0.75 at
    (1, 0.25): k = 1..4 give 1.400, 1.542, 1.563, 1.525 -> 3; a = 0.9 at (1, 0.01): rising up to
    k_max; a verify as dear as two decode steps never pays at a = 0.5 (E < 2); nothing is kept
    at a = 0; k never passes k_max."""
    assert proposal_length(0.75, (1.0, 0.25), 8) == 3
    assert proposal_length(0.9, (1.0, 0.01), 8) == 8
    assert proposal_length(0.9, (1.0, 0.01), 5) == 5
    assert proposal_length(0.5, (2.0, 0.0), 8) == 0
    assert proposal_length(0.0, (1.0, 0.0), 8) == 0
    assert proposal_length(0.2, PRIOR_VERIFY_COST, 8) == 0  # (1.2 / 1.4 < 1)
    # costs per k (a bf16 GEMV: extra rows all but free up to 3, then dear): a = 0.75 gives
    # E(k) = 1.75, 2.31, 2.73, 3.05 over 1.0, 1.0, 1.1, 2.0 -> 1.75, 2.31, 2.48, 1.53 -> 3
    assert proposal_length(0.75, [1.0, 1.0, 1.0, 1.1, 2.0], 4) == 3
    assert proposal_length(0.75, [1.0, 1.0, 1.0, 1.1, 2.0], 2) == 2


def test_step_cost_fits_verify_steps_against_plain_ones():
    """Plain decode steps of 1 row at 1.0 s, verify steps on the line 1.0 + 0.25 * rows: a verify
    of k proposals beside 1 decode row costs 1.25 + 0.25 k decode steps. A row count's first
    timing is replaced by a lower second one (a first step's one-time cost), later ones are
    averaged."""
    cost = StepCost()
    assert cost.verify_cost(1) is None
    for _ in range(2):
        cost.observe(False, 1, 1.0)
        cost.observe(True, 2, 1.5)
    assert cost.verify_cost(1) is None  # one verify row count: no line yet
    cost.observe(True, 6, 10.0)  # a first step of 6 rows paying a one-time cost ...
    cost.observe(True, 6, 2.5)  # ... and its next
    cost.observe(True, 4, 2.0)
    fixed, per_row = cost.verify_cost(1)
    assert fixed == pytest.approx(1.25) and per_row == pytest.approx(0.25)
    assert cost.verify_cost(3) is None  # no plain step of 3 rows timed
    # per k: the timed row counts' own means (2 rows: 1.5; 4: 2.0; 6: 2.5), the line between
    # them (3 rows: 1.75, 5: 2.25)
    assert cost.verify_costs(1, 5) == pytest.approx([1.0, 1.5, 1.75, 2.0, 2.25, 2.5])
    assert cost.verify_costs(3, 2) is None


def test_speculation_takes_the_faster_of_inside_calls_and_between_steps():
    """Blocks of BLOCK choices: inside lookahead calls first, then between steps, then the mode of
    fewer seconds per token, the other every EXPLORE-th block; a block's first step is not
    measured (it catches up on the other mode's tokens). Here between steps costs 1 s a token and
    inside calls 3 s (a first step of each block reports 100 s, ignored)."""
    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    modes = []
    for _ in range(2 * EXPLORE):
        for i in range(BLOCK):
            mode = spec.in_call_now()
            modes.append(mode)
            spec.rate(mode, 100.0 if i == 0 else 3.0 if mode else 1.0, 1)
    blocks = [modes[b * BLOCK] for b in range(2 * EXPLORE)]
    assert all(modes[b * BLOCK : (b + 1) * BLOCK] == [m] * BLOCK for b, m in enumerate(blocks))
    # blocks 1 and 2 try each mode; then between steps, but inside calls every EXPLORE-th block
    assert blocks == [True, False] + [(b + 1) % EXPLORE == 0 for b in range(2, 2 * EXPLORE)]
    assert spec._rate == {True: pytest.approx(3.0), False: pytest.approx(1.0)}
    draft = Speculator(SpeculativeConfig("draft_model", 2, model="unused"))
    assert not draft.in_call_now()  # a draft proposes between steps


def test_rejected_proposals_switch_speculation_off(models):
    """Sampled text (temperature 1.5, seeded) after a repeating prompt, with 1-grams looked up:
    nearly every step finds a proposal, and nearly every proposal is rejected (its chance is the
    target's probability of that token). A request whose proposals do not pay backs off, probing
    with one proposal after 1, 2, 4, ... 64 plain steps: fewer than 1 verify per 5 tokens over 200
    tokens (each step would verify without it), and the pool is whole at the end."""
    _, paged = models
    eng = engine(paged, speculative=NGRAM)
    rid = eng.add_request([5, 6, 7, 8] * 8, SamplingParams(max_new_tokens=200, temperature=1.5, seed=3,
                                                           ignore_eos=True))
    got, _ = step_all(eng, check_pool)
    m = eng.metrics()
    assert len(got[rid]) == 200 and m["kv_pages_used"] == 0
    assert 0 < m["spec_verifies"] < 40 and m["spec_acceptance_rate"] < 0.3, m


# ------------------------------------------------------------------ the page manager's rollback
def test_truncate_gives_back_wholly_unused_pages():
    """Rejected proposals' slots: pages wholly past the new length go back (a shared one only
    loses this sequence's reference), a partial last page stays; bad lengths raise, changing
    nothing."""
    pm = PageManager(num_pages=12, page_size=4, max_seqs=3)
    pm.reserve([0, 1], [5, 3])
    pm.fork(0, 2)  # seq 2 shares seq 0's two pages
    a, b = pm.pages_of(0)
    assert pm.num_free_pages == 8
    pm.reserve([0], [14])  # a private copy of the shared partial page b, then two more pages
    _, b2, c, d = pm.pages_of(0)
    assert pm.num_free_pages == 5
    assert sorted(pm.truncate([0], [6])) == sorted([c, d])
    assert pm.length(0) == 6 and pm.pages_of(0) == [a, b2] and pm.num_free_pages == 7
    assert pm.truncate([0, 1], [6, 3]) == [] and pm.num_free_pages == 7  # nothing past the lengths
    assert pm.truncate([2], [1]) == [b] and pm.num_free_pages == 8  # b: seq 2's alone since the copy
    assert pm.pages_of(2) == [a] and pm.refcount(a) == 2  # still shared with seq 0
    with pytest.raises(ValueError, match="length 9 for seq 1 out of range"):
        pm.truncate([1], [9])
    assert pm.length(1) == 3
    pm.erase([1])
    with pytest.raises(ValueError, match="not live"):
        pm.truncate([1], [0])
    pm.erase([0, 2])
    assert pm.num_free_pages == pm.num_pages - 1


# ------------------------------------------------------------------ greedy: dense generate's tokens
@pytest.mark.parametrize("steps", [1, 8])
def test_greedy_equals_dense_under_preemption_chunks_and_prefix_hits(steps, models):
    """20 greedy requests (prompts of 1..90 tokens sharing a 32-token prefix, in chunks of a
    48-token budget) through 6 rows and a pool small enough to preempt: each request's tokens are
    dense generate()'s of its prompt alone; the pool accounts for every page after every step,
    with its free pages poisoned with NaN. With lookahead steps (decode_steps=8, the cpp kernel's
    one-call steps) proposals are verified inside the calls once nothing waits, between steps
    before."""
    dense, paged = models
    rng = random.Random(1)
    prefix = repeating_prompt(rng, 32)
    reqs = [((prefix if i % 3 == 0 else []) + repeating_prompt(rng, rng.randint(1, 58)), rng.randint(1, 30))
            for i in range(20)]
    eng = engine(paged, max_num_seqs=6, max_num_batched_tokens=48, num_pages=18, speculative=NGRAM,
                 decode_steps=steps)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]

    def pool(e):
        assert sum(e.pm.length(r.seq_id) == r.num_computed for r in e.scheduler.running) == len(
            e.scheduler.running)  # every rejected slot rolled back
        check_pool(e)
        poison_free(e)

    got, reasons = step_all(eng, pool)
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0 and m["kv_pages_used"] == 0
    accepted_and_rejected(eng)
    in_call = m["spec_verifies_in_call"]
    assert (0 < in_call < m["spec_verifies"]) if steps > 1 and paged.device.type == "cpu" else in_call == 0
    for i, (p, n) in zip(ids, reqs):
        assert got[i] == generate(dense, [p], n, eos_id=None)[0], i
        assert reasons[i] == "length"


@pytest.mark.parametrize("method, steps", [("ngram", 1), ("ngram", 8), ("draft_model", 1)])
def test_stops_eos_and_length_inside_a_proposal(method, steps, models):
    """A stop token, max_new_tokens and the model's EOS met inside an accepted run of proposals:
    each request ends at the token and with the reason dense generate() gives, the later tokens
    dropped (draft_model: the target as its own draft, every proposal accepted; steps 8: lookahead
    calls, which verify prompt lookup's proposals inside the call, once nothing waits)."""
    dense, paged = models

    def spec(model):
        return NGRAM if method == "ngram" else draft_spec(model, 4)

    rng = random.Random(4)
    prompt = repeating_prompt(rng, 40)
    free = generate(dense, [prompt], 40, eos_id=None)[0]
    eng = engine(paged, speculative=spec(paged), decode_steps=steps)
    runs = {}
    for n in range(2, 12):  # every cut of max_new_tokens and every stop token among the first
        rid = eng.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
        runs[rid] = (free[:n], "length")
        stop = free[n]
        runs[eng.add_request(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[stop]))] = (
            free[: free.index(stop) + 1], "stop")
    got, reasons = step_all(eng, check_pool)
    assert eng.metrics()["spec_accepted_tokens"] > 0
    for rid, (toks, reason) in runs.items():
        assert got[rid] == toks and reasons[rid] == reason, rid
    model_eos = get_model(variant="micro", device=paged.device, seed=0, attn_impl="paged", page_size=16,
                          eos_token_id=free[7])
    eng = engine(model_eos, speculative=spec(model_eos), decode_steps=steps)
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=40))
    got, reasons = step_all(eng, check_pool)
    assert got[rid] == free[: free.index(free[7]) + 1] and reasons[rid] == "stop"
    m = eng.metrics()
    in_call = steps > 1 and paged.device.type == "cpu"
    assert m["kv_pages_used"] == 0 and (m["spec_verifies_in_call"] > 0) == in_call


def family_run(family: str, hf_family, device, speculative, pages: int = 9, decode_steps: int | str = "auto"):
    """A family's checkpoint served three rows at a time, four prompts (three sharing a 32-token
    prefix: prefix hits) in chunks of a 32-token budget, through a pool of `pages` pages of every
    layer (a layer slice's pages for their KV bytes: small enough to preempt) -> (the engine with
    the requests added, their ids, each prompt's 24 greedy tokens by dense generate() alone)."""
    _, path = hf_family(family)
    dense = get_model(model_path=path, device=device, page_size=16)
    paged = get_model(model_path=path, device=device, page_size=16, attn_impl="paged")
    rng = random.Random(7)
    prefix = repeating_prompt(rng, 32)
    prompts = [prefix + repeating_prompt(rng, n) for n in (30, 8, 20)] + [repeating_prompt(rng, 50)]
    alone = [generate(dense, [p], 24, eos_id=None)[0] for p in prompts]
    per_layers = paged.config.nlayers // model_groups(paged).layers_per_slice
    eng = Engine(paged, max_num_seqs=3, max_num_batched_tokens=32, num_pages=pages * per_layers,
                 max_model_len=128, compile=False, kernel=kernel_for(device), speculative=speculative,
                 decode_steps=decode_steps)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
    return eng, ids, alone


@pytest.mark.parametrize("steps", [1, 8])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_every_family_gets_its_greedy_tokens(family, steps, hf_family, device):
    """Every family (sliding-window layer groups included: a window's release and a rollback on
    the same request), under preemption, chunked prefill and prefix hits: dense generate()'s
    tokens, the pool exact after every step with its free pages poisoned; verified between steps
    (decode_steps=1) and, once nothing waits, inside lookahead calls (8, on the CPU)."""
    # (6 pages of every layer where every layer is windowed and holds less)
    eng, ids, alone = family_run(family, hf_family, device, NGRAM, 6 if family == "mistral" else 9, steps)

    def pool(e):
        check_pool(e)
        poison_free(e)

    got, _ = step_all(eng, pool)
    assert [got[i] for i in ids] == alone
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0 and m["kv_pages_used"] == 0
    accepted_and_rejected(eng)
    assert (m["spec_verifies_in_call"] > 0) == (steps > 1 and device.type == "cpu")


def test_mixed_batches_with_logprobs_and_sampled_rows(models):
    """Speculating greedy requests beside requests that do not speculate (log-probabilities: the
    one-token path; a prompt still prefilling): the greedy tokens are dense generate()'s, the
    log-probability request gets the tokens and values it gets with speculation off."""
    dense, paged = models
    rng = random.Random(9)
    prompts = [repeating_prompt(rng, n) for n in (20, 70, 33)]
    outs = []
    for spec in (None, NGRAM):
        eng = engine(paged, max_num_batched_tokens=32, speculative=spec)
        a = eng.add_request(prompts[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
        b = eng.add_request(prompts[2], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2))
        first = eng.step()
        c = eng.add_request(prompts[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
        lps = []
        got = {}
        for out in first + list(eng.stream()):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == b:
                lps += [x.logprob for x in out.logprobs]
        outs.append((got[a], got[b], got[c], lps))
        if spec is not None:
            assert eng.metrics()["spec_verifies"] > 0
    assert outs[0][:3] == outs[1][:3]
    assert outs[0][0] == generate(dense, [prompts[0]], 20, eos_id=None)[0]
    assert outs[0][2] == generate(dense, [prompts[1]], 20, eos_id=None)[0]
    np.testing.assert_allclose(outs[0][3], outs[1][3], rtol=0, atol=1e-5)  # fp32 round-off of other batches


# ------------------------------------------------------------------ sampled: the target distribution
def exact_pair_distribution(dense, prompt: list[int], temperature: float) -> np.ndarray:
    """[V, V]: the probability that the 2nd and 3rd sampled tokens are (a, b), summed over the
    first, from the dense model's float64 probabilities."""
    V = dense.config.src_vocab_size

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = dense(torch.tensor(seqs))[:, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    p1 = probs([prompt])[0]  # [V]
    p2 = probs([prompt + [a] for a in range(V)])  # [V(t1), V(t2)]
    p3 = probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    return joint.sum(0).numpy()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_target_distribution(method, device):
    """1,200 seeded requests at temperature 0.5 on a micro model with 6 tokens (so that the
    proposals, tokens of the prompt, are often likely and rejection happens too), compared with
    the exact distribution of the (2nd, 3rd) token pair (36 cells; both come through verification:
    accepted proposals, the residual after a rejection, and the target's token after the last):
    Pearson's chi-square stays under its 0.999 quantile (35 degrees of freedom), for speculative
    and, as the control, non-speculative sampling. Seeded: the test is deterministic. (Its power:
    sampling from p instead of p without the rejected token after a rejection gave 78 > 66.6.)
    draft_model: the same bound with a one-layer draft's greedy proposals."""
    V = 6
    dense = get_model(variant="micro", device=device, seed=2, src_vocab_size=V).double()  # the same weights
    paged = get_model(variant="micro", device=device, seed=2, src_vocab_size=V, attn_impl="paged",
                      page_size=16)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 0, 1, 2]
    expected = exact_pair_distribution(dense, prompt, 0.5).reshape(-1) * 1200
    bound = chi2.ppf(0.999, V * V - 1)
    specs = (None, NGRAM)
    if method == "draft_model":  # a one-layer random draft of the same 6 tokens: its greedy
        # proposals (a point mass q, as prompt lookup's) are often right and often wrong
        specs = (draft_spec(get_model(variant="micro", device=device, seed=3, src_vocab_size=V,
                                      attn_impl="paged", page_size=16, nlayers=1), 2),)
    for spec in specs:
        eng = engine(paged, max_num_seqs=64, max_num_batched_tokens=512, num_pages=160, speculative=spec)
        sp = [SamplingParams(max_new_tokens=3, temperature=0.5, seed=s, ignore_eos=True) for s in range(1200)]
        ids = [eng.add_request(prompt, p) for p in sp]
        got, _ = step_all(eng)
        counts = np.zeros(V * V)
        for i in ids:
            counts[got[i][1] * V + got[i][2]] += 1
        stat = float(((counts - expected) ** 2 / expected).sum())
        assert stat < bound, (spec, stat, bound)
        if spec is not None:
            m = eng.metrics()
            assert m["spec_verifies"] >= 1200 and 0 < m["spec_accepted_tokens"] < m["spec_proposed_tokens"], m


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_is_reproducible(method, models):
    """A seeded sampled request gets the same tokens run twice, alone or beside other requests
    (with a draft: the target itself, whose proposals are often accepted under sampling too)."""
    _, paged = models
    spec = NGRAM if method == "ngram" else draft_spec(paged)
    rng = random.Random(11)
    prompt = repeating_prompt(rng, 30)
    others = [repeating_prompt(rng, 25) for _ in range(3)]
    sp = SamplingParams(max_new_tokens=30, temperature=0.7, seed=123, ignore_eos=True)
    runs = []
    for company in ([], others, others):
        eng = engine(paged, speculative=spec)
        rid = eng.add_request(prompt, sp)
        for p in company:
            eng.add_request(p, SamplingParams(max_new_tokens=20, temperature=0.9, ignore_eos=True))
        got, _ = step_all(eng)
        runs.append(got[rid])
        assert eng.metrics()["spec_verifies"] > 0
    assert runs[0] == runs[1] == runs[2]


def test_metrics_report_acceptance(models):
    _, paged = models
    eng = engine(paged, speculative=NGRAM)
    assert eng.metrics()["spec_acceptance_rate"] is None
    prompt = repeating_prompt(random.Random(5), 40)
    eng.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    step_all(eng)
    m = eng.metrics()
    assert m["spec_acceptance_rate"] == m["spec_accepted_tokens"] / m["spec_proposed_tokens"]
    assert m["spec_mean_accepted_length"] == m["spec_accepted_tokens"] / m["spec_verifies"]
    assert m["spec_mean_tokens_per_verify"] == pytest.approx(1 + m["spec_mean_accepted_length"], rel=1e-12)
    eng.forget_totals()
    assert eng.metrics()["spec_verifies"] == 0


# ------------------------------------------------------------------ method "draft_model"
def draft_spec(model, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def check_draft_pool(eng: Engine) -> None:
    """The draft's own pool: every page free or held once by the draft row of a running request
    (every page of its length, in every layer slice); rows only for running requests."""
    d = eng.speculator.draft
    running = {id(r) for r in eng.scheduler.running}
    assert all(id(r) in running for r in d._rows.keys())
    P, slices = d.pm.page_size, d.backend.groups.num_slices
    held = []
    for state in d._rows.values():
        for g in range(slices):
            pages = d.pm.pages_of(state.row, g) if slices > 1 else d.pm.pages_of(state.row)
            assert len(pages) == -(-d.pm.length(state.row) // P) and 0 not in pages
            held += pages
    assert len(set(held)) == len(held) and len(held) + d.pm.num_free_pages == d.pm.num_pages - 1


def all_pools(eng: Engine) -> None:
    check_pool(eng)
    check_draft_pool(eng)
    poison_free(eng)


def all_returned(eng: Engine) -> None:
    d = eng.speculator.draft
    assert eng.metrics()["kv_pages_used"] == 0
    assert not d._rows and d.pm.num_free_pages == d.pm.num_pages - 1 and not d.pm.live_seqs


def test_draft_config_errors(models):
    """A draft of another vocabulary, a dense draft, tensor parallelism: typed errors."""
    _, paged = models
    other = get_model(variant="micro", device=paged.device, seed=1, attn_impl="paged", page_size=16,
                      src_vocab_size=128)
    with pytest.raises(DraftModelError, match="vocabulary size 128 differs from the target's 256"):
        engine(paged, speculative=draft_spec(other))
    dense = get_model(variant="micro", device=paged.device, seed=1)
    with pytest.raises(DraftModelError, match="attn_impl='sdpa'"):
        engine(paged, speculative=draft_spec(dense))
    with pytest.raises(SpeculativeConfigError, match="tensor parallelism"):
        engine(paged, speculative=draft_spec(paged), tensor_parallel_size=2)


@pytest.mark.parametrize("kernel", ["default", "gather"])
def test_draft_equal_to_target_accepts_every_proposal(kernel, models):
    """The target as its own draft, under preemption, chunked prefill and prefix hits: every
    proposal is accepted (acceptance rate exactly 1.0: the draft's pages, rollback and catch-up
    give it the target's logits at every step), tokens are dense generate()'s, both pools exact
    after every step and wholly returned at the end. Both ways the draft proposes: one
    `decode_greedy` call of k steps (the cpp kernel, on the CPU) and one forward per proposal
    (the fallback: the gather kernel)."""
    dense, paged = models
    rng = random.Random(2)
    prefix = repeating_prompt(rng, 32)
    reqs = [((prefix if i % 3 == 0 else []) + repeating_prompt(rng, rng.randint(1, 40)), rng.randint(8, 40))
            for i in range(12)]
    eng = engine(paged, max_num_seqs=4, max_num_batched_tokens=48, num_pages=10, max_model_len=128,
                 speculative=draft_spec(paged), **({} if kernel == "default" else {"kernel": kernel}))
    if paged.device.type == "cpu":
        assert eng.speculator.draft.one_call() == (kernel == "default")
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in reqs]
    got, _ = step_all(eng, all_pools)
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert m["spec_proposed_tokens"] > 50 and m["spec_acceptance_rate"] == 1.0, m
    all_returned(eng)
    for i, (p, n) in zip(ids, reqs):
        assert got[i] == generate(dense, [p], n, eos_id=None)[0], i


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_a_smaller_draft_keeps_every_family_greedy(family, hf_family, device, tmp_path):
    """A one-layer random draft of the family (another seed, the same vocabulary) proposing for
    the three-layer target, under preemption, chunked prefill and prefix hits: dense generate()'s
    tokens exactly, proposals rejected, both pools exact after every step and wholly returned."""
    make_hf_family(family, seed=1, num_hidden_layers=1).save_pretrained(tmp_path, safe_serialization=True)
    # (a path: get_model loads the draft paged)
    eng, ids, alone = family_run(family, hf_family, device, draft_spec(str(tmp_path)))
    got, _ = step_all(eng, all_pools)
    assert [got[i] for i in ids] == alone
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0 and m["spec_verifies"] > 0
    assert m["spec_proposed_tokens"] > m["spec_accepted_tokens"]
    all_returned(eng)
