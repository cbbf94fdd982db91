"""Chat templates: found in the checkpoint (`chat_template` in tokenizer_config.json, or
chat_template.jinja) or given as a file, rendered as `transformers` renders them: a sandboxed,
immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the `tojson` filter that does not
escape HTML, `raise_exception` and `strftime_now`, the tokenizer's special tokens as variables.
The rendered text is tokenized without adding special tokens (the template writes them)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or that refuses the conversation (`raise_exception`)."""


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def find_chat_template(model_dir: str | os.PathLike | None,
                       override: str | os.PathLike | None = None) -> str | None:
    """The template text: `override` (a file) first, then chat_template.jinja, then
    tokenizer_config.json's `chat_template` (a string, or the entry named "default" of a list)."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ChatTemplateError(f"--chat-template {str(path)!r}: no such file")
        return path.read_text(encoding="utf-8")
    if model_dir is None:
        return None
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(t, list):
            t = next((e.get("template") for e in t if e.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def special_tokens(model_dir: str | os.PathLike | None) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (strings): template variables."""
    cfg = None if model_dir is None else Path(model_dir) / "tokenizer_config.json"
    if cfg is None or not cfg.is_file():
        return {}
    data = json.loads(cfg.read_text(encoding="utf-8"))
    return {k: t for k in SPECIAL_TOKENS if (t := _token(data.get(k))) is not None}


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None
        self.tokens = dict(tokens or {})
        self.source = source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as text; `tools` (OpenAI's function definitions) is the template's
        `tools` variable, None when the request has none (as transformers passes it)."""
        try:
            return self.template.render(messages=messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt, **self.tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
