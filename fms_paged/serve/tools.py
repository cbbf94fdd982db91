"""Tool calling on /v1/chat/completions: the request's `tools` rendered through the checkpoint's
chat template (its `tools` variable, as transformers passes them), the model's calls parsed back
into OpenAI `tool_calls` (whole, or as stream deltas), in the formats of the families we load:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call
  (Hermes, Qwen2 / 2.5 / 3);
- "llama3_json": `{"name": ..., "parameters": {...}}`, calls separated by `;`, optionally after
  `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3).
The format is the template's (it writes one of them), or `--tool-call-parser`. `tool_choice`:
"auto" parses whatever the model writes; "required" and a named function constrain the output
with xgrammar's structural tag for the format (`fms_paged.engine.structured`), so it is always a
well-formed call whose arguments match the function's JSON schema; "none" renders the tools and
parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from fms_paged.engine.structured import MAX_WHITESPACE, Grammar
from fms_paged.serve.protocol import bad

FORMATS = ("hermes", "llama3_json")
_HERMES_BEGIN, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# xgrammar's name for the structural tag of each format
_XGRAMMAR_FORMAT = {"hermes": "qwen_3", "llama3_json": "llama"}
_SEPARATOR = {"hermes": "\n", "llama3_json": "; "}  # between parallel calls


def template_format(source: str | None) -> str | None:
    """The tool-call format a chat template writes, or None when it renders no tools."""
    if not source or "tools" not in source:
        return None
    if _HERMES_BEGIN in source:
        return "hermes"
    if _PYTHON_TAG in source or "parameters" in source:
        return "llama3_json"
    return None


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", "description"?, "parameters"?}}]),
    checked; 400 naming the entry otherwise."""
    if not isinstance(tools, list) or not tools:
        raise bad("tools", "expected a non-empty list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise bad(f"tools[{i}]", "expected {'type': 'function', 'function': {'name': ..., "
                      "'parameters': ...}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad(f"tools[{i}].function.name", f"{name!r}; expected 1-64 letters, digits, _ . -")
        if name in names:
            raise bad(f"tools[{i}].function.name", f"{name!r} is given twice")
        names.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "expected a JSON schema (an object)")
        f.setdefault("parameters", params)
    return tools


def tool_choice(choice: Any, tools: list[dict] | None) -> str:
    """"none", "auto", "required", or the name of the function to call (400 for anything else)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad("tool_choice", f"{choice!r} needs tools")
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad("tool_choice", f"{choice!r:.80}; expected 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad("tool_choice", f"function {name!r} is not one of the tools")
    return name


def grammar(fmt: str, tools: list[dict], choice: str, parallel: bool = True) -> Grammar | None:
    """What holds the output to calls of `tools` in `fmt`, or None ("auto", "none"): a named
    function, one call of it; "required", one call of any tool (with `parallel`, one or more,
    separated as the format separates them). Nothing but the calls: the grammar ends after them.
    The call tags (each function's opening text and its arguments' JSON schema) are xgrammar's
    builtin ones for the format."""
    if choice in ("auto", "none"):
        return None
    import xgrammar
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

    forced = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    tag = xgrammar.get_builtin_structural_tag(_XGRAMMAR_FORMAT[fmt], tools=tools, tool_choice=forced,
                                              reasoning="disabled", parallel_tool_calls=parallel)
    if choice == "required":  # xgrammar's lets free text around the calls: calls only
        tag = StructuralTag(format=TagsWithSeparatorFormat(tags=tag.format.tags, separator=_SEPARATOR[fmt],
                                                           at_least_one=True, stop_after_first=not parallel))
    for t in tag.format.tags if choice == "required" else [tag.format]:
        t.content.max_whitespace_cnt = MAX_WHITESPACE  # as for any JSON we constrain
    return Grammar("structural_tag", tag.model_dump_json())


def _call(obj: Any, fmt: str) -> dict | None:
    """{"name", "arguments" (a dict)} from one parsed call object, or None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments" if fmt == "hermes" else "parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}


def parse(fmt: str, text: str) -> tuple[str | None, list[dict]]:
    """A model's output -> (content, its calls: [{"name", "arguments"}]); no calls: (text, [])."""
    if fmt == "hermes":
        calls = []
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), fmt)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(_HERMES_BEGIN)]  # as streamed: what came before the first call
        return content or None, calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, fmt)
        if call is None:
            return text, []
        calls.append(call)
        rest = body[i:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        i = len(body) - len(rest)
    return None, calls


def openai_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's `tool_calls`: an id each, the arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: an assistant message's tool calls with their
    arguments as a dict (OpenAI sends a JSON string; Llama's and Qwen's templates write a dict)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                f = dict(c.get("function") or {}) if isinstance(c, dict) else {}
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append({**c, "function": f} if isinstance(c, dict) else c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


class StreamParser:
    """A choice's streamed text with its tool calls held back: `feed(delta)` -> the content to send
    now (text that cannot be the start of a call), `finish()` -> (the rest of the content, the
    calls). With `constrained` (required / a named function) the whole output is calls."""

    def __init__(self, fmt: str, constrained: bool):
        self.fmt, self.constrained = fmt, constrained
        self.text, self.sent, self.holding = "", 0, constrained

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.fmt == "llama3_json":  # a call is the whole output: it starts with "{" or the tag
            head = self.text.lstrip()
            if not head:
                return ""
            if head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                self.holding = True
                return ""
            return self._release(len(self.text))
        start = self.text.find(_HERMES_BEGIN, self.sent)
        if start >= 0:
            self.holding = True
            return self._release(start)
        keep = next((k for k in range(min(len(_HERMES_BEGIN) - 1, len(self.text)), 0, -1)
                     if _HERMES_BEGIN.startswith(self.text[-k:])), 0)  # a marker may be starting
        return self._release(len(self.text) - keep)

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        _, calls = parse(self.fmt, self.text)
        if not calls:
            return self.text[self.sent :], []
        return "", calls  # what came before the first call was sent already, as content
