"""Beam search on paged sequences (`SamplingParams(use_beam_search=True, n=width)`).

A request of width k is k `Request`s (its beams) and one `BeamGroup`, which holds what beam search
adds: the running beams' cumulative log-probabilities and the finished hypotheses. The beams are
sequences of the engine like any other (a row, pages, scheduled by the scheduler); this module is
what the scheduler, the runner and the engine call where a beam differs:

- **One prefill, then FORK.** Beam 0 (the leader) prefills the prompt; beams 1..k-1 wait in its
  `forks` and, once the prompt is computed, FORK its pages (sharing every full page, each copying
  the partly filled last page on write), as the completions of an `n > 1` request do. The first
  step reads the leader's logits for all k beams, with beams 1..k-1 scored -1e9, as Hugging Face
  starts its beams.
- **A step** (`candidates`, on the device, then `advance`, on the host) follows Hugging Face's
  `generate(num_beams=k, do_sample=False)` (transformers 5's `_beam_search`): the fp32
  log-softmax of each beam's logits plus the beam's score; the top 2k (more with several stop
  tokens) of all k * V candidates; the first k candidates that end (a stop token, or the
  request's `max_new_tokens`) join the finished hypotheses with score
  cumulative / generated_length ** length_penalty (the length counts the stop token), the best k
  finished kept; the best k candidates that do not end are the next beams. The search ends when
  every candidate ends, when k hypotheses have finished and `early_stopping` is True, or when
  HF's heuristic says no running beam can beat the worst finished one (`early_stopping` False or
  "never").
- **Pages follow the beams** (`advance`): a beam that continues its own parent keeps its row
  and pages; the row of a parent that no new beam continues goes to a new beam that continues
  another parent, and REPOINTs to that parent's pages (ERASE + FORK in one page-manager call,
  copy-on-write); the rows left over are ERASEd.
- **A unit.** The k beams are admitted together (rows for all k: `rows_needed`, `pending_rows`),
  sample in the same step (`hold` defers a beam that would sample alone), and are preempted
  together (`preempt`). A preempted group is recomputed the way it started: the leader prefills
  the prompt (its chunk stops there: `compute_end`), the other beams FORK the prompt's pages
  (`attach_followers`) and then compute their own generated tokens, and the group samples again
  when every beam has caught up.
- **Output.** Nothing is streamed while the search runs (the beams change from step to step);
  the final step outputs the k hypotheses, best first (`RequestOutput.index` is the rank), each
  with its `cumulative_logprob`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fms_paged.engine.request import Request, RequestOutput, SamplingParams, Status
from fms_paged.kv.geometry import pages_for

NEG = -1.0e9  # the score of a beam that is not there yet (HF's start), exact in fp32


def _penalized(score: float, length: int, penalty: float) -> float:
    """score / length ** penalty in fp32, as HF divides its fp32 scores by the Python float."""
    return float(torch.tensor(score, dtype=torch.float32) / (length**penalty))


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, its score (cumulative / length ** penalty), its
    cumulative log-probability and when each token was sampled."""

    tokens: list[int]
    score: float
    cumulative: float
    times: list[float]


class BeamGroup:
    """The state beam search keeps beside its k beams (`Request`s): `beams` best first, their
    cumulative log-probabilities `scores` (fp32 values), the finished hypotheses (at most k, best
    first), whether a running beam may still beat them (`improvable`), and how many candidates a
    step ranks (`keep`: HF's (1 + stop tokens, at least 2) * k)."""

    def __init__(self, beams: list[Request], params: SamplingParams):
        k = len(beams)
        self.beams = beams
        self.width = k
        self.params = params
        self.stop_ids = beams[0].stop_ids
        self.scores = [0.0] + [NEG] * (k - 1)
        self.finished: list[Hypothesis] = []
        self.improvable = True
        self.keep = max(2, 1 + len(self.stop_ids)) * k
        for b in beams:
            b.beam = self

    @property
    def leader(self) -> Request:
        return self.beams[0]


def check_request(params: SamplingParams, prompt_len: int, max_num_seqs: int, page_size: int,
                  free_pages: int, slices: int, tensor_parallel: bool) -> None:
    """ValueError unless a beam-search request fits the engine: k rows, and the pages of the k beams
    at their longest (the prompt's full pages once, each beam's own pages from there: the tail of
    the prompt's last page and its generated tokens, and a page of planning headroom), in each of
    the `slices` layer slices, within the pool's `free_pages` (all but the null page): a group
    alone in the pool always gets to its end."""
    k = params.n
    if tensor_parallel:
        raise ValueError("SamplingParams.use_beam_search=True: not supported on tensor-parallel engines")
    if k > max_num_seqs:
        raise ValueError(f"SamplingParams.n={k} beams > max_num_seqs={max_num_seqs}: the beams of a "
                         "request run at once, a row each")
    P = page_size
    # (+1: the scheduler plans a private copy of a shared last page for every holder that grows,
    # where the last of them keeps it)
    need = slices * (prompt_len // P + k * pages_for(prompt_len % P + params.max_new_tokens, P) + 1)
    if need > free_pages:
        raise ValueError(f"beam search of n={k} beams on a prompt of {prompt_len} tokens with "
                         f"max_new_tokens={params.max_new_tokens} may hold {need} pages > the pool's "
                         f"{free_pages}")


# ------------------------------------------------------------------ the scheduler's hooks
def compute_end(req: Request) -> int:
    """How far a request computes before it samples or forks: a beam leader whose other beams wait
    for its prompt stops at the prompt's end (they FORK it there); any other request, its tokens."""
    return len(req.prompt) if req.beam is not None and req.forks else req.num_tokens


def rows_needed(req: Request) -> int:
    """Rows an admission takes (the leader's, and its waiting beams' once they fork)."""
    return 1 + len(req.forks) if req.beam is not None else 1


def pending_rows(running: list[Request]) -> int:
    """Rows promised to beams that wait for their running leader's prompt."""
    return sum(len(r.forks) for r in running if r.beam is not None)


def _samples_alone(g: BeamGroup, planned: dict) -> bool:
    """Whether group `g` may sample in the plan `planned` (request -> (tokens, pages)): its first
    step (the leader's logits serve its waiting beams), or every beam running and reaching its
    last token in this plan."""
    if g.leader.forks:
        return not g.leader.output
    return all(b.status is Status.RUNNING and b in planned and b.reaches_end(planned[b][0]) for b in g.beams)


def hold(sched, planned: dict) -> tuple[int, int]:
    """Beams that would sample while their group cannot (a beam recomputed after a preemption that
    caught up before the others) compute all but their last token; one with none left waits.
    -> (tokens, pages) given back to the step."""
    groups = {r.beam for r in planned if r.beam is not None}
    tokens = pages = 0
    for g in groups:
        if _samples_alone(g, planned):
            continue
        for b in g.beams:
            if b not in planned or not b.reaches_end(planned[b][0]):
                continue
            n, need = planned.pop(b)
            if n > 1:
                planned[b] = (n - 1, sched.pm.pages_needed(b.seq_id, b.num_computed + n - 1))
                pages += need - planned[b][1]
                tokens += 1
            else:
                tokens, pages = tokens + n, pages + need
    return tokens, pages


def attach_followers(sched, out, now: float) -> None:
    """A recomputed group's leader whose chunk ends its prompt: its waiting beams take their rows
    and FORK its pages when the step is booked (`out.forks`), then compute their own tokens."""
    for r, n in out.prefills:
        if r.beam is None or not r.forks or r.num_computed + n != len(r.prompt) or r.reaches_end(n):
            continue
        forks, r.forks = r.forks, []
        for child in forks:
            child.seq_id, child.status = sched.free_rows.pop(), Status.RUNNING
            child.first_scheduled(now, r.cached_tokens)
            sched.running.append(child)
            out.forks.append((r, child))


def preempt(sched, g: BeamGroup) -> list[Request]:
    """Preempt the group as a unit: every running beam's pages go back; the leader waits at the head
    of the queue with the other beams in its `forks` (recomputed as `attach_followers` says)."""
    for b in g.beams:
        if b.status is Status.RUNNING:
            if b in sched.running:
                sched.running.remove(b)
            sched._free(b)
            b.num_preemptions += 1
            sched.num_preemptions += 1
        b.status, b.num_computed = Status.WAITING, 0
    g.leader.forks = list(g.beams[1:])
    sched.waiting.appendleft(g.leader)
    return list(g.beams)


# ------------------------------------------------------------------ the runner's hook
def candidates(logits: torch.Tensor, sampled: list[tuple[Request, int]]) -> dict | None:
    """logits [K, V] of a step, `sampled` its (request, logits row) -> for each beam group sampled,
    its `keep` best candidates (cumulative score, parent beam, token), best first: the fp32
    log-softmax of each beam's logits plus its score, top-k over every beam's vocabulary. None
    when no beam is sampled (a scan of `sampled`, nothing more). One host read per group. (Called
    by the runner under its inference mode.)"""
    rows: dict[BeamGroup, dict[Request, int]] | None = None
    for r, row in sampled:
        if r.beam is not None:
            rows = {} if rows is None else rows
            rows.setdefault(r.beam, {})[r] = row
    if rows is None:
        return None
    out = {}
    for g, of in rows.items():
        if len(of) != g.width:
            raise RuntimeError(f"beam search: {len(of)} of a group's {g.width} beams sampled in one step")
        at = [of[b] for b in g.beams]
        if at == list(range(at[0], at[0] + g.width)):  # (decoding: the group's rows in order)
            x = logits[at[0] : at[0] + g.width]
        else:
            x = logits.index_select(0, torch.tensor(at, device=logits.device))
        lp = torch.log_softmax(x.float(), dim=-1)  # [k, V]
        V = lp.shape[-1]
        scores = lp + torch.tensor(g.scores, dtype=torch.float32, device=lp.device)[:, None]
        vals, flat = torch.topk(scores.flatten(), min(g.keep, g.width * V))  # [keep]
        both = torch.cat([vals.double(), flat.double()]).tolist()  # (exact: fp32 values, ids < 2**53)
        m = vals.shape[0]
        ids = [int(i) for i in both[m:]]
        out[g] = (both[:m], [i // V for i in ids], [i % V for i in ids])
    return out


# ------------------------------------------------------------------ the step's booking
def advance(sched, g: BeamGroup, cands: tuple[list[float], list[int], list[int]],
            now: float, pages: bool = True) -> tuple[list[RequestOutput], list[Request]]:
    """Book one beam step of group `g` (`candidates`' lists): finished hypotheses, the next beams
    and their pages (a parent continued twice takes, by REPOINT, the row of a parent continued by
    none; the rest are ERASEd), or the end of the search -> (its outputs, its finished requests:
    all k beams, or none). `pages=False`: a step of a lookahead call, whose rows already hold
    their pages (`book_steps`): the beams' rows and state alone."""
    vals, parents, toks = cands
    k, p = g.width, g.params
    old = g.beams
    length = len(old[0].output) + 1  # generated tokens with this step's (HF: cur_len + 1 - prompt)
    ends = [t in g.stop_ids or length >= p.max_new_tokens for t in toks]
    full = len(g.finished) == k
    if g.improvable and not (full and p.early_stopping is True):
        new = [Hypothesis(old[parents[i]].output + [toks[i]], _penalized(vals[i], length, p.length_penalty),
                          vals[i], old[parents[i]].token_times + [now]) for i in range(k) if ends[i]]
        if new:  # the best k of those finished before and now (sorted: stable, as HF's top-k)
            g.finished = sorted(g.finished + new, key=lambda h: -h.score)[:k]
    going = [i for i in range(len(vals)) if not ends[i]][:k]
    done = not going
    if not done:
        full = len(g.finished) == k
        horizon = p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
        if full:  # HF's heuristic: can the best running beam still beat the worst finished one?
            best = _penalized(vals[going[0]], horizon, p.length_penalty)
            g.improvable = g.improvable and best > min(h.score for h in g.finished)
        done = not g.improvable or (full and p.early_stopping is True)
    if done:
        return _finish(sched, g)
    _move(sched, g, [(parents[i], toks[i], vals[i]) for i in going], now, pages)
    return [], []


def _move(sched, g: BeamGroup, chosen: list[tuple[int, int, float]], now: float, pages: bool = True) -> None:
    """The next beams (parent, token, score), best first: each parent's first continuation keeps
    its row and pages; a further continuation of a parent takes the row of a parent nobody
    continues, which REPOINTs to the parent's pages (ERASE + FORK in one pass: copy-on-write of
    its last, partly filled page at the next RESERVE); the parents left over are ERASEd.
    `pages=False`: the rows hold their pages already (a lookahead call moved them)."""
    old = g.beams
    outputs = [list(b.output) for b in old]
    times = [list(b.token_times) for b in old]
    used = {q for q, _, _ in chosen}
    spare = [b for j, b in enumerate(old) if j not in used]
    claimed: set[int] = set()
    picked = []  # (the beam of each choice, its parent)
    for q, _, _ in chosen:
        parent = old[q]
        if q in claimed:
            picked.append((spare.pop(), parent))  # its row takes the parent's pages
        else:
            claimed.add(q)
            picked.append((parent, parent))
    moved = [(b, parent) for b, parent in picked if b is not parent]
    gone = [b for b, _ in moved] + spare  # rows whose pages go back (or stay with the prefix cache)
    if gone and pages:  # one REPOINT of the moved rows and one ERASE of the rest; rows kept
        pm, cache = sched.pm, sched.cache
        held = [pm.pages_of(b.seq_id) for b in gone] if cache else []
        if moved:
            pm.repoint([b.seq_id for b, _ in moved], [parent.seq_id for _, parent in moved])
        if spare:
            pm.erase([b.seq_id for b in spare])
        for listed in held:
            cache.release(listed)  # listed pages nobody holds now: evictable
    for b in spare:
        b.cache_chain = []
    for b, parent in moved:
        b.num_computed, b.cache_chain = parent.num_computed, list(parent.cache_chain)
    beams = []
    for (b, _), (q, tok, _) in zip(picked, chosen, strict=True):
        b.output, b.token_times = outputs[q] + [tok], times[q] + [now]
        beams.append(b)
    g.beams = beams
    g.scores = [s for _, _, s in chosen]


@dataclass
class BeamSteps:
    """A lookahead call's beam steps (`fms_paged::decode_beams`, planned by `Scheduler.lookahead`):
    each group's candidates step by step (`candidates`' form), the call's sequences `seqs` (its
    rows, the groups' beams in turn as they were), their page table rows after the call `tables`
    ([slices, B, pages]) and `rows`: for each row of the call, which of `seqs` holds its beam at
    the end."""

    groups: dict[BeamGroup, list[tuple[list[float], list[int], list[int]]]]
    seqs: list[int]
    tables: torch.Tensor
    rows: list[int]


def book_steps(sched, steps: BeamSteps, now: float) -> tuple[list[RequestOutput], list[Request]]:
    """Book a lookahead call of beam steps: the rows take the pages the call moved among them
    (`PageManager.retable`; pages nobody holds now go back, or stay evictable in the prefix
    cache), then each group's steps are booked in turn as one-token steps are (`advance`, rows and
    pages already where they belong; each step after the first computed its beams' last token),
    up to the step that ends its search; then the pages its beams filled go into the prefix cache.
    RuntimeError if a group's beams do not end in the rows the call says (the host's and the
    call's moves must agree). -> (outputs, finished requests)."""
    dropped = sched.pm.retable(steps.seqs, steps.tables)
    if sched.cache is not None:
        sched.cache.release(dropped)
    outputs, finished, at = [], [], 0
    for g, per_step in steps.groups.items():
        before = g.beams[0].num_computed - 1  # (the first step's token is booked as scheduled)
        for j, cands in enumerate(per_step):
            if j:
                for b in g.beams:
                    b.num_computed += 1
            outs, done = advance(sched, g, cands, now, pages=False)
            outputs += outs
            finished += done
            if done:
                break
        else:
            held = [steps.seqs[r] for r in steps.rows[at : at + g.width]]
            if [b.seq_id for b in g.beams] != held:
                raise RuntimeError(f"beam search: the beams' rows {[b.seq_id for b in g.beams]} after "
                                   f"{len(per_step)} steps in one call, but the call moved them to {held}")
            for b in g.beams:
                sched._cache_filled(b, before)
        at += g.width
    return outputs, finished


def _finish(sched, g: BeamGroup) -> tuple[list[RequestOutput], list[Request]]:
    """The search is over: every beam's pages go back; the finished hypotheses, best first, are the
    request's outputs (index = rank), each with its statistics."""
    beams = list(g.beams)
    for b in beams:
        sched.finish(b)
    outputs = []
    for i, h in enumerate(g.finished):
        reason = "stop" if h.tokens and h.tokens[-1] in g.stop_ids else "length"
        stats = dataclasses.replace(g.leader, output=h.tokens, token_times=h.times).stats(reason)
        sched.num_output_tokens += len(h.tokens)
        outputs.append(RequestOutput(g.leader.request_id, list(h.tokens), True, reason, i, None, stats,
                                     cumulative_logprob=h.cumulative))
    return outputs, beams
