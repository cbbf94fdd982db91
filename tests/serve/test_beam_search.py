"""vLLM's `use_beam_search` on the server: n beams, the n best hypotheses as the choices (best
first), those of the engine's beam search (`generate(num_beams=...)` for the best); bad beam-search
settings are a 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import httpx
import pytest

from fms_paged import Engine, SamplingParams, generate
from tests.serve.test_errors import check_error, good_request_succeeds

MODEL = "default_model"


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager", "--max-num-seqs", "4", "--max-model-len", 256)


def test_beam_search_choices_are_the_engines_hypotheses(server, paged_model, tok):
    ids = tok.encode("def add(a, b):")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "return_token_ids": True, "ignore_eos": True}
    r = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    eng = Engine(paged_model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=64)
    eng.add_request(ids, SamplingParams(max_new_tokens=6, n=3, use_beam_search=True, ignore_eos=True))
    want = {o.index: o.new_token_ids for o in eng.stream()}
    assert got == [want[i] for i in range(3)]
    assert got[0] == generate(paged_model, [ids], 6, num_beams=3, eos_id=None)[0]
    assert r.json()["usage"]["completion_tokens"] == sum(map(len, got))


@pytest.mark.parametrize("body, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"top_k": 5}, "top_k"),
    ({"logprobs": 2}, "logprobs"),
    ({"early_stopping": "soon"}, "early_stopping"),
    ({"length_penalty": "long"}, "length_penalty"),
], ids=["temperature", "top_k", "logprobs", "early_stopping", "length_penalty"])
def test_bad_beam_search_settings_name_the_field(server, body, param):
    r = httpx.post(f"{server.v1}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 2,
                                                     "use_beam_search": True, **body}, timeout=30)
    check_error(r, 400, param)
    good_request_succeeds(server.url)


def test_beam_settings_without_beam_search_name_the_field(server):
    r = httpx.post(f"{server.v1}/completions", json={"model": MODEL, "prompt": "x", "length_penalty": 0.5},
                   timeout=30)
    check_error(r, 400, "length_penalty", "use_beam_search")
