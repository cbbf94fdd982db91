"""Log-probabilities (`SamplingParams.logprobs`) against the dense model.

Reference: the dense model (`attn_impl="sdpa"`, contiguous cache, no pages, no scheduler) on the
same weights, run teacher-forced over prompt + the engine's output in one forward; the fp32
`log_softmax` of its logits at each sampled position is what the engine must report (raw
log-probabilities: before temperature, top-k, top-p). Tolerance `TOL = 1e-4` absolute: the paged
and dense logits of these fp32 models agree to 1e-5 (tests/kv/test_paged_vs_dense.py); a
log-softmax moves an error in the logits by at most twice that (the logit itself and the
log-sum-exp), plus fp32 rounding of values of size ~6 (log 256), ~1e-6.
"""

from __future__ import annotations

import random

import pytest
import torch

from fms_paged import Engine, SamplingParams
from fms_paged.engine.request import TokenLogprobs

TOL = 1e-4


def engine(paged, **kw) -> Engine:
    opts = dict(max_num_seqs=6, max_num_batched_tokens=32, num_pages=40, compile=False,
                max_model_len=256, kernel="cpp" if paged.device.type == "cpu" else "flex")
    opts.update(kw)
    return Engine(paged, **opts)


def collect(eng: Engine) -> dict[tuple[int, int], tuple[list[int], list | None]]:
    """Step to the end -> (tokens, logprobs or None) of each (request, completion)."""
    got: dict[tuple[int, int], tuple[list[int], list | None]] = {}
    for out in eng.stream():
        toks, lps = got.setdefault((out.request_id, out.index), ([], None if out.logprobs is None else []))
        assert (lps is None) == (out.logprobs is None)
        toks += out.new_token_ids
        if lps is not None:
            assert len(out.logprobs) == len(out.new_token_ids)  # aligned with the tokens
            lps += out.logprobs
    return got


@torch.no_grad()
def dense_logprobs(dense, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The dense model teacher-forced over prompt + output -> fp32 log-softmax at the position
    that sampled each output token: [len(output), V] (on the CPU)."""
    ids = torch.tensor([prompt + output[:-1]], device=dense.device)
    logits = dense(ids)[0, len(prompt) - 1 :]  # [len(output), V]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def check(lps: list[TokenLogprobs], tokens: list[int], ref: torch.Tensor, k: int) -> None:
    for j, (lp, tok) in enumerate(zip(lps, tokens)):
        assert isinstance(lp, TokenLogprobs) and len(lp.top) == k
        assert lp.logprob == pytest.approx(ref[j, tok].item(), abs=TOL), j
        want = torch.topk(ref[j], k).values.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want, abs=TOL), j
        assert all(v == pytest.approx(ref[j, t].item(), abs=TOL) for t, v in lp.top), j
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and len({t for t, _ in lp.top}) == k


def test_logprobs_equal_the_dense_log_softmax(models):
    """A batch mixing requests that ask (k = 5, k = 0, k = 20, greedy and sampled, a prompt chunked
    over several steps) and requests that do not, under page pressure (preemptions): each token's
    log-probability and top-k equal the dense model's log-softmax at its position."""
    dense, paged = models
    rng = random.Random(0)
    cases = [  # (prompt length, SamplingParams)
        (7, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=5)),
        (70, SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=5)),  # chunked prefill
        (16, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=0)),
        (33, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=20)),
        # sampled at temperature 0.6, top-k 20: raw log-probabilities differ from those it draws from
        (20, SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.6, top_k=20, seed=3,
                            logprobs=3)),
        (25, SamplingParams(max_new_tokens=10, ignore_eos=True)),  # asks for none
        (40, SamplingParams(max_new_tokens=30, ignore_eos=True)),
    ]
    eng = engine(paged, num_pages=10, max_model_len=128)
    prompts = {}
    for n, sp in cases:
        p = [rng.randrange(3, 256) for _ in range(n)]
        prompts[eng.add_request(p, sp)] = (p, sp)
    got = collect(eng)
    assert eng.metrics()["preemptions"] > 0, "the pool never forced a preemption"
    for rid, (prompt, sp) in prompts.items():
        tokens, lps = got[(rid, 0)]
        assert len(tokens) == sp.max_new_tokens
        if sp.logprobs is None:
            assert lps is None
            continue
        ref = dense_logprobs(dense, prompt, tokens)
        check(lps, tokens, ref, sp.logprobs)
        if sp.greedy and sp.logprobs > 0:  # the argmax, whose log-probability is the top one
            assert all(t == lp.top[0][0] and lp.logprob == lp.top[0][1] for t, lp in zip(tokens, lps))
        if sp.logprobs == 0:
            assert all(lp.top == () for lp in lps)


def test_logprobs_of_n_completions_read_their_parents_row(models):
    """n = 3 sampled completions, forked after one prefill (the first token of each is sampled
    from the parent's logits row): each completion's log-probabilities are those of its own
    tokens."""
    dense, paged = models
    prompt = list(range(3, 40))
    eng = engine(paged)
    rid = eng.add_request(prompt, SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=7,
                                                 ignore_eos=True, logprobs=2))
    got = collect(eng)
    assert sorted(got) == [(rid, i) for i in range(3)]
    firsts = set()
    for i in range(3):
        tokens, lps = got[(rid, i)]
        check(lps, tokens, dense_logprobs(dense, prompt, tokens), 2)
        firsts.add((tokens[0], lps[0].logprob))
        assert lps[0].top == got[(rid, 0)][1][0].top  # the same row: the same distribution
    assert len({t for t, _ in firsts}) > 1, "the seeds drew the same first token: pick others"


def test_abort_output_has_empty_logprobs(models):
    _, paged = models
    eng = engine(paged)
    a = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True, logprobs=1))
    b = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort(a)
    eng.abort(b)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[a].finish_reason == "abort" and outs[a].logprobs == [] and outs[b].logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "3"])
def test_bad_logprobs_name_the_value(value):
    with pytest.raises(ValueError, match=rf"SamplingParams.logprobs={value!r}; expected an int in \[0, 20\]"):
        SamplingParams(logprobs=value)


def test_logprobs_add_no_host_sync(models, no_host_sync):
    """Asking for log-probabilities adds device work (a log-softmax, a top-k) but no read-back: the
    tokens and log-probabilities come back together, in the step's one transfer (as
    test_engine.py's test_decode_step_has_no_host_sync, with the GATHER kernel)."""
    _, paged = models
    eng = engine(paged, num_pages=60, kernel="gather")
    for n, k in ((5, 3), (17, None), (30, 0)):
        eng.add_request(list(range(3, 3 + n)), SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                              logprobs=k))
    eng.step()  # prefill
    with no_host_sync():
        for _ in range(10):
            outs = eng.step()
            assert [o.logprobs is None for o in outs] == [False, True, False]


@torch.no_grad()
def dense_prompt_logprobs(dense, prompt: list[int]) -> torch.Tensor:
    """fp32 log-softmax of the dense model over the prompt: row i predicts prompt token i + 1."""
    logits = dense(torch.tensor([prompt], device=dense.device))[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@pytest.mark.parametrize("budget", [256, 16], ids=["whole-prefill", "chunked-prefill"])
def test_prompt_logprobs_equal_the_dense_log_softmax(models, budget):
    """`prompt_logprobs=k`: each prompt token's log-probability and top k, from the forward that
    prefills it (in chunks of 16 tokens too), equal the dense model's log-softmax at the position
    before it; the first token gets None. Requests sharing a prompt prefix hit the prefix cache,
    and a request scoring its prompt computes it whole all the same (cached pages carry no logits);
    under preemption (a recompute: the chunked case) each token is scored once. max_new_tokens=0 scores and
    generates nothing (an evaluation harness's log-likelihood request)."""
    dense, paged = models
    rng = random.Random(1)
    shared = [rng.randrange(3, 256) for _ in range(48)]  # three pages of 16
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (20, 7, 33, 1)]
    eng = engine(paged, max_num_batched_tokens=budget, num_pages=9, max_model_len=128)
    warm = eng.add_request(shared + [9, 9], SamplingParams(max_new_tokens=2, ignore_eos=True))
    while eng.has_unfinished():  # its full pages are cached now
        eng.step()
    cases = [SamplingParams(max_new_tokens=0, prompt_logprobs=5),
             SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=2),
             SamplingParams(max_new_tokens=40, ignore_eos=True),  # hits the cache, asks for none
             SamplingParams(max_new_tokens=30, ignore_eos=True, prompt_logprobs=20)]
    rids = {eng.add_request(p, sp): (p, sp) for p, sp in zip(prompts, cases)}
    firsts: dict[int, list] = {}
    ends: dict[int, object] = {}
    for out in eng.stream():
        if out.prompt_logprobs is not None:
            assert out.request_id not in firsts, "prompt log-probabilities delivered twice"
            firsts[out.request_id] = out.prompt_logprobs
        if out.finished:
            ends[out.request_id] = out
    assert warm not in firsts and eng.metrics()["prefix_cache_hits"] > 0
    if budget == 16:  # (chunks admit requests before their pages are all there)
        assert eng.metrics()["preemptions"] > 0, "the pool never forced a preemption"
    for rid, (prompt, sp) in rids.items():
        if sp.prompt_logprobs is None:
            assert rid not in firsts
            continue
        lps = firsts[rid]
        assert len(lps) == len(prompt) and lps[0] is None
        ref = dense_prompt_logprobs(dense, prompt)
        check(lps[1:], prompt[1:], ref, sp.prompt_logprobs)
        ranks = [int((ref[j] > ref[j, t]).sum()) + 1 for j, t in enumerate(prompt[1:])]
        assert [lp.rank for lp in lps[1:]] == ranks
    scored_only = next(r for r, (_, sp) in rids.items() if sp.max_new_tokens == 0)
    assert ends[scored_only].new_token_ids == [] and ends[scored_only].finish_reason == "length"


def test_bad_prompt_logprobs_and_scoring_without_tokens_name_the_value():
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs=21; expected an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="SamplingParams.max_new_tokens=0.*prompt_logprobs"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="SamplingParams.max_new_tokens=0.*n=1"):
        SamplingParams(max_new_tokens=0, prompt_logprobs=1, n=2)
