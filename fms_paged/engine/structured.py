"""Structured outputs: a request's output held to a grammar by xgrammar (what vLLM, SGLang and
TensorRT-LLM use), as a token bitmask applied to its logits before sampling.

- `Grammar` is what a request asks for (`SamplingParams.grammar`): a JSON schema, any JSON object,
  a regular expression, a choice among strings, an EBNF grammar, or an xgrammar structural tag
  (tool calls: `fms_paged.serve.tools`). Plain data: it crosses process boundaries, and `check()`
  validates it without a tokenizer (a server's 400 before anything is submitted).
- `Grammars` compiles them for one tokenizer (cached by content) and makes each request's matcher
  (`xgrammar.GrammarMatcher`): the engine holds one, built from the tokenizer it is given.
- Each step the model runner fills the bitmask rows of the requests that have a matcher, in a
  thread of its own while the model's forward runs (xgrammar's C++ releases the GIL), and applies
  them to those rows of the logits; the scheduler then feeds each sampled token to its matcher,
  and a matcher that has ended the output (its grammar complete, the stop token taken) finishes
  the request ("stop"). A preempted request keeps its matcher: recomputing tokens changes nothing
  it has accepted.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# the "[12:00:00] /project/cpp/file.cc:123: " xgrammar's C++ errors start with
_SOURCE_LOCATION = re.compile(r"\[[0-9:]+\] \S+:\d+: ")
KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")
# JSON may have whitespace between its tokens, at most this many characters in a row (a sampled
# output cannot spend its tokens on blanks)
MAX_WHITESPACE = 16


def _xgr():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs need xgrammar: pip install 'fms_paged[serve]' ({e})") from None
    return xgrammar


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. `spec`: the JSON schema (JSON text) for "json_schema",
    nothing for "json_object" (any JSON object), the regex for "regex", a JSON list of the
    strings for "choice", the grammar for "ebnf" (its root rule `root`), the structural tag (JSON
    text) for "structural_tag"."""

    kind: str
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        return cls("choice", json.dumps(list(options)))

    def check(self) -> None:
        """ValueError saying why, for a grammar xgrammar would refuse (no tokenizer needed)."""
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind {self.kind!r}; expected one of {KINDS}")
        try:
            self.grammar()
        except (ValueError, RuntimeError, TypeError) as e:  # xgrammar's errors are ValueError / RuntimeError
            why = _SOURCE_LOCATION.sub("", str(e).splitlines()[0])[:300]
            raise ValueError(f"{self.kind}: {why}") from None

    def choices(self) -> list[str]:
        options = json.loads(self.spec)
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise ValueError(f"a choice is a non-empty list of strings, got {self.spec[:100]}")
        return options

    def grammar(self):
        """This as an `xgrammar.Grammar` (not yet compiled for a tokenizer)."""
        xgr = _xgr()
        if self.kind == "json_schema":
            return xgr.Grammar.from_json_schema(self.spec, max_whitespace_cnt=MAX_WHITESPACE)
        if self.kind == "json_object":  # OpenAI's JSON mode: an object (not any JSON value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE)
        if self.kind == "regex":
            return xgr.Grammar.from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(o) for o in self.choices())
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if self.kind == "ebnf":
            return xgr.Grammar.from_ebnf(self.spec)
        return xgr.Grammar.from_structural_tag(self.spec)


def vocab_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes, as xgrammar matches them against a grammar: b"" for a special
    token (BOS, EOS, control and added special tokens: no text a grammar could spell) and for the
    ids past the tokenizer's vocabulary (a model's padded embedding rows)."""
    special = set(getattr(tokenizer, "special_ids", ()))
    return [b"" if i in special or i >= tokenizer.vocab_size else tokenizer.token_bytes(i)
            for i in range(vocab_size)]


class Grammars:
    """Grammars compiled for one tokenizer (by content, so requests with the same schema share
    one), and matchers made from them."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        xgr = _xgr()
        info = xgr.TokenizerInfo(vocab_bytes(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(set(stop_ids)))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._compiled: dict[Grammar, Any] = {}

    def compile(self, grammar: Grammar):
        if grammar not in self._compiled:
            if len(self._compiled) >= 1024:  # a server's long tail of schemas: keep the recent ones
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[grammar] = self.compiler.compile_grammar(grammar.grammar())
        return self._compiled[grammar]

    def matcher(self, grammar: Grammar):
        """A fresh `xgrammar.GrammarMatcher` for one completion (ValueError for a bad grammar)."""
        grammar.check()
        return _xgr().GrammarMatcher(self.compile(grammar))

    def fill(self, matchers: Sequence) -> torch.Tensor:
        """The bitmask [len(matchers), ceil(V / 32)] int32 of the next token of each matcher (None:
        every token allowed)."""
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # all allowed
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(bitmask, i)
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of `rows` of logits [K, V] (fp32) to -inf, in place: xgrammar's kernel
        on an accelerator; on the CPU a byte lookup (`_allowed`), about 3x faster than xgrammar's
        CPU kernel at a 32k vocabulary (`make bench-structured` counts it in the step)."""
        if logits.device.type != "cpu" or sys.byteorder != "little":
            _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
            return
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(~_allowed(bitmask[: len(rows)], logits.shape[1]), float("-inf"))
            return
        index = torch.tensor(rows)
        sub = logits[index]
        sub.masked_fill_(~_allowed(bitmask[index], logits.shape[1]), float("-inf"))
        logits[index] = sub


# bit j of byte b, for every byte: a bitmask's int32 words are little-endian bytes, token 32 w + 8 i + j
# allowed when bit j of byte i of word w is set
_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # [256, 8]


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask [K, ceil(V / 32)] int32 -> allowed [K, V] bool (little-endian hosts)."""
    words = bitmask.contiguous().view(torch.uint8)  # [K, 4 W]
    return _BITS[words.long()].view(bitmask.shape[0], -1)[:, :vocab_size]
