"""An OpenAI request turned into engine submissions (`prepare_*`: every check before anything is
submitted, so a bad request holds nothing), and the engine's outputs turned back into choices
(`Run`): each choice's text through `IncrementalText`, its token ids, log-probabilities and finish
reason, and the usage numbers."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fms_paged.engine import SamplingParams
from fms_paged.engine.request import MAX_LOGPROBS, check_prompt
from fms_paged.engine.structured import Grammar
from fms_paged.serve import tools as tool_calls
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
    tool_format: str | None = None  # the tool-call format the chat template writes (tools.FORMATS)


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
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` (echo's logprobs ride on `logprobs`)
    tool_format: str | None = None  # chats with tools: parse the output's calls in this format
    tools_forced: bool = False  # tool_choice "required" / a name: the whole output is calls

    @property
    def echo_logprobs(self) -> bool:
        """A completion echoing its prompt with log-probabilities: the prompt's come first."""
        return self.echo_texts is not None and self.logprobs is not None


def check_model(ctx: ServeContext, name: str | None) -> None:
    if name is not None and name != ctx.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")


def _max_tokens(ctx: ServeContext, name: str, value: int | None, prompt_len: int, echo: bool = False) -> int:
    room = min(ctx.max_model_len, ctx.capacity or ctx.max_model_len) - prompt_len
    if value is None:
        if room < 1:
            raise bad("prompt", f"a prompt of {prompt_len} tokens leaves no room for output under "
                      f"max_model_len={ctx.max_model_len}")
        return room
    if value == 0 and echo:  # the prompt alone, echoed (and scored)
        return 0
    if value < 1:
        raise bad(name, f"{value}; expected an int >= 1 (0 only with echo)")
    if prompt_len + value > ctx.max_model_len:
        raise bad(name, f"a prompt of {prompt_len} tokens + {name}={value} = {prompt_len + value} "
                  f"tokens > max_model_len={ctx.max_model_len}")
    if ctx.capacity is not None and prompt_len + value > ctx.capacity:
        raise bad(name, f"a prompt of {prompt_len} tokens + {name}={value} = {prompt_len + value} "
                  f"tokens > the {ctx.capacity} tokens the KV page pool holds")
    return value


def _sampling(ctx: ServeContext, req, max_tokens_name: str, max_tokens: int | None,
              prompts: list[list[int]], logprobs: int | None, echo: bool = False,
              grammar: Grammar | None = None) -> list[SamplingParams]:
    # (beam search chooses, it does not sample: its temperature is 0 unless one is given)
    t = (0.0 if req.use_beam_search else 1.0) if req.temperature is None else req.temperature
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
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise bad("prompt_logprobs", f"{req.prompt_logprobs}; expected an int in [0, {MAX_LOGPROBS}]")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "only allowed with stream=true")
    # the prompt's log-probabilities: vLLM's prompt_logprobs, or a completion's echo with logprobs
    scored = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
    grammar = grammar or _grammar(req)
    out = []
    for p in prompts:
        new = _max_tokens(ctx, max_tokens_name, max_tokens, len(p), echo)
        if new == 0 and req.n != 1:
            raise bad("n", f"{req.n}: max_tokens=0 echoes the prompt once; expected n=1")
        try:  # (the beam-search fields and what they cannot go with: SamplingParams names the field)
            out.append(SamplingParams(max_new_tokens=new, temperature=float(t), top_k=top_k, top_p=req.top_p,
                                      seed=req.seed, stop_token_ids=tuple(stop_ids),
                                      ignore_eos=req.ignore_eos, n=req.n, logprobs=logprobs, grammar=grammar,
                                      prompt_logprobs=max(scored) if scored else (0 if new == 0 else None),
                                      use_beam_search=req.use_beam_search, length_penalty=req.length_penalty,
                                      early_stopping=req.early_stopping))
        except ValueError as e:
            field = str(e).split("=")[0].removeprefix("SamplingParams.")
            raise bad(field, str(e)) from None
    return out


def _grammar(req) -> Grammar | None:
    """The grammar a request's output must match, from whichever of OpenAI's `response_format`,
    vLLM's `structured_outputs` and its older `guided_*` fields it gives (400 for two at once, a
    malformed one, or a schema / regex / grammar xgrammar refuses, naming the field)."""
    given = [(name, getattr(req, name)) for name in ("response_format", "structured_outputs", "guided_json",
                                                     "guided_regex", "guided_choice", "guided_grammar")]
    given = [(name, v) for name, v in given if v is not None]
    if len(given) > 1:
        raise bad(given[1][0], f"only one way to constrain the output per request; {given[0][0]} is "
                  "given too")
    if not given:
        return None
    name, value = given[0]
    param, grammar = name, None
    if name == "response_format":
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            grammar = Grammar("json_object")
        elif kind == "json_schema":
            schema = (value.get("json_schema") or {}).get("schema")
            param = "response_format.json_schema.schema"
            if not isinstance(schema, (dict, bool)):
                raise bad(param, f"expected a JSON schema (an object), got {schema!r:.80}")
            grammar = Grammar.json_schema(schema if isinstance(schema, dict) else {})
        else:
            raise bad("response_format.type", f"{kind!r}; expected 'text', 'json_object' or 'json_schema'")
    elif name == "structured_outputs":
        keys = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                if value.get(k) not in (None, False)]
        if len(keys) != 1:
            raise bad("structured_outputs", f"expected exactly one of json, regex, choice, grammar, "
                      f"json_object, structural_tag; got {keys or sorted(value)}")
        key, v = keys[0], value[keys[0]]
        param = f"structured_outputs.{key}"
        grammar = _grammar_of(param, {"json": "json_schema", "regex": "regex", "choice": "choice",
                                      "grammar": "ebnf", "json_object": "json_object",
                                      "structural_tag": "structural_tag"}[key], v)
    else:
        grammar = _grammar_of(name, {"guided_json": "json_schema", "guided_regex": "regex",
                                     "guided_choice": "choice", "guided_grammar": "ebnf"}[name], value)
    try:
        grammar.check()
    except ValueError as e:
        raise bad(param, str(e)) from None
    return grammar


def _grammar_of(param: str, kind: str, value) -> Grammar:
    if kind == "json_object":
        return Grammar("json_object")
    if kind in ("json_schema", "structural_tag"):
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise bad(param, f"expected a JSON object or its text, got {type(value).__name__}")
        return Grammar(kind, value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(param, f"expected a non-empty list of non-empty strings, got {value!r:.80}")
        return Grammar.choice(value)
    if not isinstance(value, str) or not value:
        raise bad(param, f"expected a non-empty string, got {value!r:.80}")
    return Grammar(kind, value)


def _stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for j, s in enumerate(stops):
        if not s:
            raise bad("stop", f"stop string {j} is empty")
    return tuple(stops)


def _encode(ctx: ServeContext, text: str, name: str, bos: bool) -> list[int]:
    if not text:
        raise bad(name, "empty: a request needs at least one prompt token")
    return ctx.tokenizer.encode(text, add_special_tokens=bos)  # bos=True: the checkpoint's own BOS/EOS


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
    params = _sampling(ctx, req, "max_tokens", req.max_tokens, prompts, req.logprobs, echo=req.echo)
    return Prepared(prompts, params, req.n, _stops(req.stop), req.logprobs,
                    echo_texts=texts if req.echo else None, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    return_token_ids=req.return_token_ids, prompt_logprobs=req.prompt_logprobs)


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


def chat_prompt(ctx: ServeContext, messages, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> list[int]:
    """The prompt ids of a conversation (and its tools), through the chat template (400 when
    there is none)."""
    if ctx.chat_template is None:
        raise bad("messages", f"the model {ctx.model_name!r} has no chat template (no chat_template "
                  "in its tokenizer_config.json, no chat_template.jinja): start the server with "
                  "--chat-template FILE, or use /v1/completions")
    if not messages:
        raise bad("messages", "empty: a chat needs at least one message")
    dicts = tool_calls.template_messages([_message(j, m) for j, m in enumerate(messages)])
    try:
        text = ctx.chat_template.render(dicts, add_generation_prompt, tools)
    except ChatTemplateError as e:
        raise bad("messages", str(e)) from None
    return _encode(ctx, text, "messages", bos=False)


def _tools(ctx: ServeContext, req: ChatCompletionRequest) -> tuple[list[dict] | None, str, Grammar | None]:
    """A chat's tools (checked), its tool_choice, and the grammar that forces the calls."""
    tools = None if req.tools is None else tool_calls.check_tools(req.tools)
    choice = tool_calls.tool_choice(req.tool_choice, tools)
    if choice == "none":
        return tools, choice, None
    if ctx.tool_format is None:
        raise bad("tools", f"the chat template of {ctx.model_name!r} writes no tool calls this server "
                  "can parse: start it with --tool-call-parser hermes|llama3_json (and a "
                  "--chat-template that renders `tools`)")
    grammar = tool_calls.grammar(ctx.tool_format, tools, choice, req.parallel_tool_calls)
    if grammar is not None:
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar") if getattr(req, name) is not None]
        if given:
            raise bad("tool_choice", f"{req.tool_choice!r:.80} constrains the output to tool calls; "
                      f"{given[0]} is given too")
        try:
            grammar.check()
        except ValueError as e:
            raise bad("tools", f"a function's parameters are not a JSON schema the grammar library "
                      f"takes: {e}") from None
    return tools, choice, grammar


def prepare_chat(ctx: ServeContext, req: ChatCompletionRequest) -> Prepared:
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs=true")
    tools, choice, grammar = _tools(ctx, req)
    prompt = chat_prompt(ctx, req.messages, req.add_generation_prompt, tools)
    if req.max_completion_tokens is not None:
        name, value = "max_completion_tokens", req.max_completion_tokens
    else:
        name, value = "max_tokens", req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(ctx, req, name, value, [prompt], logprobs, grammar=grammar)
    return Prepared([prompt], params, req.n, _stops(req.stop), logprobs, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    return_token_ids=req.return_token_ids, prompt_logprobs=req.prompt_logprobs,
                    tool_format=ctx.tool_format if tools and choice != "none" else None,
                    tools_forced=grammar is not None)


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
        # each prompt's log-probabilities once they come (on its first output), when asked for
        self.prompt_logprobs: list[list | None] = [None] * len(prep.prompts)
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
            if out.prompt_logprobs is not None:
                self.prompt_logprobs[self.rids[out.request_id]] = out.prompt_logprobs
            c = self.choices[self.rids[out.request_id] * n + out.index]
            if out.finished:
                self.open[out.request_id] -= 1
                if not self.open[out.request_id]:
                    del self.open[out.request_id]
                if out.stats is not None and out.index == 0:
                    self.cached_tokens += out.stats.get("cached_tokens") or 0
            if c.finish_reason is not None:  # ended by a stop string: the rest is not its text
                continue
            # token by token: a stop string ends the tokens where it completes (an output carries
            # several from speculative decoding; those after it are not the completion's)
            ids, text = list(out.new_token_ids), ""
            for j in range(len(ids)):
                text += c.text.add(ids[j : j + 1])
                if c.text.stopped:
                    del ids[j + 1 :]
                    break
            c.token_ids.extend(ids)
            lps = out.logprobs
            if lps:
                c.logprobs.extend(lps)
            if c.text.stopped:
                c.finish_reason = "stop"
                if not out.finished:
                    self.ctx.loop.abort(out.request_id, out.index, reason="stop")
            elif out.finished:
                text += c.text.finish()
                c.finish_reason = "stop" if out.finish_reason == "stop" else (
                    "length" if out.finish_reason == "length" else "abort")
            if text or lps or c.finish_reason is not None:
                yield Event(c, text, ids, lps, c.finish_reason)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
