"""Beam search (`SamplingParams(use_beam_search=True)`, fms_paged/engine/beam.py) against Hugging
Face `generate(num_beams=4, num_return_sequences=4, length_penalty=1.0, early_stopping=True,
do_sample=False)` on random-weight checkpoints of every family we load: the same four hypotheses,
best first, and the same cumulative log-probabilities; under preemption (a pool too small for the
beams and the requests beside them) and with prefix-cache hits too; HF's other stopping rules
and length penalties; the pool accounts for every page after every step (freed pages poisoned
with NaN) and every page comes back at the end, after an abort too.

The stop token of each case is one of greedy decoding's tokens on which transformers' hypotheses
finish early (the others at max_new_tokens): both ways a hypothesis ends are exercised.
"""

import pytest
import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.kv.paged import model_groups
from tests.conftest import HF_FAMILIES
from tests.engine.test_families import check_pool, kernel_for, poison_free

P, K, NEW = 16, 4, 8
# fp32 log-probabilities summed over <= NEW tokens: our paged kernels' logits agree with
# transformers' eager ones to ~1e-5 (fp32 round-off, tests/models), a sum of 8 differs by < 1e-4
ATOL = 1e-4


def hf_beams(hf, prompt: list[int], stop: int, new: int = NEW, length_penalty: float = 1.0,
             early_stopping: bool | str = True) -> list[tuple[list[int], float]]:
    """transformers' beam search: the K hypotheses (generated tokens, cumulative log-probability =
    sequences_scores * length ** length_penalty), best first."""
    out = hf.generate(torch.tensor([prompt]), num_beams=K, num_return_sequences=K,
                      length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                      max_new_tokens=new, eos_token_id=stop, pad_token_id=stop, output_scores=True,
                      return_dict_in_generate=True)
    lengths = (out.beam_indices != -1).sum(1).tolist()
    seqs = out.sequences[:, len(prompt):].tolist()
    return [(s[:n], float(score) * n**length_penalty)
            for s, n, score in zip(seqs, lengths, out.sequences_scores.tolist())]


def stop_and_reference(hf, prompt: list[int], new: int = NEW, tries: int = 4) -> tuple[int, list]:
    """A stop token on which some of transformers' hypotheses finish before `new` tokens (the
    first of greedy decoding's tokens 2.. that does, of `tries`; else the first tried), and
    transformers' beams with it."""
    greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=tries + 1, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    first = None
    for stop in greedy[1:]:
        ref = hf_beams(hf, prompt, stop, new)
        if any(len(t) < new for t, _ in ref):
            return stop, ref
        first = first or (stop, ref)
    return first


def beam_params(stop: int, new: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, n=K, use_beam_search=True, length_penalty=1.0,
                          early_stopping=True, stop_token_ids=(stop,), ignore_eos=True)


def run(eng: Engine, poison: bool = False) -> dict[int, list]:
    """Step `eng` to the end, checking the pool after every step -> request id -> its outputs by
    index."""
    got: dict[int, dict] = {}
    while eng.has_unfinished():
        for o in eng.step():  # (a beam search outputs once; others token by token)
            prev = got.setdefault(o.request_id, {}).get(o.index)
            if prev is not None:
                o.new_token_ids = prev.new_token_ids + o.new_token_ids
            got[o.request_id][o.index] = o
        check_pool(eng)
        if poison:
            poison_free(eng)
    return {rid: [outs[i] for i in sorted(outs)] for rid, outs in got.items()}


def assert_same(ours: list, ref: list[tuple[list[int], float]], stop: int) -> None:
    """Our outputs (best first) are transformers' hypotheses, with their cumulative log-probability
    (within ATOL) and the reason each ended."""
    assert [o.new_token_ids for o in ours] == [t for t, _ in ref]
    for o, (_, cum) in zip(ours, ref):
        assert o.finished and abs(o.cumulative_logprob - cum) <= ATOL, (o.cumulative_logprob, cum)
        assert o.finish_reason == ("stop" if o.new_token_ids[-1] == stop else "length")


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_beams_equal_transformers(family, hf_family, device):
    hf, path = hf_family(family)
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 256, (21,), generator=g).tolist()
    stop, ref = stop_and_reference(hf, prompt)
    assert any(len(t) < NEW for t, _ in ref)  # some hypothesis ends on the stop token
    eng = Engine(paged, max_num_seqs=K, max_num_batched_tokens=32, num_pages=24, max_model_len=64,
                 compile=False, kernel=kernel_for(device))
    rid = eng.add_request(prompt, beam_params(stop))
    got = run(eng, poison=True)
    assert_same(got[rid], ref, stop)
    eng.reset_prefix_cache()
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_beams_under_preemption_and_prefix_hits(family, hf_family, device):
    """A greedy request B and a beam search A whose prompt starts with B's first 32 tokens (two full
    pages: a prefix hit once B has computed them), in a pool too small for both: A, the newest, is
    preempted as a group and recomputed (its leader prefills the prompt, the other beams FORK it
    and recompute their own tokens). Then A again, alone, its prompt all in the prefix cache.
    A's hypotheses and B's tokens are transformers' every time; the pool accounts for every page
    after every step, freed pages poisoned with NaN; every page comes back. Llama (one page table),
    Qwen2 and Gemma 2 (pages per layer group, sliding groups releasing pages behind their window:
    FORK in each group). The pool: the fewest pages `add_request` accepts for A (its beams' pages
    at their longest, every tail private, in each layer slice), one more for the null page."""
    hf, path = hf_family(family)
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(5)
    b_prompt = torch.randint(3, 256, (60,), generator=g).tolist()
    a_prompt = b_prompt[:32] + torch.randint(3, 256, (9,), generator=g).tolist()
    new, stop = 20, 0  # (a stop token the beams hardly meet: they grow for all 20 steps, pressing the pool)
    ref = hf_beams(hf, a_prompt, stop, new)
    b_ref = hf.generate(torch.tensor([b_prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, 60:].tolist()
    num_pages = 11 * model_groups(paged).num_slices + 1
    eng = Engine(paged, max_num_seqs=K + 1, max_num_batched_tokens=32, num_pages=num_pages, max_model_len=96,
                 compile=False, kernel=kernel_for(device))
    params = beam_params(stop, new)
    b = eng.add_request(b_prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    eng.step()  # B's first 32 tokens: two full pages in the prefix cache
    a = eng.add_request(a_prompt, params)
    got = run(eng, poison=True)
    assert got[b][0].new_token_ids == b_ref
    assert_same(got[a], ref, stop)
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0, m
    # A again once a one-token request has put its prompt's full pages in the cache (the first A's
    # may have been evicted by its own last steps): its leader prefills the rest of the prompt only.
    # (Sliding layer groups have released the pages behind their window by then, so such a model
    # computes A whole: the hit above, on B's fresh pages, is its prefix hit.)
    eng.add_request(a_prompt, SamplingParams(max_new_tokens=1))
    run(eng)
    a2 = eng.add_request(a_prompt, params)
    got = run(eng, poison=True)
    assert_same(got[a2], ref, stop)
    hit = 0 if model_groups(paged).sliding else 32
    assert [o.stats["cached_tokens"] for o in got[a2]] == [hit] * K
    eng.reset_prefix_cache()
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1


@pytest.mark.parametrize("early_stopping, length_penalty", [(False, 1.0), ("never", 0.5), (True, 2.0)])
def test_early_stopping_rules_and_length_penalties(early_stopping, length_penalty, hf_family, device):
    """HF's other stopping rules (False: its heuristic on the current length; "never": on
    max_new_tokens with a positive penalty) and other penalties rank and stop as transformers
    does (Llama; the stop token of the parity test's kind). Cumulative log-probabilities are
    compared, and the score's penalty is applied by both in fp32, so ATOL holds."""
    hf, path = hf_family("llama")
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(11)).tolist()
    stop, _ = stop_and_reference(hf, prompt)
    ref = hf_beams(hf, prompt, stop, NEW, length_penalty, early_stopping)
    eng = Engine(paged, max_num_seqs=K, max_num_batched_tokens=32, num_pages=24, max_model_len=64,
                 compile=False, kernel=kernel_for(device))
    params = SamplingParams(max_new_tokens=NEW, n=K, use_beam_search=True, length_penalty=length_penalty,
                            early_stopping=early_stopping, stop_token_ids=(stop,), ignore_eos=True)
    rid = eng.add_request(prompt, params)
    assert_same(run(eng)[rid], ref, stop)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_ends_the_whole_search_and_returns_everything(models, steps):
    """Aborting one beam's index aborts the search (its k completions end "abort") whether it is
    waiting, prefilled (beams forked) or several steps in; the request beside it is unaffected,
    and every page and row comes back."""
    _, paged = models
    eng = Engine(paged, max_num_seqs=8, max_num_batched_tokens=64, num_pages=64, max_model_len=256,
                 compile=False)
    prompt = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # (40 tokens: 3 steps of up to 8 lookahead steps each do not end the search)
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=40, n=K, use_beam_search=True))
    other = eng.add_request(prompt[:20], SamplingParams(max_new_tokens=5))
    before = [o for _ in range(steps) for o in eng.step()]  # (the other may end in them)
    eng.abort(rid, 2)
    ends = {(o.request_id, o.index): o.finish_reason for o in [*before, *eng.stream()] if o.finished}
    assert ends == {**{(rid, i): "abort" for i in range(K)}, (other, 0): "length"}
    eng.reset_prefix_cache()
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1 and len(eng.scheduler.free_rows) == 8


@pytest.mark.parametrize("family, kv", [("llama", None), ("gemma3", None), ("llama", "int8")])
def test_lookahead_beam_steps_equal_transformers_and_one_token_steps(family, kv, hf_family):
    """Beam steps run several in one call (`fms_paged::decode_beams`: the engine's lookahead steps,
    rows moving between beams and pages copied inside the call, then `PageManager.retable`) give
    what one-token steps give: the same hypotheses in the same order, ending the same way, their
    cumulative log-probabilities within ATOL (the same operators on the same logits; but a step in
    which one engine also prefills the other request runs its rows through the GEMM kernel, not the
    GEMV, which rounds otherwise: an fp32 ulp or so), with two groups and a greedy request in one
    call (its tokens the same too), hypotheses ending on a stop token inside a call, pages filled
    inside calls going into the prefix cache, and the pool accounting for every page after every
    step (freed pages poisoned with NaN). Llama (one page table), Gemma 3 (sliding and full layer
    slices: tables per slice), 8-bit K/V (a page's scales copied with it). With 16/32-bit pages
    the calls' hypotheses are also transformers' beams (`assert_same`) and the greedy request's
    tokens its greedy tokens; 8-bit pages, which transformers does not have, are held to the
    one-token steps alone."""
    hf, path = hf_family(family)
    paged = get_model(model_path=path, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (21, 30)]
    got, calls, stop = [], [], None
    for steps in (1, 8):
        eng = Engine(paged, max_num_seqs=2 * K, max_num_batched_tokens=64, num_pages=64, max_model_len=96,
                     compile=False, kernel="cpp", decode_steps=steps, kv_cache_dtype=kv)
        spy, n = eng.runner.kernel.decode_beams, steps
        eng.runner.kernel.decode_beams = lambda *a, _spy=spy, _n=n, **kw: calls.append(_n) or _spy(*a, **kw)
        probe = eng.add_request(prompts[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
        # a stop token of a frequent kind: some hypotheses end on it before max_new_tokens
        stop = run(eng)[probe][0].new_token_ids[3] if stop is None else stop
        params = SamplingParams(max_new_tokens=20, n=K, use_beam_search=True, early_stopping=True,
                                stop_token_ids=(stop,), ignore_eos=True)
        rids = [eng.add_request(p, params) for p in prompts]
        other = eng.add_request(prompts[1][:17], SamplingParams(max_new_tokens=30, ignore_eos=True))
        outs = run(eng, poison=True)
        got.append([[(o.new_token_ids, o.finish_reason, o.cumulative_logprob) for o in outs[r]]
                    for r in rids] + [[(outs[other][0].new_token_ids, "greedy", 0.0)]])
        outs_ahead = [outs[r] for r in (*rids, other)]  # (the last engine's: lookahead steps)
        eng.reset_prefix_cache()
        assert eng.pm.num_free_pages == eng.pm.num_pages - 1
    assert 8 in calls and 1 not in calls  # the lookahead engine ran beam steps in calls, the other none
    one, ahead = got
    assert [[h[:2] for h in hyps] for hyps in one] == [[h[:2] for h in hyps] for hyps in ahead]
    for hyps, hyps_ahead in zip(one, ahead):
        for (*_, cum), (*_, cum_ahead) in zip(hyps, hyps_ahead):
            assert abs(cum - cum_ahead) <= ATOL, (cum, cum_ahead)
    assert any(why == "stop" for hyps in ahead for _, why, _ in hyps)
    if kv is None:
        for prompt, hyps in zip(prompts, outs_ahead[:2]):
            assert_same(hyps, hf_beams(hf, prompt, stop, 20), stop)
        greedy = hf.generate(torch.tensor([prompts[1][:17]]), max_new_tokens=30, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 17:].tolist()
        assert outs_ahead[2][0].new_token_ids == greedy
