"""The engine in half precision (bf16, fp16) on the CPU: the cpp kernel and the eager steps.

The model is the embedded default model (`get_model()` without a path) in the dtype under test,
with pages of 16 tokens so that small pools come under pressure. Engines keep their defaults for
the kernel ("auto": cpp) and compile ("auto": eager steps; a decode step of a few rows runs each
block as one operator, `fms_paged::decoder_layer`, which rounds where the modules round).

The reference of a request is the same request alone on a fresh engine in the same dtype. Why the
comparison is not plain token equality everywhere: a token's numbers depend on the path that
computed it, and the engine picks paths by the shape of each step, not by the request:

- projections: the GEMV kernel for calls of at most `GEMV_MAX_ROWS` rows (decode steps of a few
  rows, prefill steps of a few tokens), a GEMM for more (prefills, and decode rows that share a
  step with a prefill chunk): the GEMM kernel (`fms_paged.native.gemm.default_gemm`; in bf16
  the GEMV keeps calls under `GEMM_PANEL_MIN_ROWS` rows) or oneDNN's packed GEMM. All sum in fp32,
  in different orders;
- attention: a chunk of one token (a decode row) takes the cpp kernel's keys-in-lanes path, a
  longer chunk its rows-in-lanes path (after a preemption, output tokens first computed as decode
  rows are recomputed in a prefill chunk);

Within one path a row's result does not depend on the other rows of its step
(`test_same_paths_are_bit_identical_to_alone`). Between paths, fp32 results differ in their last
bits, which moves no greedy argmax in the fp32 tests. In bf16 and fp16 each result is rounded to
8 (11) bits, so those last bits flip the rounding of a few elements in 10^4 (bf16; fp16: 10^3)
by about an ulp of their scale; that propagates, and the logits, themselves bf16 (fp16) numbers,
differ by an ulp or two (log-probabilities by up to ~8 epsilons of the dtype here). Where the
two most likely tokens are that close (exact ties of bf16 logits are common), batching changes
the greedy token, and from there the continuation. So the batched engine is held to the
strongest property that holds (see `check_near_alone`): the same tokens, with log-probabilities
within `tol` (32 epsilons of the dtype), up to a first difference, if any, where the alone run's
choice was a near tie, for greedy and for seeded sampling (the sampler's draws replayed); and run
to run, the same batch is bit-identical.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.native import gemm
from tests.engine.test_prefix_cache import check_pool

pytestmark = pytest.mark.usefixtures("cpu_only")  # the cpp kernel and the CPU projections

P = 16  # tokens per page
MAX_LEN = 256
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
TOP_K = 5  # top_k of the sampled requests: their candidates are within the 20 log-probabilities returned


def tol(dtype: torch.dtype) -> float:
    """How far a token's log-probability may move between two paths (measured: up to ~8 epsilons)."""
    return 32 * torch.finfo(dtype).eps


@pytest.fixture(scope="module")
def model_of():
    """dtype -> the default model, paged (pages of 16), in that dtype; one per dtype, so that the
    engines of a dtype share its compiled graphs."""
    built: dict[torch.dtype, torch.nn.Module] = {}

    def get(dtype: torch.dtype) -> torch.nn.Module:
        if dtype not in built:
            built[dtype] = get_model(attn_impl="paged", dtype=dtype, device="cpu", page_size=P)
        return built[dtype]

    return get


def engine(model, **kw) -> Engine:
    """An engine with the default kernel and compile mode (on the CPU: cpp, eager)."""
    opts = dict(max_num_seqs=6, max_num_batched_tokens=64, num_pages=20, max_model_len=MAX_LEN)
    opts.update(kw)
    return Engine(model, **opts)


def serve(eng: Engine, reqs, after_step=None, first_step=None):
    """Submit (prompt, params) pairs, step to the end -> ({(id, completion): (tokens, logprobs)},
    {(id, completion): final stats}, the request ids in submission order). `after_step(eng)` runs
    after every step, `first_step(outputs)` on the first step's outputs."""
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    out: dict[tuple[int, int], tuple[list, list]] = {}
    stats: dict[tuple[int, int], dict] = {}
    while eng.has_unfinished():
        outs = eng.step()
        if first_step is not None and not out:
            first_step(outs)
        for o in outs:
            toks, lps = out.setdefault((o.request_id, o.index), ([], []))
            toks += o.new_token_ids
            lps += o.logprobs
            if o.finished:
                stats[(o.request_id, o.index)] = o.stats
        if after_step is not None:
            after_step(eng)
    return out, stats, ids


def alone(model, prompt, params, **kw):
    """The request alone on a fresh engine -> (tokens, logprobs)."""
    out, _, [rid] = serve(engine(model, **kw), [(prompt, params)])
    return out[(rid, 0)]


def exponential_draws(seed: int, steps: int, vocab: int) -> list[torch.Tensor]:
    """The Exp(1) draws of a seeded request's sampler, one [vocab] per token: torch.multinomial of
    one sample is an exponential race, argmax(p / q) with q.exponential_() drawn from the
    request's own generator (fp32, the shape of the probabilities)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(1, vocab).exponential_(1, generator=g)[0] for _ in range(steps)]


def race_scores(lp, params: SamplingParams, draw: torch.Tensor) -> tuple[dict[int, float], float]:
    """The race's score of each token of a step's returned log-probabilities, in log-probability
    units (T log p / T - T log q: a token's log-probability less T log q), and the top_k-th
    largest log-probability: the candidates are the tokens at or above it."""
    kth = lp.top[params.top_k - 1][1]
    assert lp.top[-1][1] < kth, "the candidates fill the returned log-probabilities: ask for more"
    return {t: v - params.temperature * math.log(draw[t].item()) for t, v in lp.top}, kth


def check_near_alone(want, got, params: SamplingParams, vocab: int, tol: float, what: str) -> bool:
    """`got` (tokens, logprobs of a completion served in a batch) against `want` (the same request
    alone): the same tokens with log-probabilities within `tol`, up to the first difference, if
    any, where the alone run's choice was a near tie that perturbations of `tol` can overturn:
    greedy, its token led the batch's by at most 2 `tol` in log-probability; seeded sampling, by
    at most 2 `tol` in the replayed race's score, or the batch's token was within 2 `tol` below
    the top_k cut (and then took part), or the alone run's token within 2 `tol` above it (and
    then dropped out). -> whether all the tokens are equal."""
    (w_toks, w_lps), (g_toks, g_lps) = want, got
    assert len(w_toks) == len(g_toks) == params.max_new_tokens, what
    draws = None
    if not params.greedy:  # the replay must reproduce the alone run, or its margins mean nothing
        draws = exponential_draws(params.seed, len(w_toks), vocab)
        for i, (tok, lp) in enumerate(zip(w_toks, w_lps)):
            scores, kth = race_scores(lp, params, draws[i])
            winner = max((t for t, v in lp.top if v >= kth), key=scores.get)
            assert winner == tok, f"{what}: the replayed draw {i} picks {winner}, the sampler {tok}"
    k = next((i for i, (a, b) in enumerate(zip(w_toks, g_toks)) if a != b), len(w_toks))
    for i in range(k):
        assert abs(w_lps[i].logprob - g_lps[i].logprob) <= tol, (
            f"{what}: token {i} ({w_toks[i]}) has log-probability {g_lps[i].logprob} in the batch, "
            f"{w_lps[i].logprob} alone")
    if k == len(w_toks):
        return True
    a, b = w_toks[k], g_toks[k]
    top = dict(w_lps[k].top)
    assert a in top and b in top, (
        f"{what}: token {k} is {b} in the batch, {a} alone: not both among the alone run's most "
        f"likely {w_lps[k].top}")
    scores = top
    if draws is not None:
        scores, kth = race_scores(w_lps[k], params, draws[k])
        assert top[b] >= kth - 2 * tol, f"{what}: token {k} is {b} in the batch, far below the top_k alone"
        if top[a] - max(v for v in top.values() if v < kth) <= 2 * tol:
            return False  # the alone run's token may have dropped out of the batch's top_k
    margin = scores[a] - scores[b]
    assert margin <= 2 * tol, (
        f"{what}: token {k} is {b} in the batch, {a} alone, which led by {margin:.4f} > 2 * tol "
        f"({'greedy' if draws is None else 'seeded race'}; alone: {w_lps[k].top[:3]}, "
        f"batch: {g_lps[k].top[:3]})")
    return False


def workload(rng: random.Random, vocab: int):
    """20 requests (28 completions): prompts that start with 2 or 3 whole pages of one of two
    prefixes, prompts longer than the engines' token budget (64), short ones, and n = 3 seeded
    sampling on a shared prefix; each asks for log-probabilities."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [tokens(3 * P) for _ in range(2)]
    greedy = dict(ignore_eos=True, logprobs=5)
    reqs = []
    for i in range(20):
        kind = i % 5
        if kind in (0, 4):
            prompt = rng.choice(prefixes)[: rng.choice([2 * P, 3 * P])] + tokens(rng.randint(1, 12))
            params = SamplingParams(max_new_tokens=rng.randint(8, 24), **greedy)
        elif kind == 1:
            prompt = tokens(rng.randint(100, 180))
            params = SamplingParams(max_new_tokens=rng.randint(4, 16), **greedy)
        elif kind == 2:
            prompt = rng.choice(prefixes)[: 2 * P] + tokens(rng.randint(1, 20))
            params = SamplingParams(n=3, max_new_tokens=rng.randint(8, 16), temperature=1.0,
                                    top_k=TOP_K, seed=100 + i, ignore_eos=True, logprobs=20)
        else:
            prompt = tokens(rng.randint(1, 60))
            params = SamplingParams(max_new_tokens=rng.randint(8, 30), **greedy)
        reqs.append((prompt, params))
    return reqs


@pytest.mark.parametrize("dtype", HALF)
def test_preemption_prefix_hits_chunks_and_forks_match_each_request_alone(model_of, dtype):
    """20 requests (28 completions) on a pool of 19 pages for 6 rows, the cpp kernel in the model's
    dtype: preemptions (asserted), prefix-cache hits across requests (asserted),
    prompts longer than the token budget (prefilled in chunks), n = 3 seeded sampling (FORK). Each
    completion is compared with its request alone on a fresh engine in the same dtype (completion
    i of an n = 3 request: the n = 1 request with seed + i) by `check_near_alone`: bit-identical
    tokens do not hold in half precision, because the engine's paths change with each step's shape
    (module docstring); the same tokens do, up to a near tie of the alone run, with
    log-probabilities within 32 epsilons of the dtype. At least 80% of the completions are
    identical throughout (here all 28 in both dtypes; with other workload seeds, 0 to 3 differ in
    bf16, none in fp16). The pool stays consistent after every step (`check_pool`), and the same
    batch on a second fresh engine is bit-identical to the first: tokens and log-probabilities."""
    model = model_of(dtype)
    vocab = model.config.src_vocab_size
    reqs = workload(random.Random(0), vocab)
    budget = 64
    assert sum(len(p) > budget for p, _ in reqs) >= 2  # prefilled in chunks over several steps
    eng = engine(model, max_num_batched_tokens=budget)
    assert eng.backend.kernel.name == "cpp" and not eng.runner.compiled
    got, stats, ids = serve(eng, reqs, after_step=check_pool)
    m = eng.metrics()
    assert m["preemptions"] > 0, "the pool never forced a preemption"
    assert m["prefix_cache_hits"] > 0 and m["finished_requests"] == len(got) == 28
    # a request never preempted got whole pages of another request's prompt from the cache
    assert any(s["cached_tokens"] >= 2 * P and s["preemptions"] == 0 for s in stats.values())
    assert m["kv_pages_used"] == 0 and m["running"] == m["waiting"] == 0

    equal = 0
    for rid, (prompt, params) in zip(ids, reqs):
        for i in range(params.n):
            sp = params.completion(i)
            equal += check_near_alone(alone(model, prompt, sp, max_num_batched_tokens=budget),
                                      got[(rid, i)], sp, vocab, tol(dtype), f"request {rid} completion {i}")
    assert equal >= 0.8 * len(got), f"only {equal} of {len(got)} completions equal their alone runs"

    again, _, ids_again = serve(engine(model, max_num_batched_tokens=budget), reqs)
    assert ids_again == ids and again == got  # tokens and log-probabilities, bit for bit


# with the GEMM kernel, bf16 calls of fewer rows than this stay on the GEMV kernel
# (`gemm.OWN_GEMV_MAX_ROWS`), which sums in another order (fp32 and fp16 leave the GEMV past
# GEMV_MAX_ROWS rows, and oneDNN's packed GEMM sums in one order at every row count)
GEMM_PANEL_MIN_ROWS = gemm.OWN_GEMV_MAX_ROWS[torch.bfloat16] + 1


@pytest.mark.parametrize("side", ["panels", "few rows"])
@pytest.mark.parametrize("dtype", HALF)
def test_same_paths_are_bit_identical_to_alone(model_of, dtype, side):
    """Where a batch takes the same paths as each of its requests alone, half precision is exact:
    requests with prompts longer than GEMV_MAX_ROWS tokens (so that alone too they prefill through
    a GEMM), all prefilled in the first step, then decoding at most GEMV_MAX_ROWS rows at a time
    (the GEMV kernel, as alone), no preemption, no cache hit: every request's tokens and
    log-probabilities (greedy and seeded sampling) equal its alone run's bit for bit. So a row's
    result does not depend on the other rows of its step; what moves it in the test above is a
    change of path (module docstring). With the GEMM kernel, bf16 has a boundary at
    GEMM_PANEL_MIN_ROWS rows: both sides are checked, "panels" (8 prompts of at least that many
    tokens: every prefill call through the GEMM, alone and batched) and "few rows" (3 prompts
    whose step stays under it: every call through the GEMV)."""
    from fms_paged.modules.linear import GEMV_MAX_ROWS

    model = model_of(dtype)
    vocab = model.config.src_vocab_size
    rng = random.Random(1)
    n, lengths = (GEMV_MAX_ROWS, (GEMM_PANEL_MIN_ROWS, 80)) if side == "panels" else \
        (3, (GEMV_MAX_ROWS + 1, (GEMM_PANEL_MIN_ROWS - 1) // 3))
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))],
             SamplingParams(max_new_tokens=rng.randint(8, 30), ignore_eos=True, logprobs=3,
                            **({} if i % 2 else dict(temperature=1.0, top_p=0.9, seed=i))))
            for i in range(n)]
    assert side == "panels" or sum(len(p) for p, _ in reqs) < GEMM_PANEL_MIN_ROWS
    kw = dict(max_num_seqs=GEMV_MAX_ROWS, max_num_batched_tokens=1024, num_pages=100)
    eng = engine(model, **kw)

    def all_prefilled(outs):
        assert len(outs) == len(reqs), "not every prompt was prefilled in the first step"

    got, _, ids = serve(eng, reqs, first_step=all_prefilled)
    m = eng.metrics()
    assert m["preemptions"] == 0 and m["prefix_cache_hits"] == 0
    for rid, (prompt, params) in zip(ids, reqs):
        assert got[(rid, 0)] == alone(model, prompt, params, **kw), f"request {rid}"


def test_zero_recompiles_over_500_bf16_engine_steps(model_of):
    """bf16, the cpp kernel's compiled steps (compile=True): after warmup() (decode buckets 2
    and 4: one graph, the batch dynamic past one row; prefill chunks of every length: one graph),
    500 steps with requests joining and leaving compile no new graph (Dynamo's count of graphs is
    unchanged) and recompile nothing (`error_on_recompile`: Dynamo would raise), as
    test_engine.py's test_zero_recompiles_over_500_engine_steps_compiled checks in fp32."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = model_of(torch.bfloat16)
    vocab = model.config.src_vocab_size
    rng = random.Random(3)
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, num_pages=160, max_model_len=160,
                 compile=True)
    assert eng.backend.kernel.name == "cpp" and eng.runner.compiled and eng.runner.buckets == [2, 4]
    wanted: dict[int, int] = {}

    def submit():
        n = rng.randint(2, 30)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        wanted[eng.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))] = n

    eng.warmup(progress=False)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(4):
        submit()
    got: dict[int, list[int]] = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(500):
            if rng.random() < 0.15:
                submit()
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert counters["stats"]["unique_graphs"] == graphs
    finished = [r for r in wanted if r not in eng._live]
    assert len(finished) > 30 and all(len(got[r]) == wanted[r] for r in finished)


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_engine_gets_the_cpp_kernel_and_pools_of_half_the_bytes(
        model_of, dtype, monkeypatch):
    """On the CPU a bf16 / fp16 model's engine gets the cpp kernel (eager steps) by default,
    and its K/V pools are in the model's dtype: half the bytes of the same pool in fp32; sized by
    the CPU KV space, pages of half the bytes make twice the pages (the remainder rounded down)."""
    from fms_paged.kv.budget import CPU_KV_SPACE_ENV
    from fms_paged.kv.kernels import choose_kernel

    half = model_of(dtype)
    fp32 = get_model(attn_impl="paged", device="cpu", page_size=P)  # the checkpoint's dtype
    assert half.dtype == dtype and fp32.dtype == torch.float32
    c = half.config
    assert choose_kernel("auto", torch.device("cpu"), P, head_dim=c.head_dim, dtype=dtype).name == "cpp"
    eng, ref = engine(half), engine(fp32)
    assert eng.backend.kernel.name == ref.backend.kernel.name == "cpp" and not eng.runner.compiled
    pools = eng.backend.k_pools + eng.backend.v_pools
    ref_pools = ref.backend.k_pools + ref.backend.v_pools
    assert len(pools) == 2 * c.nlayers and all(p.dtype == dtype for p in pools)
    assert [p.shape for p in pools] == [p.shape for p in ref_pools]
    assert 2 * eng.backend.kv_bytes == ref.backend.kv_bytes == sum(p.nbytes for p in ref_pools)
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "0.01")
    sized, ref_sized = engine(half, num_pages=None), engine(fp32, num_pages=None)
    assert 2 * sized.budget.page_bytes == ref_sized.budget.page_bytes
    assert sized.pm.num_pages == sized.budget.kv_bytes // sized.budget.page_bytes
    assert sized.pm.num_pages >= 2 * ref_sized.pm.num_pages
