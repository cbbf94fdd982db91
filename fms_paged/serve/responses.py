"""OpenAI response bodies from a `Run`: whole responses and the chunks of a stream
(`data: {json}\\n\\n` events ending in `data: [DONE]`), completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fms_paged.serve.requests import Choice, Event, Run
from fms_paged.tokenizers import Tokenizer

DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def completion_logprobs(tok: Tokenizer, token_ids: list[int], lps: list, offset: int) -> dict:
    """OpenAI's completions format: tokens, their log-probabilities, the top alternatives of each
    (the sampled token included, as vLLM does), and each token's offset in the text."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(offset)
        tokens.append(tok.token_text(t))
        offset += len(tokens[-1])
    top = []
    for t, lp in zip(token_ids, lps):
        alts = {tok.token_text(a): v for a, v in lp.top}
        alts.setdefault(tok.token_text(t), lp.logprob)
        top.append(alts)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, token_ids: list[int], lps: list) -> dict:
    def entry(t: int, v: float) -> dict:
        s = tok.token_text(t)
        return {"token": s, "logprob": v, "bytes": list(tok.token_bytes(t))}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(token_ids, lps)]}


class Renderer:
    """Bodies for one run; `chat` picks chat.completion(.chunk) over text_completion."""

    def __init__(self, run: Run, model: str, chat: bool):
        self.run, self.model, self.chat = run, model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.tok = run.ctx.tokenizer
        self._offsets = [0] * len(run.choices)  # completions: text offset of each choice's next token

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Choice, token_ids: list[int], lps: list | None) -> dict | None:
        if lps is None or self.run.prep.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.tok, token_ids, lps)
        out = completion_logprobs(self.tok, token_ids, lps, self._offsets[c.index])
        if token_ids:
            self._offsets[c.index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    # ------------------------------------------------------------------ whole responses
    async def response(self) -> dict:
        async for _ in self.run.events():
            pass
        prep, choices = self.run.prep, []
        for c in self.run.choices:
            lps = self._logprobs(c, c.token_ids, c.logprobs) if prep.logprobs is not None else None
            if self.chat:
                ch = {"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                      "logprobs": lps, "finish_reason": c.finish_reason}
            else:
                echo = prep.echo_texts[c.index // prep.n] if prep.echo_texts else ""
                ch = {"index": c.index, "text": echo + c.text.text, "logprobs": lps,
                      "finish_reason": c.finish_reason}
            if prep.return_token_ids:
                ch["token_ids"] = c.token_ids
            choices.append(ch)
        body = {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.run.usage()}
        if prep.return_token_ids:
            body["prompt_token_ids"] = prep.prompts if len(prep.prompts) > 1 else prep.prompts[0]
        return body

    # ------------------------------------------------------------------ streams
    def _chunk(self, ev: Event) -> dict:
        c = ev.choice
        lps = self._logprobs(c, ev.token_ids, ev.logprobs)
        if self.chat:
            ch = {"index": c.index, "delta": {"content": ev.text} if ev.text else {}, "logprobs": lps,
                  "finish_reason": ev.finish_reason}
        else:
            ch = {"index": c.index, "text": ev.text, "logprobs": lps, "finish_reason": ev.finish_reason}
        if self.run.prep.return_token_ids:
            ch["token_ids"] = ev.token_ids
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [ch]}

    async def stream(self) -> AsyncIterator[bytes]:
        prep = self.run.prep
        if self.chat:  # the first chunk of each choice names the role (OpenAI's stream shape)
            for c in self.run.choices:
                yield sse({**self._head("chat.completion.chunk"), "choices": [
                    {"index": c.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]})
        elif prep.echo_texts:
            for c in self.run.choices:
                yield sse({**self._head("text_completion"), "choices": [
                    {"index": c.index, "text": prep.echo_texts[c.index // prep.n], "logprobs": None,
                     "finish_reason": None}]})
        async for ev in self.run.events():
            yield sse(self._chunk(ev))
        if prep.include_usage:
            yield sse({**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                       "choices": [], "usage": self.run.usage()})
        yield DONE
