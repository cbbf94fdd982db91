"""An OpenAI request turned into engine submissions (`prepare_*`: every check before anything is
submitted, so a bad request holds nothing), and the engine's outputs turned back into choices
(`Run`): each choice's text through `IncrementalText`, its token ids, log-probabilities and finish
reason, and the usage numbers."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fms_paged.engine import SamplingParams
from fms_paged.engine.request import MAX_LOGPROBS, check_prompt
from fms_paged.serve.chat import ChatTemplate, ChatTemplateError
from fms_paged.serve.loop import EngineDead, EngineLoop
from fms_paged.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad,
)
from fms_paged.serve.text import IncrementalText
from fms_paged.tokenizers import Tokenizer

MAX_N = 128
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


@dataclass
class ServeContext:
    """What the handlers need of the server: the loop, the tokenizer, the names and limits."""

    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    chat_template: ChatTemplate | None = None
    max_waiting: int | None = None
    model_root: str = ""
    capacity: int | None = None  # tokens the page pool can hold (None: max_model_len bounds it)


@dataclass
class Prepared:
    """One HTTP request as engine submissions: prompt j's ids with its settings; choice index
    j * n + i is completion i of prompt j (OpenAI's order for a batch of prompts)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    stop: tuple[str, ...]
    logprobs: int | None
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def check_model(ctx: ServeContext, name: str | None) -> None:
    if name is not None and name != ctx.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")


def _max_tokens(ctx: ServeContext, name: str, value: int | None, prompt_len: int) -> int:
    room = min(ctx.max_model_len, ctx.capacity or ctx.max_model_len) - prompt_len
    if value is None:
        if room < 1:
            raise bad("prompt", f"a prompt of {prompt_len} tokens leaves no room for output under "
                      f"max_model_len={ctx.max_model_len}")
        return room
    if value < 1:
        raise bad(name, f"{value}; expected an int >= 1")
    if prompt_len + value > ctx.max_model_len:
        raise bad(name, f"a prompt of {prompt_len} tokens + {name}={value} = {prompt_len + value} "
                  f"tokens > max_model_len={ctx.max_model_len}")
    if ctx.capacity is not None and prompt_len + value > ctx.capacity:
        raise bad(name, f"a prompt of {prompt_len} tokens + {name}={value} = {prompt_len + value} "
                  f"tokens > the {ctx.capacity} tokens the KV page pool holds")
    return value


def _sampling(ctx: ServeContext, req, max_tokens_name: str, max_tokens: int | None,
              prompts: list[list[int]], logprobs: int | None) -> list[SamplingParams]:
    t = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(t) or t < 0:
        raise bad("temperature", f"{req.temperature}; expected a number >= 0 (0 is greedy)")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad("top_p", f"{req.top_p}; expected a number in (0, 1]")
    top_k = req.top_k
    if top_k is not None and top_k < -1:
        raise bad("top_k", f"{top_k}; expected an int >= 1, or -1 or 0 for all tokens")
    top_k = None if top_k in (None, -1, 0) else top_k
    if not 1 <= req.n <= MAX_N:
        raise bad("n", f"{req.n}; expected an int in [1, {MAX_N}]")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise bad("seed", f"{req.seed}; expected a 64-bit integer")
    stop_ids = req.stop_token_ids or []
    for j, t_id in enumerate(stop_ids):
        if not 0 <= t_id < ctx.vocab_size:
            raise bad("stop_token_ids", f"token {j} = {t_id} is outside the vocabulary [0, {ctx.vocab_size})")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad("logprobs" if isinstance(req, CompletionRequest) else "top_logprobs",
                  f"{logprobs}; expected an int in [0, {MAX_LOGPROBS}]")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "only allowed with stream=true")
    return [SamplingParams(max_new_tokens=_max_tokens(ctx, max_tokens_name, max_tokens, len(p)),
                           temperature=float(t), top_k=top_k, top_p=req.top_p, seed=req.seed,
                           stop_token_ids=tuple(stop_ids), ignore_eos=req.ignore_eos, n=req.n,
                           logprobs=logprobs)
            for p in prompts]


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for j, s in enumerate(stops):
        if not s:
            raise bad("stop", f"stop string {j} is empty")
    return tuple(stops)


def _encode(ctx: ServeContext, text: str, name: str, bos: bool) -> list[int]:
    if not text:
        raise bad(name, "empty: a request needs at least one prompt token")
    return ctx.tokenizer.encode(text, add_special_tokens=bos)  # the checkpoint's own special tokens


def prepare_completion(ctx: ServeContext, req: CompletionRequest) -> Prepared:
    check_model(ctx, req.model)
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:
        raise bad("prompt", "empty: a request needs at least one prompt")
    prompts, texts = [], []
    for j, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{j}]"
        if isinstance(item, str):
            prompts.append(_encode(ctx, item, name, bos=True))
            texts.append(item)
        else:
            try:
                prompts.append(check_prompt(item, ctx.vocab_size, name=name))
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="prompt") from None
            texts.append(ctx.tokenizer.decode(prompts[-1]) if req.echo else "")
    if req.echo and req.logprobs is not None:
        raise bad("echo", "echo with logprobs would need the prompt's log-probabilities, which this "
                  "server does not compute; ask for one of them")
    params = _sampling(ctx, req, "max_tokens", req.max_tokens, prompts, req.logprobs)
    return Prepared(prompts, params, req.n, _stops(req.stop), req.logprobs,
                    echo_texts=texts if req.echo else None, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    return_token_ids=req.return_token_ids)


def _message(j: int, m) -> dict:
    msg = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # content parts: the text parts, joined
        parts = []
        for k, part in enumerate(m.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{j}].content[{k}]", f"type {part.get('type')!r}; this server "
                          "takes text parts only")
            parts.append(part["text"])
        msg["content"] = "\n".join(parts)
    return msg


def chat_prompt(ctx: ServeContext, messages, add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of a conversation, through the chat template (400 when there is none)."""
    if ctx.chat_template is None:
        raise bad("messages", f"the model {ctx.model_name!r} has no chat template (no chat_template "
                  "in its tokenizer_config.json, no chat_template.jinja): start the server with "
                  "--chat-template FILE, or use /v1/completions")
    if not messages:
        raise bad("messages", "empty: a chat needs at least one message")
    dicts = [_message(j, m) for j, m in enumerate(messages)]
    try:
        text = ctx.chat_template.render(dicts, add_generation_prompt)
    except ChatTemplateError as e:
        raise bad("messages", str(e)) from None
    return _encode(ctx, text, "messages", bos=False)


def prepare_chat(ctx: ServeContext, req: ChatCompletionRequest) -> Prepared:
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs=true")
    prompt = chat_prompt(ctx, req.messages, req.add_generation_prompt)
    if req.max_completion_tokens is not None:
        name, value = "max_completion_tokens", req.max_completion_tokens
    else:
        name, value = "max_tokens", req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(ctx, req, name, value, [prompt], logprobs)
    return Prepared([prompt], params, req.n, _stops(req.stop), logprobs, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    return_token_ids=req.return_token_ids)


@dataclass(eq=False)
class Choice:
    index: int
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, when asked
    finish_reason: str | None = None


@dataclass
class Event:
    """What one engine output means for one choice: text to send (possibly empty), the tokens and
    log-probabilities it came from, and the finish reason when the choice ends."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


class Run:
    """The engine requests of one HTTP request. `submit()` then `events()`; `close()` (always, in
    a `finally`) aborts whatever is still running, e.g. when the client went away."""

    def __init__(self, ctx: ServeContext, prep: Prepared, arrival: float | None = None):
        self.ctx, self.prep = ctx, prep
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: dict[int, int] = {}  # engine request id -> prompt index
        self.open: dict[int, int] = {}  # engine request id -> completions not finished in the engine
        self.cached_tokens = 0
        self.first_token_at: float | None = None  # when the engine's step that made the first token ended
        tok = ctx.tokenizer
        self.choices = [Choice(j * prep.n + i, IncrementalText(tok, p, prep.stop))
                        for j, p in enumerate(prep.prompts) for i in range(prep.n)]

    def submit(self) -> None:
        ctx = self.ctx
        if ctx.max_waiting is not None and ctx.loop.num_waiting() >= ctx.max_waiting:
            raise APIError(429, f"{ctx.loop.num_waiting()} requests are waiting (--max-waiting="
                           f"{ctx.max_waiting}): retry later", headers={"Retry-After": "1"})
        try:
            for j, (p, params) in enumerate(zip(self.prep.prompts, self.prep.params)):
                rid = ctx.loop.submit(p, params, self.arrival, queue=self.queue)
                self.rids[rid], self.open[rid] = j, params.n
        except EngineDead as e:
            self.close()
            raise APIError(503, str(e)) from None

    def close(self) -> None:
        for rid in self.open:
            self.ctx.loop.abort(rid)
        self.open = {}

    async def events(self) -> AsyncIterator[Event]:
        n = self.prep.n
        while self.open:
            item = await self.queue.get()
            if isinstance(item, EngineDead):
                raise APIError(503, str(item))
            if isinstance(item, BaseException):  # the engine refused the request
                raise APIError(400, str(item), param="prompt")
            out, made_at = item
            if self.first_token_at is None and out.new_token_ids:
                self.first_token_at = made_at
            c = self.choices[self.rids[out.request_id] * n + out.index]
            if out.finished:
                self.open[out.request_id] -= 1
                if not self.open[out.request_id]:
                    del self.open[out.request_id]
                if out.stats is not None and out.index == 0:
                    self.cached_tokens += out.stats.get("cached_tokens") or 0
            if c.finish_reason is not None:  # ended by a stop string: the rest is not its text
                continue
            c.token_ids.extend(out.new_token_ids)
            lps = out.logprobs
            if lps:
                c.logprobs.extend(lps)
            text = c.text.add(out.new_token_ids)
            if c.text.stopped:
                c.finish_reason = "stop"
                if not out.finished:
                    self.ctx.loop.abort(out.request_id, out.index, reason="stop")
            elif out.finished:
                text += c.text.finish()
                c.finish_reason = "stop" if out.finish_reason == "stop" else (
                    "length" if out.finish_reason == "length" else "abort")
            if text or lps or c.finish_reason is not None:
                yield Event(c, text, list(out.new_token_ids), lps, c.finish_reason)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
