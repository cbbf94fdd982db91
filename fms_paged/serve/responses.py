"""OpenAI response bodies from a `Run`: whole responses and the chunks of a stream
(`data: {json}\\n\\n` events ending in `data: [DONE]`), completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fms_paged.serve import tools
from fms_paged.serve.requests import Choice, Event, Run
from fms_paged.tokenizers import Tokenizer

DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def completion_logprobs(tok: Tokenizer, token_ids: list[int], lps: list, offset: int) -> dict:
    """OpenAI's completions format: tokens, their log-probabilities, the top alternatives of each
    (the sampled token included, as vLLM does), and each token's offset in the text. An entry of
    `lps` may be None (an echoed prompt's first token, which nothing predicts): null there."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(offset)
        tokens.append(tok.token_text(t))
        offset += len(tokens[-1])
    top = []
    for t, lp in zip(token_ids, lps):
        if lp is None:
            top.append(None)
            continue
        alts = {tok.token_text(a): v for a, v in lp.top}
        alts.setdefault(tok.token_text(t), lp.logprob)
        top.append(alts)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs(tok: Tokenizer, prompt: list[int], lps: list | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the top k and the prompt token itself."""
    if lps is None:
        return None
    out = []
    for t, lp in zip(prompt, lps):
        if lp is None:
            out.append(None)
            continue
        entry = {str(a): {"logprob": v, "rank": r, "decoded_token": tok.token_text(a)}
                 for r, (a, v) in enumerate(lp.top[:k], start=1)}
        entry.setdefault(str(t), {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": tok.token_text(t)})
        out.append(entry)
    return out


def chat_logprobs(tok: Tokenizer, token_ids: list[int], lps: list) -> dict:
    def entry(t: int, v: float) -> dict:
        s = tok.token_text(t)
        return {"token": s, "logprob": v, "bytes": list(tok.token_bytes(t))}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in zip(token_ids, lps)]}


def _calls_finish(reason: str | None) -> str | None:
    """A choice that ended with tool calls: "tool_calls" (OpenAI's), unless it was cut short."""
    return "tool_calls" if reason == "stop" else reason


class Renderer:
    """Bodies for one run; `chat` picks chat.completion(.chunk) over text_completion."""

    def __init__(self, run: Run, model: str, chat: bool):
        self.run, self.model, self.chat = run, model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.tok = run.ctx.tokenizer
        self._offsets = [0] * len(run.choices)  # completions: text offset of each choice's next token
        self._started: set[int] = set()  # choices whose first chunk was sent
        fmt, forced = run.prep.tool_format, run.prep.tools_forced
        # chats with tools: each choice's calls are held back from its streamed content
        self._calls = {c.index: tools.StreamParser(fmt, forced) for c in run.choices} if fmt else {}

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

    def _prompt(self, c: Choice) -> tuple[list[int], list]:
        """An echoing choice's prompt ids and their log-probabilities (None for the first token):
        they open its logprobs."""
        j = c.index // self.run.prep.n
        lps = self.run.prompt_logprobs[j]
        return self.run.prep.prompts[j], lps if lps is not None else [None] * len(self.run.prep.prompts[j])

    def _vllm_prompt_logprobs(self, j: int) -> list | None:
        k = self.run.prep.prompt_logprobs
        if k is None:
            return None
        return prompt_logprobs(self.tok, self.run.prep.prompts[j], self.run.prompt_logprobs[j], k)

    # ------------------------------------------------------------------ whole responses
    async def response(self) -> dict:
        async for _ in self.run.events():
            pass
        prep, choices = self.run.prep, []
        for c in self.run.choices:
            if prep.echo_logprobs:  # the prompt's tokens first
                ids, plps = self._prompt(c)
                lps = self._logprobs(c, ids + c.token_ids, plps + c.logprobs)
            else:
                lps = self._logprobs(c, c.token_ids, c.logprobs) if prep.logprobs is not None else None
            if self.chat:
                message = {"role": "assistant", "content": c.text.text}
                finish = c.finish_reason
                if prep.tool_format is not None:
                    content, calls = tools.parse(prep.tool_format, c.text.text)
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": tools.openai_calls(calls)}
                        finish = _calls_finish(finish)
                ch = {"index": c.index, "message": message, "logprobs": lps, "finish_reason": finish}
            else:
                echo = prep.echo_texts[c.index // prep.n] if prep.echo_texts else ""
                ch = {"index": c.index, "text": echo + c.text.text, "logprobs": lps,
                      "finish_reason": c.finish_reason}
            if prep.return_token_ids:
                ch["token_ids"] = c.token_ids
            if prep.prompt_logprobs is not None and not self.chat:
                ch["prompt_logprobs"] = self._vllm_prompt_logprobs(c.index // prep.n)
            choices.append(ch)
        body = {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.run.usage()}
        if prep.prompt_logprobs is not None and self.chat:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        if prep.return_token_ids:
            body["prompt_token_ids"] = prep.prompts if len(prep.prompts) > 1 else prep.prompts[0]
        return body

    # ------------------------------------------------------------------ streams
    def _chunk(self, ev: Event) -> dict:
        c, prep = ev.choice, self.run.prep
        text, ids, lps = ev.text, ev.token_ids, ev.logprobs
        first = c.index not in self._started
        self._started.add(c.index)
        if first and prep.echo_logprobs:  # the echo, with the prompt's log-probabilities now here
            ids0, plps = self._prompt(c)
            text, ids, lps = prep.echo_texts[c.index // prep.n] + text, ids0 + ids, plps + (lps or [])
        lps = self._logprobs(c, ids, lps)
        if self.chat:
            delta, finish = {}, ev.finish_reason
            parser = self._calls.get(c.index)
            if parser is not None:  # the content that cannot be a call now; the calls at the end
                text = parser.feed(text)
                if finish is not None:
                    rest, calls = parser.finish()
                    text += rest
                    if calls:
                        delta["tool_calls"] = [{"index": k, **call}
                                               for k, call in enumerate(tools.openai_calls(calls))]
                        finish = _calls_finish(finish)
            if text:
                delta = {"content": text, **delta}
            ch = {"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            ch = {"index": c.index, "text": text, "logprobs": lps, "finish_reason": ev.finish_reason}
        if first and prep.prompt_logprobs is not None:
            ch["prompt_logprobs"] = self._vllm_prompt_logprobs(c.index // prep.n)
        if prep.return_token_ids:
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
        elif prep.echo_texts and not prep.echo_logprobs:  # (with logprobs: once the prompt's come)
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
