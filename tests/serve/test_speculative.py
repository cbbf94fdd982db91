"""`fms-paged serve --speculative-config` (prompt lookup) on the default model: greedy completions
equal `fms_paged.generate()` (an independent path: no engine, no speculation), a stop string cut
where it completes even when a verify step brings several tokens at once (the usage counts the
tokens up to it, as without speculation), and /metrics counts the proposals and acceptances."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import openai
import pytest

from fms_paged import generate
from fms_paged.serve.server import speculative_config
from tests.serve.conftest import metric, scrape, wait_idle

MODEL = "default_model"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# a passage the default model's greedy continuation repeats: proposals are accepted and rejected
PASSAGE = ("def parse(line):\n    name, _, value = line.partition(':')\n"
           "    return name.strip(), value.strip()\n")
PROMPT = PASSAGE + "\n\n" + PASSAGE


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager", "--max-num-seqs", "4", "--speculative-config", json.dumps(SPEC))


def test_greedy_equals_generate_and_metrics_count(server, paged_model, tok):
    ids = tok.encode(PROMPT)
    want = generate(paged_model, [ids], 40, eos_id=None)[0]
    before = scrape(server.url)
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want
        # a stop string inside the text: cut before it, the tokens counted up to the one completing it
        full = r.choices[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        assert stop.strip()
        s = c.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        got = s.choices[0].model_extra["token_ids"]
        assert s.choices[0].text == full[: full.find(stop)] and s.choices[0].finish_reason == "stop"
        assert got == want[: len(got)]
        head = tok.decode(ids + got[:-1])[len(tok.decode(ids)):]
        assert stop not in head  # the last token completes it: none of the tokens after it
    after, _ = wait_idle(server.url)
    d = {n: metric(after, n) - metric(before, n) for n in (
        "fms_paged:spec_decode_num_drafts_total", "fms_paged:spec_decode_num_draft_tokens_total",
        "fms_paged:spec_decode_num_accepted_tokens_total")}
    assert d["fms_paged:spec_decode_num_drafts_total"] > 0
    accepted = d["fms_paged:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < d["fms_paged:spec_decode_num_draft_tokens_total"]
    assert 0 < metric(after, "fms_paged:spec_decode_acceptance_rate") < 1


def test_bad_speculative_config_stops_the_command_line():
    p = subprocess.run([sys.executable, "-m", "fms_paged.cli", "serve", "--speculative-config",
                        '{"method": "ngram"}'], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "num_speculative_tokens is required" in p.stderr, p.stderr


def test_draft_model_config_parses_from_json():
    """--speculative-config takes the draft as a checkpoint path (the engine loads it paged) and
    refuses a draft_model config without one."""
    spec = speculative_config('{"method": "draft_model", "model": "/ckpt/small", '
                              '"num_speculative_tokens": 4}')
    assert spec["model"] == "/ckpt/small"
    with pytest.raises(argparse.ArgumentTypeError, match="model=None"):
        speculative_config('{"method": "draft_model", "num_speculative_tokens": 4}')
