"""What a user submits (prompt + `SamplingParams`), what the engine tracks (`Request`) and what it
streams back (`RequestOutput`). Plain data: no tensors but each sampled request's generator."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fms_paged.engine.structured import Grammar

MAX_LOGPROBS = 20  # the most alternatives `SamplingParams.logprobs` may ask for (vLLM's default cap)


def check_prompt(prompt, vocab_size: int, name: str = "prompt") -> list[int]:
    """A prompt as a list of Python ints, or a typed error naming `name` and the offending value
    (not a list of ints, empty, a token outside [0, vocab_size))."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    # the usual prompt, a list of ints in range, checked at C speed (all/min/max); anything else
    # takes the per-token loop, which names the offending token
    if type(prompt) is list and prompt and all(type(t) is int for t in prompt):
        if min(prompt) >= 0 and max(prompt) < vocab_size:
            return list(prompt)
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty: a request needs at least one prompt token")
    ids = []
    for j, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{name} token {j} is {t!r} ({type(t).__name__}); expected int")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} token {j} = {t} is outside the vocabulary [0, {vocab_size})")
        ids.append(int(t))
    return ids


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. `temperature == 0` is greedy; `seed` makes sampling reproducible
    whatever else is in the batch (the request draws from a generator of its own). A request stops
    at `max_new_tokens`, at a token in `stop_token_ids`, or at the model's EOS unless
    `ignore_eos`. `n > 1` gives n completions of the prompt, which share its pages (FORK after one
    prefill); completion i samples as the n = 1 request with seed `seed + i` (`completion(i)`).
    `logprobs=k` (0..MAX_LOGPROBS) returns, for each sampled token, its log-probability and the k
    most likely tokens with theirs (`TokenLogprobs`): raw log-probabilities, the fp32 log-softmax
    of the model's logits before temperature, top-k and top-p (vLLM's default "raw_logprobs").
    `prompt_logprobs=k` returns the same for each prompt token (None for the first, which nothing
    predicts), computed during its prefill (vLLM's `prompt_logprobs`); such a request is computed
    whole, not served from the prefix cache, whose pages carry no logits. `max_new_tokens=0` with
    it scores the prompt and generates nothing (an evaluation harness's log-likelihood).
    `grammar`: the output must match it (`fms_paged.engine.structured.Grammar`: a JSON schema, a
    regex, a choice, an EBNF grammar...); the request ends ("stop") when its grammar is complete.
    Needs an engine given the model's tokenizer.
    `use_beam_search`: beam search of width `n` (`fms_paged.engine.beam`): greedy (temperature
    0, no top-k / top-p), each step keeps the `n` best continuations by cumulative
    log-probability, and the request returns its `n` best finished hypotheses (each output's
    `cumulative_logprob`), ranked by cumulative log-probability / length ** `length_penalty`.
    `early_stopping`: True stops once `n` hypotheses have finished; False (Hugging Face's default)
    or "never" stop when no running beam can beat the worst finished one (HF's heuristics).
    No log-probabilities or grammar with it."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}; expected {expected}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "an int >= 1 (0 with prompt_logprobs: score the prompt only)")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "a finite float >= 0 (0 is greedy)")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise bad("top_k", "an int >= 1 or None")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise bad("top_p", "a float in (0, 1] or None")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an int or None")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not all(is_int(t) and t >= 0 for t in stops):
            raise bad("stop_token_ids", "a sequence of token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"an int in [0, {MAX_LOGPROBS}] or None")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise bad("grammar", "a fms_paged.engine.structured.Grammar or None")
        self._check_beam_search(bad)
        if self.max_new_tokens == 0 and (self.prompt_logprobs is None or self.n != 1):
            raise bad("max_new_tokens", "an int >= 1: 0 generates nothing, which only scoring a prompt "
                      "(prompt_logprobs, n=1) asks for")

    def _check_beam_search(self, bad) -> None:
        """The beam-search settings: a bool switch, a finite length penalty, an early-stopping rule
        of Hugging Face's (True, False, "never"); with beam search, no setting it cannot honour."""
        if not isinstance(self.use_beam_search, bool):
            raise bad("use_beam_search", "a bool")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise bad("length_penalty", "a finite float")
        es = self.early_stopping
        if not (es is True or es is False or es == "never"):
            raise bad("early_stopping", "True, False or 'never'")
        if not self.use_beam_search:
            if lp != 1.0 or self.early_stopping is not False:
                name = "length_penalty" if lp != 1.0 else "early_stopping"
                raise bad(name, "its default without use_beam_search=True (it only ranks beams)")
            return
        for name, ok, expected in (
                ("temperature", self.temperature == 0,
                 "0 with use_beam_search (beams are chosen, not sampled)"),
                ("top_k", self.top_k is None, "None with use_beam_search"),
                ("top_p", self.top_p in (None, 1, 1.0), "None or 1.0 with use_beam_search"),
                ("logprobs", self.logprobs is None,
                 "None with use_beam_search (outputs carry cumulative_logprob)"),
                ("prompt_logprobs", self.prompt_logprobs is None, "None with use_beam_search"),
                ("grammar", self.grammar is None, "None with use_beam_search"),
                ("max_new_tokens", self.max_new_tokens >= 1, "an int >= 1 with use_beam_search")):
            if not ok:
                raise bad(name, expected)

    def completion(self, i: int) -> SamplingParams:
        """The settings of completion `i` of an `n > 1` request: n = 1 and, for a seeded request,
        seed + i, so completion i equals the n = 1 request with that seed."""
        seed = None if self.seed is None else self.seed + i
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one sampled (or prompt) token, and the `k` most likely tokens at its
    position as (token id, log-probability) pairs, most likely first (k = `SamplingParams.logprobs`
    or `prompt_logprobs`). `rank`: a prompt token's rank among all tokens at its position (1: the
    most likely; vLLM's `prompt_logprobs` reports it), None for sampled tokens."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: the tokens new since its last output; with
    `SamplingParams.logprobs`, a `TokenLogprobs` for each of them (else None). The final output of
    a completion (`finished`) carries its statistics (`Request.stats`), None before: the engine
    keeps only aggregates, so a caller that wants per-request figures collects them here."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS / stop token), "length", "abort"
    index: int = 0  # which completion of an n > 1 request
    logprobs: list[TokenLogprobs] | None = None
    stats: dict | None = None
    # with `SamplingParams.prompt_logprobs`, on the request's first output (once): one entry per
    # prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # beam search (`SamplingParams.use_beam_search`): the hypothesis' sum of token log-probabilities
    cumulative_logprob: float | None = None


@dataclass(eq=False)
class Request:
    """A request inside the engine. Its tokens are `prompt + output`; the first `num_computed` of
    them have their K/V in the page pool (recompute after a preemption starts again from 0)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    seq_id: int | None = None  # row of the page table while it holds pages
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    cache_salt: str | None = None  # the prefix cache's extra key: only equal salts share pages
    cache_chain: list[tuple[int, int]] = field(default_factory=list)  # its pages in the prefix cache
    index: int = 0  # completion index (n > 1: completions 1.. wait in `forks` for the prefill)
    n: int = 1  # completions of the request it belongs to
    forks: list[Request] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    scheduled_at: float | None = None  # when it was first scheduled (admitted, or forked)
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at that first scheduling
    # with prompt_logprobs: those of the prompt tokens scored so far (prompt token i + 1 at index
    # i), until its first output carries them (then None); a recompute after a preemption scores
    # only what is missing
    prompt_lps: list[TokenLogprobs] | None = None
    matcher: Any = None  # with `SamplingParams.grammar`: its xgrammar GrammarMatcher
    submitted: SamplingParams | None = None  # completion 0: the settings as submitted (all n)
    beam: Any = None  # beam search: the `fms_paged.engine.beam.BeamGroup` it is a beam of

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def reaches_end(self, n: int) -> bool:
        """Whether computing `n` more tokens computes all its tokens (its next token is sampled)."""
        return self.num_computed + n == self.num_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        return (self.prompt[start:] if start < n else []) + self.output[max(0, start - n) : stop - n]

    def prompt_positions(self, n: int) -> list[int]:
        """Positions whose logits score prompt tokens not scored yet, among the `n` computed next
        (logits at position p predict token p + 1): [] when its prompt's log-probabilities are not
        asked for, or are done."""
        if self.prompt_lps is None:
            return []
        first = max(self.num_computed, len(self.prompt_lps))
        return list(range(first, min(self.num_computed + n, len(self.prompt) - 1)))

    def first_scheduled(self, now: float, cached_tokens: int) -> None:
        """Note its first scheduling (a later one, after a preemption, changes nothing): the end
        of its queue time, and how many prompt tokens the prefix cache served then."""
        if self.scheduled_at is None:
            self.scheduled_at, self.cached_tokens = now, cached_tokens

    def stats(self, reason: str) -> dict:
        """Its final statistics (seconds, as vLLM's benchmarks define them): time to first token
        (from arrival), time per output token after the first (mean), the inter-token latencies
        (each gap), end to end (arrival to the last token), queue (arrival to first scheduled;
        None if never scheduled); token counts, the prompt tokens served by the prefix cache,
        preemptions and `reason`."""
        t = self.token_times
        return {
            "ttft": t[0] - self.arrival if t else None,
            "tpot": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "itl": [b - a for a, b in zip(t, t[1:])],
            "e2e": t[-1] - self.arrival if t else None,
            "queue": None if self.scheduled_at is None else self.scheduled_at - self.arrival,
            "prompt_tokens": len(self.prompt),
            "output_tokens": len(self.output),
            "cached_tokens": self.cached_tokens,
            "preemptions": self.num_preemptions,
            "finish_reason": reason,
        }
