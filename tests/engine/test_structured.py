"""Structured outputs in the engine (`SamplingParams.grammar`, xgrammar's bitmasks on the logits):
the output of every completion matches its grammar through sampling, n > 1 (each completion its own
matcher), preemption (recomputed tokens are not fed to the matcher again) and prefix hits; a
request without a grammar in the same batch gets the tokens it gets alone; a grammar xgrammar
refuses, or an engine without the tokenizer, is a ValueError and queues nothing.

The default model and its tokenizer (the grammar is compiled against a real vocabulary, byte
tokens included); its weights are a toy's trained on Python, so a valid output is the grammar's."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from fms_paged import Engine, SamplingParams, generate, get_model, load_tokenizer
from fms_paged.engine.structured import Grammar, Grammars
from fms_paged.models import default_model_path

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

SCHEMA = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                           "v": {"type": "integer"}}, "required": ["k", "v"]}
REGEX = r"(0|[1-9][0-9]{0,3})(,(0|[1-9][0-9]{0,3})){2}"
PROMPT = 'd = {"name": "ok", "size": 3}\nf = {"name": "no", "size": 4}\ne = '  # a page of 16 and more


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def models():
    return get_model(), get_model(attn_impl="paged", page_size=16)


def text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != tok.eos_id])


def run(eng: Engine) -> dict[tuple[int, int], tuple[list[int], str]]:
    got: dict[tuple[int, int], tuple[list[int], str]] = {}
    for out in eng.stream():
        toks, _ = got.get((out.request_id, out.index), ([], None))
        got[(out.request_id, out.index)] = (toks + out.new_token_ids, out.finish_reason)
    return got


def test_every_completion_matches_its_grammar_under_preemption_forks_and_prefix_hits(models, tok):
    dense, paged = models
    eng = Engine(paged, max_num_seqs=6, max_num_batched_tokens=64, num_pages=12, max_model_len=160,
                 compile=False, tokenizer=tok)
    prompt = tok.encode(PROMPT)
    cases = {}
    for seed in range(6):
        sp = SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed,
                            grammar=Grammar.json_schema(SCHEMA))
        cases[eng.add_request(prompt, sp)] = "json"
    cases[eng.add_request(prompt, SamplingParams(max_new_tokens=40, temperature=0.8, seed=9, n=3,
                                                 grammar=Grammar("regex", REGEX)))] = "regex"
    free = eng.add_request(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))  # no grammar
    got = run(eng)
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0
    for (rid, index), (ids, reason) in got.items():
        if rid == free:
            assert ids == generate(dense, [prompt], 60, eos_id=None)[0]  # the masks are its neighbours'
            continue
        assert reason == "stop" and ids[-1] == tok.eos_id, (rid, index, text(tok, ids))
        out = text(tok, ids)
        if cases[rid] == "json":
            jsonschema.validate(json.loads(out), SCHEMA)
        else:
            assert re.fullmatch(REGEX, out), out
    assert len({index for rid, index in got if cases.get(rid) == "regex"}) == 3


def test_bad_grammars_and_a_missing_tokenizer_queue_nothing(models, tok):
    _, paged = models
    eng = Engine(paged, max_num_seqs=2, num_pages=32, max_model_len=256, compile=False, tokenizer=tok)
    for g, words in ((Grammar("regex", "[a-"), "regex"), (Grammar("ebnf", "root ::= nothing"), "ebnf"),
                     (Grammar("xml", "<a/>"), "kind 'xml'"), (Grammar("choice", "[]"), "choice")):
        with pytest.raises(ValueError, match=re.escape(words)):
            eng.add_request([1, 2, 3], SamplingParams(grammar=g))
    assert not eng.has_unfinished()
    bare = Engine(paged, max_num_seqs=2, num_pages=32, max_model_len=256, compile=False)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.add_request([1, 2, 3], SamplingParams(grammar=Grammar("json_object")))
    assert not bare.has_unfinished()
    with pytest.raises(ValueError, match="SamplingParams.grammar"):
        SamplingParams(grammar={"type": "json_object"})


@pytest.mark.parametrize("vocab, rows", [(4096, None), (32000, [0, 2, 5]), (1000, [3]), (77, None)])
def test_the_cpu_mask_is_xgrammars(vocab, rows):
    """`Grammars.apply` on the CPU (a byte lookup of our own) sets exactly the logits xgrammar's own
    kernel sets to -inf, for all rows or some, a vocabulary not a multiple of 32 included."""
    import xgrammar

    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(6, vocab, generator=g)
    rows = list(range(6)) if rows is None else rows
    ours, ref = logits.clone(), logits.clone()
    Grammars.apply(ours, bitmask, rows)
    xgrammar.apply_token_bitmask_inplace(ref, bitmask, indices=rows)
    assert torch.equal(ours, ref) and torch.isinf(ours).any() and torch.isfinite(ours).any()


def test_the_masker_thread_and_an_inline_fill_give_the_same_tokens(models, tok, monkeypatch):
    """A bitmask fill runs in the masker thread beside the forward once fills get long, inline
    while they are short (the default model's are): both paths, forced, give every completion the
    same tokens, and the runner counts its fill seconds on either."""
    from fms_paged.engine import runner as runner_module

    _, paged = models
    prompt = tok.encode(PROMPT)

    def tokens(threshold: float) -> tuple[dict, float, float]:
        monkeypatch.setattr(runner_module, "INLINE_FILL_S", threshold)
        eng = Engine(paged, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, compile=False,
                     tokenizer=tok)
        for seed in range(3):
            eng.add_request(prompt, SamplingParams(max_new_tokens=60, temperature=1.0, seed=seed,
                                                   grammar=Grammar.json_schema(SCHEMA)))
        eng.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
        got = {key: ids for key, (ids, _) in run(eng).items()}
        return got, eng.runner.mask_fill_s, eng.runner.mask_wait_s

    threaded, fill_t, _ = tokens(0.0)  # every fill in the thread
    inline, fill_i, wait_i = tokens(float("inf"))  # every fill inline: all of it on the step's path
    assert threaded == inline
    assert fill_t > 0 and fill_i > 0 and wait_i >= fill_i
