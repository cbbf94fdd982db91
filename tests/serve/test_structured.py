"""Structured outputs through the official `openai` client against `fms-paged serve` (xgrammar's
token bitmasks on the engine's logits): every kind OpenAI and vLLM name (response_format's
json_schema and json_object; structured_outputs' regex, choice and EBNF grammar; the older guided_*
fields), 50 seeded sampled requests each (half streamed), all sent at once: every output parses
and validates against its schema / regex / choice / grammar, and a seed gives the same output
streamed or not. A schema, regex or grammar xgrammar refuses is a 400 naming the field.

The default model is a toy trained on Python source: left free, it would write Python, so a valid
output is the grammar's doing. A grammar makes an output valid, not short: the prompt (a Python
dict) and the token budget are such that these seeds' JSON ends (closes its strings) within it.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

MODEL = "default_model"
REQUESTS = 50
PROMPT = 'd = {"name": "ok", "size": 3}\ne = '
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["red", "green", "blue", "yellow"]
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num " + " expr\nnum ::= [1-9] [0-9]?'


def ebnf_ok(text: str) -> bool:
    return re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text) is not None


def json_ok(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


KINDS = {  # kind -> (extra request fields, validator)
    "json_schema": ({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SCHEMA}}},
                    lambda t: json_ok(t, SCHEMA)),
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: json_ok(t, {"type": "object"})),
    "regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    "grammar": ({"structured_outputs": {"grammar": EBNF}}, ebnf_ok),
    "guided_json": ({"guided_json": SCHEMA}, lambda t: json_ok(t, SCHEMA)),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "guided_choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
}


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager", "--max-num-seqs", "16", "--max-num-batched-tokens", "512")


async def one(client: openai.AsyncOpenAI, extra: dict, seed: int, stream: bool) -> tuple[str, str]:
    """-> (text, finish reason) of one sampled chat-free completion."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=1.0, seed=seed, extra_body=extra)
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_outputs_match_their_grammar(server, kind):
    extra, valid = KINDS[kind]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*[one(c, extra, seed, seed % 2 == 1) for seed in range(REQUESTS)])

    outs = asyncio.run(run())
    bad = [(seed, text, why) for seed, (text, why) in enumerate(outs) if why != "stop" or not valid(text)]
    assert not bad, bad[:3]
    assert len({text for text, _ in outs}) > (1 if kind.endswith("choice") else 10)  # sampled, not fixed


def test_a_seed_gives_the_same_output_streamed_or_not(server):
    extra, _ = KINDS["json_schema"]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(one(c, extra, 7, False), one(c, extra, 7, True))

    whole, streamed = asyncio.run(run())
    assert whole == streamed


def test_stop_strings_cut_a_constrained_output(server):
    """A stop string ends a grammar's output where it appears (the rest is not sent), streamed or
    not; n > 1 gives each completion its own matcher."""
    async def run():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300) as c:
            kw = dict(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=11, n=3, stop=["@"],
                      extra_body={"structured_outputs": {"regex": REGEX}})
            whole = await c.completions.create(**kw)
            texts = [""] * 3
            async for chunk in await c.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    texts[ch.index] += ch.text
            return whole, texts

    whole, streamed = asyncio.run(run())
    assert [c.text for c in whole.choices] == streamed
    for c in whole.choices:
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,8}", c.text), c.text
    assert len(set(streamed)) > 1


def test_chat_with_a_schema(serve, tmp_path):
    """response_format on /v1/chat/completions (a chat template given with --chat-template)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}# {{ m['content'] }}\n{% endfor %}")
    srv = serve("--enforce-eager", "--chat-template", str(template))
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a person"}],
                                      max_tokens=160, temperature=0.7, seed=3,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "p", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop" and json_ok(r.choices[0].message.content, SCHEMA)


BAD = [
    ("a schema xgrammar refuses", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format.json_schema.schema"),
    ("a schema that is not an object", {"response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ("an unknown response_format", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("a bad regex", {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ("an empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("a bad grammar", {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
     "structured_outputs.grammar"),
    ("two kinds in structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("two fields at once", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize("body, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_grammar_xgrammar_refuses_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.v1}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert ".cc:" not in err["message"]  # xgrammar's message, without its C++ source location


def test_bench_http_structured_loads_count_each_kind(server):
    """`make bench-http`'s structured-output loads (benchmarks.http_structured) against this
    server: every request done, the mixed run's JSON requests counted apart, each request's whole
    budget decoded (the schema cannot end within it) and the report's table written from them."""
    from types import SimpleNamespace

    from benchmarks import http_report, http_structured

    args = SimpleNamespace(seed=0, range_ratio=0.25, input_len=24, output_len=12, structured_prompts=8,
                           structured_ratio=0.5, structured_rounds=1, client_timeout=120)
    work = http_structured.workload(args, 4096)
    out = http_structured.structured_loads(server.url, MODEL, args, 4096, log=lambda s: None)
    assert out["failed"] == 0 and 0 < out["structured_requests"] < len(work)
    free, mixed = out["runs"]["free"][0], out["runs"]["mixed"][0]
    budget = sum(w["max_tokens"] for w in work)
    assert free["all"]["output_tokens"] == mixed["all"]["output_tokens"] == budget
    assert mixed["json"]["requests"] == out["structured_requests"] and free["json"] is None
    assert out["tok_s_ratio"] == pytest.approx(mixed["output_tok_s"] / free["output_tok_s"])
    table = "\n".join(http_report.structured_table({"servers": {"ours": {"structured": out}}}))
    assert "| fms-paged | mixed / free |" in table
