"""Speculative decoding (`Engine(speculative={"method": "ngram", ...})`, vLLM's config names): a
decoding request proposes k tokens, and the target model verifies them all in one forward over the
lookahead slots. Prompt lookup ("ngram") proposes the tokens that followed the last earlier
occurrence of its last n-gram in its own tokens (prompt + output); "draft_model" has a smaller
model of the same vocabulary propose them greedily on pages of its own (`fms_paged.engine.draft`).

How a step runs, piece by piece:
- Plan (`Speculator.plan`, called by `Scheduler.schedule` after admission, host only): each
  decoding request that may speculate (no log-probabilities, no grammar) gets its proposals, as
  many as the step's token budget, the free pages and its `max_new_tokens` leave. Its RESERVE then
  covers its new token plus the proposals (k + 1 slots), and the plan lists it in
  `SchedulerOutput.verifies` instead of `decodes`.
- Verify (`ModelRunner.run`): the new token and the proposals run as a short chunk on the
  request's pages, beside the step's other rows, and the logits of all k + 1 positions come back;
  `verify` decides what is kept: for a greedy request the longest prefix of proposals equal to the
  target's argmax, then the target's own next token (exactly the tokens of non-speculative greedy
  decoding); for a sampled request, rejection sampling (`verify`'s docstring), which keeps the
  target's distribution.
- Update (`Scheduler.update`): the kept tokens are appended one by one with the usual stop checks
  (EOS, stop tokens, max_new_tokens truncate mid-proposal as they would without speculation), then
  the request's length rolls back to the tokens whose keys are valid (`PageManager.truncate`):
  pages wholly past it go back to the pool, and the next step overwrites a partial page's tail.
- How many to propose (`Speculator.plan`, `proposal_length`): each request proposes the k that
  maximizes its expected tokens per step second. A verify of k proposals gives 1 + a + a^2 + ...
  + a^k tokens for a per-proposal acceptance a (the request's recent verifies' kept / (kept +
  rejections), decayed, from a prior of 1/2), and costs (fixed + per_row * k) plain decode steps
  (`StepCost`: the engine's recent decode and verify steps, timed; on the default fp32 model a
  verify costs ~1.5 decode steps plus ~1/8 of one per proposal, on a 135M bf16 model ~1 and
  ~1/50). Where no k pays (k = 0), the request decodes plainly for a back-off (1, 2, 4, ... up to
  `MAX_BACKOFF` decode steps) and then probes with one proposal; a request whose last n-gram has
  no earlier match proposes nothing and decodes as usual. A seeded request weighs k by the prior
  costs (`PRIOR_VERIFY_COST`), not the timed ones: its proposals, and so its tokens, do not depend
  on the machine's timing.
- Inside the lookahead call (prompt lookup, where the runner runs greedy decode steps in one call):
  a plan whose rows all decode greedily with nothing waiting takes lookahead steps instead of
  verifies between steps (`Scheduler.lookahead`), and `lookup_plan` gives each row its cap on
  proposals a step (the same choice of k, against the costs of the call's own steps, which carry
  no host work: `lookup_cost`) and its tokens; `Kernel.decode_lookup` proposes, verifies and keeps
  inside the call, and `observe_lookup` takes back its acceptance and step timings.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from fms_paged.engine.sampling import greedy, probabilities
from fms_paged.native.gemm import GEMV_MAX_ROWS

METHODS = ("ngram", "draft_model")
# the most decode steps a request that finds no proposal length worth its rows waits before probing
MAX_BACKOFF = 64
# a verify's per-proposal acceptance before any is measured, and the weight of its prior (pseudo
# counts of kept and rejected proposals); a request's counts decay by DECAY per verify, so that its
# acceptance follows the text it is in now
PRIOR_ACCEPTANCE, PRIOR_WEIGHT, DECAY = 0.5, 2.0, 0.7
# a verify step's seconds against a plain decode step's of the same rows before the engine has
# timed both, and always for seeded requests (deterministic proposals): (fixed, per proposal)
PRIOR_VERIFY_COST = (1.3, 0.1)
# the same for a step inside a lookahead call (`Speculator.lookup_plan`), where a verify costs no
# host work: its proposals' rows alone
PRIOR_LOOKUP_COST = (1.0, 0.15)
# where prompt lookup may verify inside lookahead calls or between steps, the engine measures
# each one's seconds per token (`Speculator.rate`) and takes the faster: a mode is kept for BLOCK
# choices (its first step, which catches up on the other's tokens, not measured), and every
# EXPLORE-th block tries the other. Which pays depends on the model and the CPU: the default fp32
# model's step is ~0.35 ms, of which a call saves the host work between steps; a bf16 135M
# model's step is ~9 ms, and a verify between steps of 9 rows takes the GEMM at about one step,
# where a call's steps stay within the GEMV's 8 rows, whose bf16 rows past ~4 cost more each
BLOCK, EXPLORE = 8, 8


def proposal_length(acceptance: float, cost: tuple[float, float] | list[float], k_max: int) -> int:
    """The number of proposals k in 0 .. k_max that maximizes the expected tokens per step second
    E(k) / cost(k): E(k) = 1 + a + ... + a^k, the tokens a verify of k proposals gives when each
    is kept with probability a (acceptance) once those before it were (a geometric run, as in the
    speculative decoding papers' analysis); cost(k), a verify step's seconds against a plain decode
    step's: fixed + per_row * k for cost = (fixed, per_row) (`StepCost.verify_cost`), or cost[k]
    for a list (`StepCost.verify_costs`: each row count's own, where a kernel's path changes with
    the rows). 0: no k pays for its cost (a plain decode step: 1 token for 1)."""
    best, best_gain, tokens, term = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= acceptance
        tokens += term
        gain = tokens / (cost[k] if isinstance(cost, list) else cost[0] + cost[1] * k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


class StepCost:
    """Seconds of the engine's steps that run no prefill, by kind (plain decode, a lookahead call's
    seconds per step, or with verifies)
    and rows (decode rows plus every verified row): each row count's seconds averaged over recent
    steps (the lower of its first two, then exponentially with an outlier clipped at 4x: a first
    step of a shape may pay a one-time cost), and a verify step's seconds as a line in its rows
    (least squares over the row counts seen, refitted every `REFIT` verify steps and when a row
    count's first two timings come in)."""

    SMOOTHING, REFIT = 0.2, 8

    def __init__(self):
        self._mean: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._seen: dict[tuple[bool, int], int] = {}
        self._line: tuple[float, float] | None = None  # verify seconds = a + b * rows
        self._since = 0

    def observe(self, verifying: bool, rows: int, seconds: float) -> None:
        means, key = self._mean[verifying], (verifying, rows)
        n = self._seen[key] = self._seen.get(key, 0) + 1
        m = means.get(rows)
        means[rows] = seconds if m is None else min(m, seconds) if n == 2 else m + self.SMOOTHING * (
            min(seconds, 4 * m) - m)
        self._since += verifying
        if verifying and (n <= 2 or self._since >= self.REFIT):  # (a new or corrected row count: now)
            self._line, self._since = self._fit(), 0

    def _fit(self) -> tuple[float, float] | None:
        pts = self._mean[True]
        if len(pts) < 2:
            return None
        n = len(pts)
        mx, my = sum(pts) / n, sum(pts.values()) / n
        sxx = sum((x - mx) ** 2 for x in pts)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in pts.items()) / sxx)
        return my - b * mx, b

    def verify_cost(self, rows: int) -> tuple[float, float] | None:
        """A step of `rows` plain decode rows plus k verified rows costs about (fixed + per_row *
        k) plain decode steps of `rows` rows -> (fixed, per_row), or None until a plain step of that
        many rows and verify steps of two row counts were timed."""
        plain = self._mean[False].get(rows)
        if self._line is None or not plain:
            return None
        a, b = self._line
        return max(1.0, (a + b * rows) / plain), b / plain

    def verify_costs(self, rows: int, k_max: int) -> list[float] | None:
        """A step of `rows` plain decode rows plus k verified rows costs about cost[k] plain decode
        steps of `rows` rows, k = 0 .. k_max -> cost: each row count's own mean where timed (a
        kernel's cost need not be a line in the rows: a bf16 GEMV's extra rows are all but free up
        to ~4, then cost more each), the line elsewhere, at least 1; None as `verify_cost`."""
        line = self.verify_cost(rows)
        if line is None:
            return None
        plain, timed = self._mean[False][rows], self._mean[True]
        return [1.0] + [max(1.0, timed[rows + k] / plain) if rows + k in timed else line[0] + line[1] * k
                        for k in range(1, k_max + 1)]


class SpeculativeConfigError(ValueError):
    """A bad `speculative` setting: names the key, the value and what was expected."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup) or "draft_model" (a smaller model of the same tokenizer,
    `fms_paged.engine.draft`). num_speculative_tokens: k, the most tokens proposed per step.
    prompt_lookup_max / prompt_lookup_min (ngram): the longest and shortest n-gram looked up (the
    longest with a match wins); one alone sets both, neither: 5 (vLLM's default). model
    (draft_model, required): the draft, a model object (`attn_impl="paged"`) or a checkpoint path
    that `get_model` loads (paged, on the target's device and dtype)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: object = None

    @classmethod
    def parse(cls, spec) -> SpeculativeConfig | None:
        """A dict (vLLM's `speculative_config` keys), a config, or None (no speculation)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise SpeculativeConfigError(
                f"speculative={spec!r}; expected a dict such as {{'method': 'ngram', "
                "'num_speculative_tokens': 4, 'prompt_lookup_max': 4}} or None")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative: unknown key(s) {unknown}; "
                                         f"expected some of {sorted(known)}")
        method = spec.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative method={method!r}; expected one of {METHODS}")

        def count(key: str, value, lowest: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise SpeculativeConfigError(f"speculative {key}={value!r}; expected an int >= {lowest}")
            return value

        if "num_speculative_tokens" not in spec:
            raise SpeculativeConfigError("speculative: num_speculative_tokens is required (the most "
                                         "tokens proposed per step, an int >= 1)")
        k = count("num_speculative_tokens", spec["num_speculative_tokens"])
        if method == "draft_model":
            extra = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(spec))
            if extra:
                raise SpeculativeConfigError(f"speculative {extra} apply to method 'ngram', "
                                             "not 'draft_model'")
            draft = spec.get("model")
            if draft is None or not (isinstance(draft, (str, os.PathLike)) or hasattr(draft, "config")):
                raise SpeculativeConfigError(f"speculative model={draft!r}; expected the draft model (a "
                                             "model object or a checkpoint path) for method 'draft_model'")
            return cls(method, k, model=draft)
        if "model" in spec:
            raise SpeculativeConfigError("speculative model applies to method 'draft_model', not 'ngram'")
        hi, lo = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        hi = count("prompt_lookup_max", hi) if hi is not None else None
        lo = count("prompt_lookup_min", lo) if lo is not None else None
        hi, lo = (hi or lo or 5), (lo or hi or 5)
        if lo > hi:
            raise SpeculativeConfigError(f"speculative prompt_lookup_min={lo} > prompt_lookup_max={hi}; "
                                         "expected min <= max")
        return cls(method, k, hi, lo)


def ngram_propose(tokens, k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, the last earlier occurrence of the sequence's
    last n tokens that some token follows; -> up to k tokens that followed it ([] when no n-gram
    matches). tokens: the sequence (prompt + output)."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.size
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = arr[L - n:]
        # windows starting at 0 .. L - n - 1: each is followed by a token, none is the tail itself
        starts = np.flatnonzero(arr[: L - n] == tail[0])
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[arr[starts + j] == tail[j]]
        if starts.size:
            i = int(starts[-1]) + n
            return arr[i : i + k].tolist()
    return []


class NgramIndex:
    """`ngram_propose` for a sequence that only grows, in O(1) per step: for each n in
    [n_min, n_max], the last start of every n-gram that some token follows, updated with the
    tokens appended since the last call (a per-step scan of the whole sequence costs ~30 us at 300
    tokens, ~170 us at 3,000 on a 2-vCPU CPU: a fifth of a small model's decode step)."""

    def __init__(self, n_max: int, n_min: int):
        self.sizes = range(n_max, n_min - 1, -1)
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.upto = 0  # windows ending before this position (each followed by a token) are indexed

    def propose(self, req, k: int) -> list[int]:
        """Up to k tokens that followed the last earlier occurrence of `req`'s last n-gram
        (prompt + output), the longest n that matches; [] when none."""
        L = req.num_tokens
        if L - 1 > self.upto:  # index the windows that end at upto .. L - 2
            lo = max(0, self.upto - max(self.sizes) + 1)
            toks = req.token_slice(lo, L - 1)
            for e in range(self.upto, L - 1):
                for n in self.sizes:
                    if e - n + 1 >= 0:
                        self.last[n][tuple(toks[e - n + 1 - lo : e + 1 - lo])] = e - n + 1
            self.upto = L - 1
        tail = req.token_slice(max(0, L - max(self.sizes)), L)
        for n in self.sizes:
            if n >= L:
                continue
            i = self.last[n].get(tuple(tail[len(tail) - n:]))
            if i is not None:
                return req.token_slice(i + n, min(i + n + k, L))
        return []


@dataclass
class LookupPlan:
    """Prompt lookup inside a lookahead call (`Kernel.decode_lookup`): each request's most
    proposals a step (caps) and its tokens (history: prompt + output), the n-gram sizes looked up,
    and the most rows a step (its rows and proposals: the decode projections' GEMV rows, past
    which a step takes the GEMM path and costs several)."""

    caps: list[int]
    history: list[np.ndarray]
    n_max: int
    n_min: int
    max_rows: int


@dataclass
class _State:
    """A request's speculation state: its n-gram index, its decayed counts of kept and rejected
    proposals, its back-off, and its tokens as an array (`history`, for the lookahead call's
    prompt lookup)."""

    index: NgramIndex
    kept: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    rejected: float = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    skip: int = 0  # decode steps (lookahead calls) left without speculation
    wait: int = 1  # the next back-off's length
    probe: bool = False  # a back-off ended: the next step proposes one token even so
    tokens: np.ndarray | None = None  # prompt + output so far (the first `held` entries)
    held: int = 0

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)

    def proposals(self, cost: tuple[float, float], k_max: int) -> int:
        """How many tokens to propose now (0: none), by `proposal_length` for this request's
        acceptance and `cost`; where none pays, a back-off (1, 2, 4, ... up to `MAX_BACKOFF`
        steps) and then a probe with one proposal. A call counts as one step of the back-off."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        k = proposal_length(self.acceptance, cost, k_max)
        if k == 0 and not self.probe:  # back off, then probe with one proposal
            self.skip, self.wait, self.probe = self.wait, min(2 * self.wait, MAX_BACKOFF), True
            return 0
        self.probe = False
        return max(k, 1)

    def history(self, req) -> np.ndarray:
        """`req`'s tokens (prompt + output) as int64, appended to since the last call (a copy of
        a long prompt once, not at every call)."""
        n = req.num_tokens
        if self.tokens is None or self.tokens.size < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if self.held:
                grown[: self.held] = self.tokens[: self.held]
            self.tokens = grown
        if self.held < n:
            self.tokens[self.held : n] = req.token_slice(self.held, n)
            self.held = n
        return self.tokens[:n]

    def observe(self, verifies: int, accepted: int, rejections: int) -> None:
        """`verifies` verifies kept `accepted` proposals, `rejections` of them rejected one: the
        decayed counts (each verify decays them by DECAY) and the back-off."""
        decay = DECAY ** verifies
        self.kept = decay * self.kept + accepted
        self.rejected = decay * self.rejected + rejections
        if accepted:
            self.wait = max(1, self.wait // 2)


class Speculator:
    """Plans each step's proposals (`plan`) and counts what verification kept (`observe`,
    `metrics`). Per-request back-off state lives in a weak table: it goes with its request."""

    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config = config
        self.draft = draft  # method "draft_model": its `fms_paged.engine.draft.DraftModel`
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.cost = StepCost()
        self.lookup_cost = StepCost()  # the steps inside lookahead calls (`observe_lookup`)
        # seconds per token of speculating steps, inside lookahead calls (True) or between
        # steps (False), recent means (`rate`), and the choices made between them (`in_call_now`)
        self._rate: dict[bool, float | None] = {True: None, False: None}
        self._blocks = self._left = 0  # blocks of choices begun; choices left in this one
        self._mode = self._fresh = False  # this block's mode; its first step not measured yet
        self.reset_totals()

    @property
    def in_call(self) -> bool:
        """Whether proposals can be made and verified inside a lookahead call (prompt lookup:
        `Kernel.decode_lookup`); a draft model proposes between steps."""
        return self.config.method == "ngram"

    def in_call_now(self) -> bool:
        """For a plan that may take lookahead steps: whether to speculate inside the call (else
        between steps, `plan`): blocks of `BLOCK` choices, each in the mode of fewer seconds per
        token so far (each tried first, inside the call first), every `EXPLORE`-th in the other."""
        if not self.in_call:
            return False
        if self._left <= 0:
            self._blocks += 1
            inside, between = self._rate[True], self._rate[False]
            if inside is None or between is None:
                self._mode = inside is None
            else:
                self._mode = (inside <= between) != (self._blocks % EXPLORE == 0)
            self._left, self._fresh = BLOCK, True
        self._left -= 1
        return self._mode

    def rate(self, in_call: bool, seconds: float, tokens: int) -> None:
        """A speculating step (inside a lookahead call, or verifying between steps) gave `tokens`
        tokens in `seconds`: its mode's recent seconds per token (`in_call_now`); a block's first
        step is not measured (it catches up on the other mode's tokens: the n-gram index)."""
        if self._fresh:
            self._fresh = False
            return
        if tokens > 0:
            m, x = self._rate[in_call], seconds / tokens
            self._rate[in_call] = x if m is None else m + 0.2 * (x - m)

    def _state_of(self, req) -> _State:
        state = self._state.get(req)
        if state is None:
            c = self.config
            state = self._state[req] = _State(NgramIndex(c.prompt_lookup_max, c.prompt_lookup_min))
        return state

    def lookup_plan(self, reqs, steps: int) -> LookupPlan | None:
        """Prompt lookup inside a lookahead call of `steps` steps of `reqs` (the rows of a greedy
        all-decode plan; `Kernel.decode_lookup` proposes and verifies inside the call): each
        request's most proposals a step, by its acceptance and the timed costs of the calls' steps
        (`lookup_cost`), and its tokens -> the plan, or None where none proposes."""
        c = self.config
        k_max = min(c.num_speculative_tokens, steps - 1)
        if k_max <= 0:
            return None
        cost = self.lookup_cost.verify_costs(len(reqs), k_max) or PRIOR_LOOKUP_COST
        caps = [self._state_of(r).proposals(cost, k_max) if self.eligible(r) else 0 for r in reqs]
        if not any(caps):
            return None
        return LookupPlan(caps, [self._state_of(r).history(r) for r in reqs], c.prompt_lookup_max,
                          c.prompt_lookup_min, max(len(reqs), GEMV_MAX_ROWS))

    def observe_lookup(self, reqs, stats: list[list[int]], steps: list[list[float]]) -> None:
        """A lookahead call with prompt lookup ran: stats, per request [verifying steps, proposed,
        kept, rejecting steps]; steps, per step [rows, rows with proposals, seconds] (`lookup_cost`)."""
        for r, (v, p, a, rej) in zip(reqs, stats):
            if v:
                self.num_verifies += v
                self.num_in_call += v
                self.num_proposed += p
                self.num_accepted += a
                self._state_of(r).observe(v, a, rej)
        for rows, total, seconds in steps:
            self.lookup_cost.observe(total > rows, int(total), seconds)

    def reset_totals(self) -> None:
        self.num_verifies = self.num_proposed = self.num_accepted = self.num_in_call = 0

    def eligible(self, req) -> bool:
        """Whether a decoding request may speculate: no log-probabilities and no grammar (their
        per-token outputs come from the one-token path), no completions
        waiting to fork from its first token, and no beam (a beam group steps by its candidates)."""
        p = req.params
        return (p.logprobs is None and req.matcher is None and req.prompt_lps is None and not req.forks
                and req.beam is None)

    def plan(self, plan, pm, budget: int, pages: int) -> int:
        """Give the decoding requests of `plan.scheduled` their proposals (`plan.verifies`), within
        `budget` tokens and `pages` free pages left for this step -> the pages they take. The
        caller's RESERVE covers each one's k + 1 slots. With a draft model, the requests and their
        k are chosen first (a greedy draft proposes exactly k), then the draft proposes for all of
        them in one batch."""
        c, taken = self.config, 0
        asks = []  # (draft_model) requests and their k
        timed = None  # the step's timed cost, looked up once a request may propose (most steps of a
        # request backing off, or sampling free text, have none that may)
        for r, n in plan.scheduled:
            if budget <= 0:
                break
            if n != 1 or not r.reaches_end(1) or not self.eligible(r):
                continue
            state = self._state_of(r)
            k_max = min(c.num_speculative_tokens, budget, r.params.max_new_tokens - len(r.output) - 1)
            if state.skip <= 0 and k_max <= 0:
                continue
            if timed is None and state.skip <= 0 and r.generator is None:
                timed = self.cost.verify_cost(sum(n for _, n in plan.scheduled)) or PRIOR_VERIFY_COST
            k = state.proposals(timed if r.generator is None else PRIOR_VERIFY_COST, k_max)
            if k == 0:
                continue
            if self.draft is not None:  # (it proposes k: the pages of k slots)
                base = r.num_computed + 1
                need = pm.pages_needed(r.seq_id, base + k) - pm.pages_needed(r.seq_id, base)
                if need > pages:
                    continue
                asks.append((r, k))
                budget, pages, taken = budget - k, pages - need, taken + need
                continue
            props = state.index.propose(r, k)
            if not props:
                continue
            base = r.num_computed + 1
            need = pm.pages_needed(r.seq_id, base + len(props)) - pm.pages_needed(r.seq_id, base)
            if need > pages:
                continue
            plan.verifies.append((r, props))
            budget, pages, taken = budget - len(props), pages - need, taken + need
        if asks:
            plan.verifies += list(zip((r for r, _ in asks), self.draft.propose(asks)))
        return taken

    def release(self, req) -> None:
        """The request gave its row back (finished, aborted, preempted): so does its draft row."""
        if self.draft is not None:
            self.draft.release(req)

    def observe(self, req, proposed: int, accepted: int) -> None:
        """A verify of `req` kept `accepted` of its `proposed` tokens: totals, its acceptance (each
        kept proposal a success; the first rejected one, if any, a failure) and its back-off."""
        self.num_verifies += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        self._state[req].observe(1, accepted, int(accepted < proposed))

    def timed(self, plan, seconds: float) -> None:
        """An engine step of `plan` took `seconds` (its schedule, forward and booking): a decode
        or verify step (no prefill) joins the step costs. Lookahead decode steps count per step:
        where they run (`Engine(decode_steps=)`), a verify competes with them, not with one-token
        steps."""
        if plan.scheduled and not plan.prefills:
            rows = len(plan.decodes) + sum(len(p) + 1 for _, p in plan.verifies)
            self.cost.observe(bool(plan.verifies), rows, seconds / plan.steps)

    def metrics(self) -> dict:
        """Acceptance rate (accepted / proposed tokens) and the mean accepted proposals per verify
        (the target's own token comes on top of them: `spec_mean_tokens_per_verify`); of the
        verifies, those inside lookahead calls (`spec_verifies_in_call`)."""
        v, p, a = self.num_verifies, self.num_proposed, self.num_accepted
        return {
            "spec_verifies": v,
            "spec_verifies_in_call": self.num_in_call,
            "spec_proposed_tokens": p,
            "spec_accepted_tokens": a,
            "spec_acceptance_rate": a / p if p else None,
            "spec_mean_accepted_length": a / v if v else None,
            "spec_mean_tokens_per_verify": (a + v) / v if v else None,
        }


def verify(logits: torch.Tensor, verifies) -> list[list[int]]:
    """logits: [sum(k_i + 1), V], the target's logits at each verified request's k_i + 1 positions
    (its last token, then its proposals), in `verifies` order ((request, proposals) pairs) -> the
    tokens each request keeps: its accepted proposals, then one token of the target's.

    Greedy requests: the proposals equal to the target's argmax, up to the first that is not,
    then the argmax there (or after the last proposal): the tokens greedy decoding makes.
    Sampled requests: standard speculative rejection sampling with the target's distribution p
    (`sampling.probabilities`: temperature, top-k, top-p) and prompt lookup's proposal
    distribution q, a point mass on the proposed token x: x is accepted with probability
    min(1, p(x) / q(x)) = p(x); at the first rejection the token is drawn from
    normalize(max(0, p - q)), which is p without x; when all are accepted, the next token is
    drawn from p after the last. Each token is then distributed as p. A seeded request draws its
    k uniforms, then one token, from its own generator: the same proposals give the same tokens.
    One host sync for the greedy rows and one per sampled request."""
    out: list[list[int]] = [[] for _ in verifies]
    offsets = list(itertools.accumulate((len(p) + 1 for _, p in verifies), initial=0))
    if any(r.params.temperature == 0 for r, _ in verifies):
        best = greedy(logits).tolist()  # (every row: fewer calls than picking the greedy ones)
        for i, (r, props) in enumerate(verifies):
            if r.params.temperature != 0:
                continue
            target = best[offsets[i] : offsets[i + 1]]
            a = 0
            while a < len(props) and props[a] == target[a]:
                a += 1
            out[i] = props[:a] + [target[a]]
    for i, (r, props) in enumerate(verifies):
        if r.params.temperature == 0:
            continue
        p = probabilities(logits[offsets[i] : offsets[i + 1]], r.params.temperature, r.params.top_k,
                          r.params.top_p)  # [k + 1, V]
        k, g = len(props), r.generator
        x = torch.tensor(props, device=p.device)
        px = p[:k].gather(1, x[:, None]).squeeze(1)  # [k]
        u = torch.rand(k, generator=g, device=p.device) if g is not None else torch.rand(k, device=p.device)
        rejected = (u >= px).nonzero()
        a = int(rejected[0, 0]) if rejected.numel() else k
        row = p[a]
        if a < k:  # the residual max(0, p - q): p without the proposed token
            row = row.clone()
            row[props[a]] = 0.0
        tok = int(torch.multinomial(row[None], 1, generator=g)[0, 0])
        out[i] = props[:a] + [tok]
    return out
