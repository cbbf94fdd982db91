"""Tool calling on /v1/chat/completions through the official `openai` client, for both formats we
parse: Hermes / Qwen (`<tool_call>{...}</tool_call>`) and Llama 3.x JSON (`{"name", "parameters"}`),
each from a chat template (given with --chat-template) that renders `tools` and writes calls as
that family's templates do.

- The prompt is the template rendered as `transformers` renders it (`render_jinja_template` with
  the same tools and conversation, tool calls and tool results included), then tokenized.
- `tool_choice` "required" and a named function: seeded sampled requests (half streamed) all end
  in `tool_calls` naming a given tool, whose arguments validate against its parameters' schema;
  a seed gives the same calls streamed or not; the calls go back into the conversation (assistant
  `tool_calls` + `tool` message) and the next turn is answered.
- "auto": what the model writes is parsed; a regex holds the default model (a toy trained on
  Python source, which writes no calls of its own accord) to text with a call in it, so the
  parser sees a real output, whole and streamed. "none": the tools are rendered, nothing parsed.
- Bad tools / tool_choice: a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from fms_paged.serve import tools as tc

pytest.importorskip("xgrammar", reason="tool calling's forced calls need xgrammar (the serve extra)")

MODEL = "default_model"
REQUESTS = 6
# Hermes / Qwen2.5-style: the tools in the system turn, each call a <tool_call> block
HERMES = """{%- if tools %}<|system|>
You may call one or more functions. Their signatures:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
For each call, answer <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|assistant|>
{% if m.content %}{{ m.content }}
{% endif %}
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}
{%- elif m.role == "tool" %}<|user|>
<tool_response>
{{ m.content }}
</tool_response>
{% else %}<|{{ m.role }}|>
{{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""
# Llama 3.1-style JSON calls: the tools in the first user turn, a call is {"name", "parameters"}
LLAMA = """{%- set ns = namespace(tools_given=false) %}
{%- for m in messages %}
{%- if m.role == "user" and tools and not ns.tools_given %}{% set ns.tools_given = true %}<|user|>
Given the following functions, respond with a JSON function call of the form
{"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson(indent=2) }}
{% endfor %}
{{ m.content }}
{% elif m.role == "assistant" and m.tool_calls %}<|assistant|>
{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}

{% elif m.role == "tool" %}<|ipython|>
{{ m.content | tojson }}
{% else %}<|{{ m.role }}|>
{{ m.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""
PLAIN = "{% for m in messages %}# {{ m['content'] }}\n{% endfor %}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object",
                   "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Bern, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def servers(serve, tmp_path_factory):
    """format -> a server whose chat template writes that format (found by --tool-call-parser auto)."""
    d = tmp_path_factory.mktemp("templates")
    out = {}
    for fmt, source in (("hermes", HERMES), ("llama3_json", LLAMA)):
        (d / f"{fmt}.jinja").write_text(source)
        out[fmt] = serve("--enforce-eager", "--chat-template", d / f"{fmt}.jinja")
    return out


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)


async def chat(c: openai.AsyncOpenAI, messages, seed: int, stream: bool,
               **kw) -> tuple[str | None, list, str]:
    """-> (content, [(name, arguments dict)], finish reason) of one sampled chat completion."""
    kw = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 160, "temperature": 1.0,
          "seed": seed, **kw}
    if not stream:
        r = (await c.chat.completions.create(**kw)).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in r.message.tool_calls or []]
        assert all(t.id and t.type == "function" for t in r.message.tool_calls or [])
        return r.message.content, calls, r.finish_reason
    content, calls, reason = None, {}, None
    async for chunk in await c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for t in ch.delta.tool_calls or []:  # a call's pieces, by index (as OpenAI streams them)
                entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
                entry["name"] += (t.function and t.function.name) or ""
                entry["arguments"] += (t.function and t.function.arguments) or ""
            reason = ch.finish_reason or reason
    return content, [(e["name"], json.loads(e["arguments"])) for _, e in sorted(calls.items())], reason


def test_the_format_is_the_templates():
    assert tc.template_format(HERMES) == "hermes"
    assert tc.template_format(LLAMA) == "llama3_json"
    assert tc.template_format(PLAIN) is None


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_the_prompt_is_the_template_rendered_as_transformers_renders_it(servers, tok, fmt):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Bern", "unit": "c"}}}
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    template = HERMES if fmt == "hermes" else LLAMA
    text, _ = render_jinja_template([conversation], tools=TOOLS, chat_template=template,
                                    add_generation_prompt=True)
    # OpenAI clients send the arguments as a JSON string: templates are given the dict
    sent = [*conversation[:2], {**conversation[2], "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}]},
        conversation[3]]
    r = httpx.post(f"{servers[fmt].url}/tokenize", json={"messages": sent, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    assert "get_time" in text[0] and "temp" in text[0]
    assert r.json()["tokens"] == tok.encode(text[0], add_special_tokens=False)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_forced_calls_are_valid_calls_streamed_or_not(servers, fmt, choice):
    """One call each (the toy would add parallel calls until its token budget ran out: the
    grammar's parallel calls are checked on texts below)."""
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = dict(tool_choice=tool_choice, parallel_tool_calls=False)

    async def run():
        async with client(servers[fmt]) as c:
            return await asyncio.gather(*[chat(c, ASK, seed, seed % 2 == 1, **kw)
                                          for seed in range(REQUESTS)],
                                        *[chat(c, ASK, 5, stream, **kw) for stream in (False, True)])

    *outs, whole, streamed = asyncio.run(run())
    names = set(SCHEMAS) if choice == "required" else {choice}
    for content, calls, reason in outs:
        assert reason == "tool_calls" and not content and len(calls) == 1, (content, calls, reason)
        check_calls(calls, names)
    assert len({json.dumps(calls) for _, calls, _ in outs}) > 1  # sampled, not fixed
    if choice == "required":
        assert {calls[0][0] for _, calls, _ in outs} == names  # both tools chosen
    assert whole == streamed


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_the_forcing_grammars_take_calls_and_nothing_else(tok, fmt):
    """xgrammar matchers of the forcing grammars (the default model's vocabulary), on texts."""
    from fms_paged.engine.structured import Grammars

    grammars = Grammars(tok, tok.vocab_size, [tok.eos_id])
    one = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
           "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}'}[fmt]
    other = one.replace("get_time", "get_weather").replace('{"zone": "UTC"}', '{"city": "Bern", "unit": "c"}')
    sep = {"hermes": "\n", "llama3_json": "; "}[fmt]

    def takes(choice: str, text: str, parallel: bool = True) -> bool:
        m = grammars.matcher(tc.grammar(fmt, TOOLS, choice, parallel))
        return m.accept_string(text) and m.is_completed()

    assert takes("required", one) and takes("required", other) and takes("required", one + sep + other)
    assert takes("required", one, parallel=False) and not takes("required", one + sep + other, parallel=False)
    assert takes("get_time", one) and not takes("get_time", other) and not takes("get_time", one + sep + one)
    assert not takes("required", "Sure. " + one) and not takes("required", "")
    assert not takes("required", one.replace("UTC", "PST"))  # the arguments' schema holds
    assert tc.grammar(fmt, TOOLS, "auto") is None and tc.grammar(fmt, TOOLS, "none") is None


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_calls_go_back_into_the_conversation(servers, fmt):
    """The client's own message objects (arguments as JSON strings) and a tool result: answered."""
    with openai.OpenAI(base_url=servers[fmt].v1, api_key="x", max_retries=0, timeout=120) as c:
        first = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False,
                                          max_tokens=160, temperature=0, seed=0)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls
        turn = [*ASK, msg.model_dump(exclude_none=True),
                *[{"role": "tool", "tool_call_id": t.id, "content": '{"ok": true}'} for t in msg.tool_calls]]
        second = c.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def lit(text: str) -> str:
    """`text` as a regex that matches it alone."""
    return "".join("\\" + ch if ch in "()[]{}?*+|^$\\." else "\\n" if ch == "\n" else ch for ch in text)


# "auto": a regex holds the output to text + two calls in the format, so the parser sees a real output
ZONE, CITY, UNIT = "(UTC|CET|JST)", "[A-Z][a-z]{2,8}", "(c|f)"
AUTO = {
    "hermes": (lit('Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "') + ZONE
               + lit('"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "') + CITY
               + lit('", "unit": "') + UNIT + lit('"}}\n</tool_call>'), "Let me check. "),
    "llama3_json": (lit('<|python_tag|>{"name": "get_time", "parameters": {"zone": "') + ZONE
                    + lit('"}}; {"name": "get_weather", "parameters": {"city": "') + CITY
                    + lit('", "unit": "') + UNIT + lit('"}}'), None),
}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_auto_parses_what_the_model_writes(servers, fmt):
    regex, content = AUTO[fmt]

    async def run():
        async with client(servers[fmt]) as c:
            return await asyncio.gather(*[chat(c, ASK, seed, stream, tool_choice="auto",
                                               extra_body={"structured_outputs": {"regex": regex}})
                                          for seed in range(2) for stream in (False, True)])

    outs = asyncio.run(run())
    for i in range(0, len(outs), 2):
        assert outs[i] == outs[i + 1]  # whole == streamed
    for got, calls, reason in outs:
        assert reason == "tool_calls" and got == content
        assert [name for name, _ in calls] == ["get_time", "get_weather"]
        check_calls(calls, set(SCHEMAS))


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_auto_passes_text_through_and_none_parses_nothing(servers, fmt):
    """Free text (the toy writes Python) is content under "auto"; under "none" even a call is."""
    regex = AUTO[fmt][0]

    async def run():
        async with client(servers[fmt]) as c:
            return await asyncio.gather(
                chat(c, ASK, 0, False, tool_choice="auto", max_tokens=24, temperature=0),
                chat(c, ASK, 0, True, tool_choice="auto", max_tokens=24, temperature=0),
                chat(c, ASK, 0, False, tool_choice="none", max_tokens=24, temperature=0),
                chat(c, ASK, 1, False, tool_choice="none",
                     extra_body={"structured_outputs": {"regex": regex}}))

    auto, auto_streamed, none, none_call = asyncio.run(run())
    assert auto == auto_streamed == none and not auto[1] and auto[0] and auto[2] == "length"
    assert "get_weather" in none_call[0] and not none_call[1] and none_call[2] == "stop"


BAD = [
    ("tools not a list", {"tools": {"a": 1}}, "tools"),
    ("a tool without a function", {"tools": [{"type": "function"}]}, "tools[0]"),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name"),
    ("a name twice", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("parameters not a schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ("parameters xgrammar refuses", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
        "tool_choice": "required"}, "tools"),
    ("an unknown function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("a bad tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("forced calls and a schema", {"tools": TOOLS, "tool_choice": "required",
                                   "response_format": {"type": "json_object"}}, "tool_choice"),
    ("the deprecated functions", {"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("body, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tools_are_a_400_naming_the_field(servers, body, param):
    r = httpx.post(f"{servers['hermes'].v1}/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err


def test_a_template_without_tools_refuses_them(serve, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN)
    srv = serve("--enforce-eager", "--chat-template", tmp_path / "plain.jinja")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": TOOLS}
    r = httpx.post(f"{srv.v1}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "--tool-call-parser" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.v1}/chat/completions", json={**body, "tool_choice": "none"}, timeout=30)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ the parsers, on texts
CALL_H = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
CALL_L = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
PARSED = [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", CALL_H, None, PARSED),
    ("hermes", "Sure. " + CALL_H + "\n" + CALL_H, "Sure. ", PARSED * 2),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("llama3_json", "def f(x): return x", "def f(x): return x", []),
    ("llama3_json", CALL_L, None, PARSED),
    ("llama3_json", "<|python_tag|>" + CALL_L + "; " + CALL_L, None, PARSED * 2),
    ("llama3_json", '{"name": "get_time", "arguments": {"zone": "UTC"}}', None, PARSED),
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),
    ("llama3_json", CALL_L + " and then some", CALL_L + " and then some", []),
])
def test_parse(fmt, text, content, calls):
    got_content, got = tc.parse(fmt, text)
    assert got_content == content and [(c["name"], c["arguments"]) for c in got] == calls


@pytest.mark.parametrize("fmt, text, content", [
    ("hermes", "Sure, one moment. " + CALL_H, "Sure, one moment. "),
    ("hermes", "a <tool b <tool_call>{oops</tool_call>", "a <tool b <tool_call>{oops</tool_call>"),
    ("hermes", "x < y and <tool", "x < y and <tool"),
    ("llama3_json", "<|python_tag|>" + CALL_L, ""),
    ("llama3_json", "print(1)", "print(1)"),
    ("llama3_json", '{"a": 1}', '{"a": 1}'),
])
def test_the_stream_parser_holds_back_calls_only(fmt, text, content):
    """Fed a character at a time: the content is sent as soon as it cannot start a call (a text
    that only looked like one is sent at the end), the calls come at the end."""
    p = tc.StreamParser(fmt, constrained=False)
    sent = "".join(p.feed(ch) for ch in text)
    rest, calls = p.finish()
    expected_content, expected_calls = tc.parse(fmt, text)
    assert sent + rest == (content if expected_calls else text)
    assert calls == expected_calls
    if fmt == "hermes" and expected_calls:
        assert sent == content  # before the call came to an end
