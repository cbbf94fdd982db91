"""Which requests run in the next forward, with how many tokens, and what their results do
(vLLM v1's scheduler shape: `schedule()` before the forward, `update()` after it).

Host only: no tensors. Each step gets a token budget (`max_num_batched_tokens`):
1. Running requests first: the decoding ones (1 token each), then those still prefilling (a long
   prompt, or a recompute after preemption: the next chunk that fits the budget). When the
   pool cannot give a request the pages for its tokens, the newest running request is preempted:
   its pages are freed and it goes back to the head of the waiting queue, to be recomputed later
   from its prompt and the tokens it has generated so far (its output does not change).
2. Then waiting requests, first come first served, while a row, the budget and the free pages
   (keeping a small watermark of headroom for the running ones) allow; none after a preemption.
Prompts longer than what is left of the budget are prefilled in chunks, in the same forward as the
decodes of running requests, so a long prompt never stalls them.

0. When every layer of the model is windowed (`horizon`: the widest window), or its pages are held
   per layer group with sliding groups among them (`fms_paged.kv.page_groups`), the pages of each
   running request that lie wholly before the first position its next query sees (in each sliding
   group) are released first (they go back to the pool, or stay with the prefix cache, evictable).
3. The other completions of an `n > 1` request whose prompt this step finishes FORK its pages
   while rows are free (they sample their first token from its logits), else wait in the queue.
4. With `decode_steps > 1`, where the model runner runs several decode steps in one call
   (`lookahead_ready`), a greedy all-decode plan is extended to several steps (`lookahead`).
The scheduler decides from host counts alone (`PageManager.pages_needed` for a running request,
`pages_to_admit` for an admission: the page manager's one rule of page growth; `num_free_pages`), then
RESERVEs exactly what it planned, which cannot fail: it is the one owner of the page table (RESERVE
in `schedule()`, FORK and ERASE in `update()` and `finish()`), and the plan carries what the
reservation handed out (`SchedulerOutput.reservation`: the pages to prepare, the copy-on-write
copies) to the model runner, which only reads the table.

`update(plan, tokens, logprobs)` books the forward's results: tokens computed, full pages into the
prefix cache, forks, each sampled token appended and checked against its request's stop
conditions, finished requests dropped (their pages go back at once), their final output carrying
their statistics. The scheduler keeps no request past its end: `waiting` and `running` hold only
live requests, the counters are totals.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fms_paged.engine import beam
from fms_paged.engine.prefix_cache import PrefixCache
from fms_paged.engine.request import Request, RequestOutput, Status, TokenLogprobs
from fms_paged.engine.speculative import LookupPlan, Speculator
from fms_paged.kv.page_groups import GroupedPages
from fms_paged.kv.page_manager import PageManager, Reservation


@dataclass
class SchedulerOutput:
    """One step's plan. The forward's logits rows are `decodes`, then the chunks of `prefills`
    that reach their request's last token (and sample), then the prompt positions of `scored`;
    `sampled` lists (request, logits row) for each token to sample, forked completions reading
    their parent's row."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # one token: the last one left to compute
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    sampled: list[tuple[Request, int]] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, child) to FORK
    # what this step's RESERVE handed out: pages to prepare and copy-on-write copies to run
    reservation: Reservation = field(default_factory=Reservation)
    # prompt log-probabilities: (request, positions of its chunk whose logits score its prompt)
    scored: list[tuple[Request, list[int]]] = field(default_factory=list)
    # requests whose prompt completes now and that generate nothing (max_new_tokens=0)
    scored_only: list[Request] = field(default_factory=list)
    steps: int = 1  # greedy decode steps of `decodes` in this forward (`Scheduler.lookahead`)
    # speculative decoding (`fms_paged.engine.speculative`): (request, proposals) verified in this
    # forward; their rows are not in `decodes` and they sample nothing through `sampled`
    verifies: list[tuple[Request, list[int]]] = field(default_factory=list)
    # prompt lookup inside the lookahead call (`Speculator.lookup_plan`), or None
    lookup: LookupPlan | None = None


@dataclass
class StepResult:
    """What the model runner gives back for a plan: the token sampled for each of `plan.sampled`,
    its `TokenLogprobs` where its request asks (else None; None: no request asks), and those of
    the prompt tokens each entry of `plan.scored` scores (prompt token p + 1 for position p)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    steps: list[list[int]] | None = None  # a plan of lookahead steps: each request's tokens in turn
    # beam search: each sampled group's candidates (`fms_paged.engine.beam.candidates`), or for
    # lookahead beam steps each group's candidates step by step (`fms_paged.engine.beam.BeamSteps`)
    beams: dict | None = None
    beam_steps: beam.BeamSteps | None = None
    verified: list[list[int]] | None = None  # each of `plan.verifies`: the tokens it keeps
    # a lookahead call with prompt lookup (`plan.lookup`): its per-request and per-step measures
    # (`Speculator.observe_lookup`)
    lookup: tuple[list[list[int]], list[list[float]]] | None = None


class Scheduler:
    """decode_steps: up to this many greedy decode steps in one forward (`lookahead`), planned
    where `lookahead_ready()` says the model runner runs them in one call now (None: never)."""

    def __init__(self, pm: PageManager | GroupedPages, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01, cache: PrefixCache | None = None, horizon: int | None = None,
                 *, decode_steps: int = 1, lookahead_ready: Callable[[], bool] | None = None,
                 speculator: Speculator | None = None):
        self.pm = pm
        self.speculator = speculator  # speculative decoding: plans proposals, counts acceptance
        self.decode_steps, self.lookahead_ready = decode_steps, lookahead_ready
        self.horizon = horizon  # every layer windowed: keys this far back are all any layer reads
        # pages are released behind windows: every layer windowed, or sliding layer groups
        self.releases = horizon is not None or (isinstance(pm, GroupedPages) and bool(pm.groups.sliding))
        self.cache = cache  # prefix caching: admissions share cached pages; evictable pages count as free
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_pages = max(1, int(watermark * (pm.num_pages - 1)))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.num_output_tokens = 0
        self.num_prompt_computed = 0  # prompt tokens run through the model (not served by the cache)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out, now = SchedulerOutput(), time.perf_counter()
        if self.releases:
            self._release_behind_windows()
        budget = self.max_num_batched_tokens
        planned: dict[Request, tuple[int, int]] = {}  # scheduled this step: (tokens, pages)
        planned_pages = 0
        # decodes first, then prompts still being prefilled: a chunk never takes a decode's token
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1)
        for req in order:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(beam.compute_end(req) - req.num_computed, budget)
            need = self.pm.pages_needed(req.seq_id, req.num_computed + n)
            # (no new page: nothing to check, planned_pages never passes available_pages)
            while need and need > self.available_pages() - planned_pages:
                victim = self.running.pop()  # the newest running request
                # (a beam: its whole group, `beam.preempt`)
                unit = [self._preempt(victim)] if victim.beam is None else beam.preempt(self, victim.beam)
                for v in unit:
                    if v in planned:  # scheduled already this step: give its share back
                        n_v, need_v = planned.pop(v)
                        budget, planned_pages = budget + n_v, planned_pages - need_v
                out.preempted.extend(unit)
                if req.status is not Status.RUNNING:
                    break
            if req.status is Status.RUNNING:
                planned[req] = (n, need)
                budget, planned_pages = budget - n, planned_pages + need
        if any(r.beam is not None for r in planned):  # a group's beams sample together
            tokens, pages = beam.hold(self, planned)
            budget, planned_pages = budget + tokens, planned_pages - pages
        out.scheduled = [(r, n) for r, (n, _) in planned.items()]
        if self.waiting and not out.preempted:
            planned_pages = self._admit(out, budget, planned_pages, now)
        # prompt lookup on a plan that may take lookahead steps: inside the calls or between steps,
        # whichever has been faster (`Speculator.in_call_now`)
        in_call = self.speculator is not None and bool(out.scheduled) and self._lookahead_ready(
            out, [r for r, _ in out.scheduled]) and self.speculator.in_call_now()
        if self.speculator is not None and out.scheduled and not in_call:  # within what is left
            left = self.max_num_batched_tokens - sum(n for _, n in out.scheduled)
            planned_pages += self.speculator.plan(out, self.pm, left, self.available_pages() - planned_pages)
        short = planned_pages - self.pm.num_free_pages
        if short > 0:  # RESERVE takes free pages: evict cached ones to make them
            self.cache.evict(short)
        if out.scheduled:  # what was planned: it cannot fail
            extra = {id(r): len(p) for r, p in out.verifies}  # the proposals' slots
            out.reservation = self.pm.reserve([r.seq_id for r, _ in out.scheduled],
                                              [r.num_computed + n + extra.get(id(r), 0)
                                               for r, n in out.scheduled])
        self._plan_rows(out, now)
        if out.scheduled:
            self.lookahead(out, self.decode_steps, in_call)
        return out

    def _lookahead_ready(self, plan: SchedulerOutput, reqs: list[Request], beams: bool = False) -> bool:
        """Whether a plan of `reqs` may take lookahead decode steps (`lookahead`): several set
        (`decode_steps`), the runner runs them in one call now, no prefill, preemption, fork or
        request waiting, and every request decodes greedily (no log-probabilities, no grammar).
        `beams`: beams may be among them (beam search's steps, `fms_paged::decode_beams`), every
        beam of a group whose beams all decode in this plan (not its first step: that one FORKs),
        the groups of one width (a call's groups are rows of that many); else none may. Asked
        before proposals are planned too (no beam then): with prompt lookup, a plan that will take
        them proposes inside the call (`Speculator.lookup_plan`), not between steps."""
        if not (self.decode_steps > 1 and self.lookahead_ready is not None and reqs
                and not (plan.prefills or plan.preempted or self.waiting or plan.verifies or plan.forks)
                and all(r.reaches_end(1) and r.params.temperature == 0 and r.params.logprobs is None
                        and r.matcher is None for r in reqs)):
            return False
        in_groups = [r for r in reqs if r.beam is not None]
        groups = {r.beam for r in in_groups}
        if groups and not (beams and sum(g.width for g in groups) == len(in_groups)
                           and len({g.width for g in groups}) == 1
                           and not any(g.leader.forks for g in groups)):
            return False
        return self.lookahead_ready()

    def lookahead(self, plan: SchedulerOutput, steps: int, in_call: bool = False) -> int:
        """Extend a plan whose rows all decode greedily (no log-probabilities, no grammar), beams
        of whole groups among them or not, with no
        request waiting, to up to `steps` decode steps in one forward (vLLM's multi-step
        scheduling): no request past its `max_new_tokens`, each its share of the token budget,
        the pages for them RESERVEd now where the pool has them (else half as many steps, down to
        one); `in_call`: with prompt lookup inside the call (`Speculator.lookup_plan`). -> the
        steps planned (`plan.steps`). `update` keeps each request's tokens up to its stop."""
        reqs = plan.decodes
        if not self._lookahead_ready(plan, reqs, beams=True):
            return plan.steps
        k = min([steps, self.max_num_batched_tokens // len(reqs)]
                + [r.params.max_new_tokens - len(r.output) for r in reqs])
        ids = [r.seq_id for r in reqs]
        while k > 1:
            lengths = [r.num_computed + k for r in reqs]
            need = sum(self.pm.pages_needed(s, n) for s, n in zip(ids, lengths))
            if need <= self.available_pages():
                break
            k //= 2
        if k <= 1:
            return plan.steps
        if need > self.pm.num_free_pages:
            self.cache.evict(need - self.pm.num_free_pages)
        plan.reservation.extend_with(self.pm.reserve(ids, lengths))
        plan.steps = k
        if in_call:
            plan.lookup = self.speculator.lookup_plan(reqs, k)
        return k

    def _release_behind_windows(self) -> None:
        """ERASE the pages of running requests that no layer's window reaches again
        (`PageManager.release_behind_window`: their next query is at num_computed)."""
        dropped = self.pm.release_behind_window([r.seq_id for r in self.running],
                                                [r.num_computed for r in self.running], self.horizon)
        if dropped and self.cache is not None:
            self.cache.release(dropped)  # those the cache alone holds now: evictable

    def _plan_rows(self, out: SchedulerOutput, now: float) -> None:
        """Split the plan into decodes and prefill chunks, list the tokens to sample (logits rows),
        and give the waiting completions of a request whose prompt completes now a row each (they
        share the parent's prompt pages, so its prefix-cache hit counts for them too)."""
        verifying = {id(r) for r, _ in out.verifies}
        for r, n in out.scheduled:
            if id(r) in verifying:
                continue
            if r.reaches_end(1):
                out.decodes.append(r)
            else:
                out.prefills.append((r, n))
                if positions := r.prompt_positions(n):
                    out.scored.append((r, positions))
        done = [r for r, n in out.prefills if r.reaches_end(n)]
        out.scored_only = [r for r in done if r.params.max_new_tokens == 0]
        done = [r for r in done if r.params.max_new_tokens > 0]
        out.sampled = [(r, i) for i, r in enumerate(out.decodes + done)]
        for r, row in list(out.sampled):
            forks, r.forks = r.forks, []
            for child in forks:
                if child.status is Status.FINISHED:  # aborted meanwhile
                    continue
                # (a beam's row was promised at admission; other completions leave those rows)
                if child.beam is None and (not self.free_rows or len(self.running) + beam.pending_rows(
                        self.running) >= self.max_num_seqs):
                    self.waiting.appendleft(child)  # prefilled on its own later
                    continue
                child.seq_id, child.status = self.free_rows.pop(), Status.RUNNING
                child.first_scheduled(now, r.cached_tokens)
                self.running.append(child)
                out.forks.append((r, child))
                out.sampled.append((child, row))
        if out.prefills:
            beam.attach_followers(self, out, now)

    def update(self, plan: SchedulerOutput, result: StepResult) -> tuple[list[RequestOutput], list[Request]]:
        """Book a forward's results (`StepResult`): the prompt log-probabilities it scored, then
        `result.tokens[i]`, sampled for `plan.sampled[i]`, with its log-probabilities where its
        request asks. -> (the outputs of the requests that produced a token or finished, the
        requests that finished: their output is final and carries `Request.stats`). A request's
        first output carries its prompt's log-probabilities, which it keeps no longer. A plan of
        lookahead steps (`result.steps`): each request keeps its tokens in turn up to the first that
        ends it, the later ones dropped (their keys sit in pages it gives back now); each token it
        keeps past the first was computed by a later step."""
        logprobs = result.logprobs
        for (r, _), lps in zip(plan.scored, result.prompt_logprobs or ()):
            r.prompt_lps.extend(lps)  # (positions start where the scored ones end, a recompute too)
        for r, n in plan.scheduled:
            self.num_prompt_computed += max(0, min(r.num_computed + n, len(r.prompt)) - r.num_computed)
            r.num_computed += n
            if result.beam_steps is None or r.beam is None:  # (a beam in a call of beam steps: once
                self._cache_filled(r, r.num_computed - n)  # its row holds its pages, `book_steps`)
        for parent, child in plan.forks:  # the parent's prompt is computed: share its pages
            self.pm.fork(parent.seq_id, child.seq_id)
            child.num_computed, child.cache_chain = parent.num_computed, list(parent.cache_chain)
            child.arrival = parent.arrival
        now = time.perf_counter()
        outputs, finished = [], []
        for r in plan.scored_only:  # its prompt is scored; it generates nothing
            self.finish(r)
            finished.append(r)
            outputs.append(RequestOutput(r.request_id, [], True, "length", r.index, None, r.stats("length"),
                                         self._take_prompt_logprobs(r)))
        rows = result.steps if result.steps is not None else [[t] for t in result.tokens]
        entries = list(zip(plan.sampled, rows))
        if plan.verifies:  # a verified request's tokens: as lookahead steps' (each later one computed)
            entries += [((r, -1), toks) for (r, _), toks in zip(plan.verifies, result.verified)]
        groups = []
        for i, ((r, _), toks) in enumerate(entries):
            if r.beam is not None:  # booked by its group below
                if r.beam not in groups:
                    groups.append(r.beam)
                continue
            reason = None
            for j, tok in enumerate(toks):
                if j:  # a later lookahead step computed the token before this one
                    r.num_computed += 1
                    self._cache_filled(r, r.num_computed - 1)
                r.output.append(tok)
                r.token_times.append(now)
                self.num_output_tokens += 1
                if r.matcher is not None:  # its grammar masked the logits: the token is one it takes
                    r.matcher.accept_token(tok)
                if tok in r.stop_ids or (r.matcher is not None and r.matcher.is_terminated()):
                    reason = "stop"
                elif len(r.output) >= r.params.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    break
            stats = None
            if reason is not None:
                self.finish(r)
                finished.append(r)
                stats = r.stats(reason)
            # (no logprobs at all: a tensor-parallel worker's update, which outputs nothing)
            lps = None if r.params.logprobs is None or logprobs is None else [logprobs[i]]
            prompt_lps = None if r.prompt_lps is None else self._take_prompt_logprobs(r)
            outputs.append(RequestOutput(r.request_id, toks[: j + 1], reason is not None, reason, r.index,
                                         lps, stats, prompt_lps))
        if result.beam_steps is not None:  # lookahead beam steps: each group's steps in turn
            booked = [beam.book_steps(self, result.beam_steps, now)]
        else:  # beam search: each group's step (`beam.advance`: next beams, their pages)
            booked = [beam.advance(self, g, result.beams[g], now) for g in groups]
        for outs, done in booked:
            outputs += outs
            finished += done
        if plan.verifies:
            self._verified(plan, result)
        if result.lookup is not None:
            self.speculator.observe_lookup(plan.decodes, *result.lookup)
        return outputs, finished

    def _verified(self, plan: SchedulerOutput, result: StepResult) -> None:
        """After a step's verifies are booked: count what each kept, and roll each running one's
        length back to its tokens computed (its RESERVE covered every proposal's slot): the pages
        wholly past it go back to the pool (`PageManager.truncate`)."""
        back_ids, back_lens = [], []
        for (r, props), toks in zip(plan.verifies, result.verified):
            self.speculator.observe(r, len(props), len(toks) - 1)
            if r.status is Status.RUNNING:
                back_ids.append(r.seq_id)
                back_lens.append(r.num_computed)
        if back_ids:
            self.pm.truncate(back_ids, back_lens)

    def _cache_filled(self, r: Request, before: int) -> None:
        """Put the request's pages filled up to its tokens computed into the prefix cache (with a
        cache, where a page past `r.cache_chain` is full: most steps fill none), asked where its
        tokens computed passed a page's end since `before`. A chain that stopped short (its next
        page's content cached under another page, or released behind a window) is asked again at
        the next page's end, not at every token: a request repeating a cached output token for
        token (the same greedy prompt again) cost ~10 us a token to ask."""
        n = r.num_computed // self.pm.page_size
        if self.cache is not None and n > len(r.cache_chain) and n > before // self.pm.page_size:
            self.cache.insert(r.seq_id, r.token_slice(0, r.num_computed), r.num_computed, r.cache_chain,
                              r.cache_salt)

    @staticmethod
    def _take_prompt_logprobs(r: Request) -> list[TokenLogprobs | None] | None:
        """The prompt's log-probabilities (None first: nothing predicts the first token), handed
        over once and then dropped by the request; None when not asked for or given already."""
        if r.prompt_lps is None:
            return None
        lps, r.prompt_lps = [None, *r.prompt_lps], None
        return lps

    def available_pages(self) -> int:
        """Pages a RESERVE can get: free ones, and cached ones no sequence holds (evicted first)."""
        return self.pm.num_free_pages + (self.cache.num_evictable if self.cache else 0)

    def _admit(self, out: SchedulerOutput, budget: int, planned_pages: int, now: float) -> int:
        """Waiting requests, first come first served, while a row, the budget and the pages allow
        (a prefix cache hit is shared, not computed) -> pages planned now. A request's first
        admission notes its time and cache hit (`Request.first_scheduled`)."""
        P, cache = self.pm.page_size, self.cache
        promised = beam.pending_rows(self.running)  # rows of beams waiting for their leader's prompt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            rows = beam.rows_needed(req)  # (a beam search: a row for each beam)
            if len(self.running) + promised + rows > self.max_num_seqs:
                break
            # a request scoring its prompt computes it whole: cached pages carry no logits
            scores = req.prompt_lps is not None
            end = beam.compute_end(req)  # (a beam leader: the prompt, which its beams then FORK)
            chain = (cache.match(req.token_slice(0, end), req.cache_salt)
                     if cache and not scores else [])
            cached = len(chain) * P
            n = min(end - cached, budget)
            need = self.pm.pages_to_admit(cached + n, len(chain))
            # hit pages that were evictable are not available to others once shared
            hit_evictable = cache.evictable_pages(chain) if chain else 0
            headroom = self.watermark_pages if self.running else 0  # alone, it may use every page
            if need > self.available_pages() - hit_evictable - planned_pages - headroom:
                break
            self.waiting.popleft()
            req.seq_id, req.status = self.free_rows.pop(), Status.RUNNING
            if cache:
                cache.record(req.num_tokens, cached)
                cache.acquire(req.seq_id, chain)
                req.cache_chain, req.num_computed = list(chain), cached
            req.first_scheduled(now, min(cached, len(req.prompt)))
            self.running.append(req)
            out.scheduled.append((req, n))
            planned_pages += need
            budget -= n
            promised += rows - 1
        return planned_pages

    def _preempt(self, req: Request) -> Request:
        self._free(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def finish(self, req: Request) -> None:
        """Drop a request (finished or aborted) wherever it is; its pages go back at once. The
        completions still waiting for its prefill (completion 0 of an n > 1 request aborted
        alone) wait in the queue in its place, to be prefilled on their own."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:  # (an aborted submission may not have reached the queue yet)
            self.waiting.remove(req)
        req.status = Status.FINISHED
        forks, req.forks = [c for c in req.forks if c.status is not Status.FINISHED], []
        self.waiting.extendleft(reversed(forks))

    def _free(self, req: Request) -> None:
        if req.seq_id is not None:
            pages = self.pm.pages_of(req.seq_id) if self.cache else []
            self.pm.erase([req.seq_id])
            if self.cache:
                self.cache.release(pages)  # listed pages nobody holds now: evictable
            self.free_rows.append(req.seq_id)
            req.seq_id, req.cache_chain = None, []
            if self.speculator is not None:  # (a draft model's row of the request: freed with it)
                self.speculator.release(req)
