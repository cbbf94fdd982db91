"""The model runner: the one part of the engine that touches the device (nano-vllm's ModelRunner).

`ModelRunner.run(plan)` prepares the pages the plan's RESERVE handed out, turns the plan into
model inputs through the paged backend (slots, the step's `AttentionStep`), pads decode rows to a
bucket, picks the eager or compiled step, runs the model once, and samples every token the plan
asks for with its request's own settings (and, for the requests that ask, the tokens'
log-probabilities, read back in the same host sync). `warmup(engine)` compiles the shapes serving
will meet before the first request does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Callable

import numpy as np
import torch

from fms_paged import native
from fms_paged.engine import beam, speculative
from fms_paged.engine.model_step import (
    CUDA_GRAPH_MODES,
    GraphedDecode,
    compiled_prefill,
    cuda_graphs_unavailable_reason,
    decode_fn,
    prefill_hidden,
    smallest_batch,
)
from fms_paged.engine.request import Request, SamplingParams, TokenLogprobs
from fms_paged.engine.sampling import sample_each, token_logprobs
from fms_paged.engine.scheduler import SchedulerOutput, StepResult
from fms_paged.kv.paged import PagedBackend
from fms_paged.models.llama import LLaMA

COMPILE_MODES = ("auto", True, False)
# a grammar bitmask fill this short (recent fills' mean) is made inline: handing it to the masker
# thread and back costs about as much (measured on a 2-core CPU), and a longer one runs there,
# beside the forward
INLINE_FILL_S = 5e-4


def decode_buckets(max_num_seqs: int, smallest: int = 1) -> list[int]:
    """Decode batch sizes compiled: 1, 4, 8, 16, 32, ... up to max_num_seqs. A lone request gets
    a bucket of its own: on the CPU a GEMM over 8 rows costs more than the GEMV over one.
    `smallest=2` (a kernel whose compiled step is one graph for every batch past 1 row: cpp): a lone
    request decodes beside an inactive row instead, in that graph; the GEMV kernel reads each
    weight once for all the rows."""
    sizes = [1, 4] + [8 << i for i in range(max_num_seqs.bit_length())]
    return sorted({max(smallest, min(max_num_seqs, b)) for b in sizes})


def check_modes(compile: bool | str, cuda_graphs: bool | str) -> None:
    """`compile` in COMPILE_MODES and `cuda_graphs` in CUDA_GRAPH_MODES (1 and 0 are not bools)."""
    for name, value, modes in (("compile", compile, COMPILE_MODES),
                               ("cuda_graphs", cuda_graphs, CUDA_GRAPH_MODES)):
        if value not in modes or isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}; expected one of {modes}")


class ModelRunner:
    """Runs a paged model on scheduler plans: decode batches padded to `buckets`, prefill chunks
    packed after the decode rows in one forward (`PagedBackend.mixed`).

    compile: True compiles the decode step (one graph per decode bucket, or one for all of them
    with a kernel of dynamic shapes: cpp) and, for our models, the prefill and mixed steps around
    their attention (`model_step.compiled_prefill`: one graph for every token count); "auto" does
    where the kernel's steps compile (`Kernel.compiles`: flex; the cpp kernel's eager steps run
    the C++ operators), False runs eagerly.

    cuda_graphs: replay the compiled decode step from a CUDA graph per decode bucket
    (`model_step.GraphedDecode`); "auto" does where it can (compiled flex on CUDA), True insists
    (ValueError where it cannot), False never."""

    def __init__(self, model: torch.nn.Module, backend: PagedBackend, max_num_seqs: int,
                 compile: bool | str = "auto", cuda_graphs: bool | str = "auto"):
        check_modes(compile, cuda_graphs)
        self.model, self.backend = model, backend
        self.kernel = backend.kernel
        self.compiled = self.kernel.compiles if compile == "auto" else bool(compile)
        # (compiled: `decode_fn` waits for this process's builds and loads the kernel first, which
        # the compiled prefill graph needs as well)
        self._decode = decode_fn(backend, self.compiled, collectives=getattr(model, "tp", None) is not None)
        why_not = cuda_graphs_unavailable_reason(backend, self.compiled)
        if cuda_graphs is True and why_not:
            raise ValueError(f"cuda_graphs=True: {why_not}")
        self.cuda_graphs = cuda_graphs is not False and why_not is None
        if self.cuda_graphs:
            self._decode = GraphedDecode(self._decode)
        self._prefill = compiled_prefill() if self.compiled and isinstance(model, LLaMA) else None
        self.buckets = decode_buckets(max_num_seqs, smallest_batch(self._decode))
        # the fewest tokens of a prefill step run by the compiled prefill graph (shorter: padded)
        self.min_prefill_tokens = self.kernel.min_prefill_tokens if self._prefill is not None else 1
        self.grammars = None  # the engine's `Grammars`, once a request has a grammar
        self._masker: concurrent.futures.ThreadPoolExecutor | None = None
        # seconds spent filling bitmasks, and the part of them on the step's path (a fill made
        # inline, or the wait for the masker's after the forward), over the runner's life
        self.mask_fill_s = self.mask_wait_s = 0.0
        self._fill_ema = self._last_fill_s = 0.0  # recent fills' seconds (INLINE_FILL_S)
        # opt-in instrumentation: called as forward_hook(kind, seconds) after each model forward,
        # kind "prefill", "decode" or "mixed" (decode rows and prefill chunks in one forward),
        # seconds its host wall time (`time.perf_counter` around the model call; on an
        # asynchronous device, what the host waited). None: nothing is timed.
        self.forward_hook: Callable[[str, float], None] | None = None
        # rank 0 of tensor-parallel ranks: the `tensor_parallel.Ranks` each run first sends the
        # step's message to, so that the other ranks take the same step (nano-vllm's `call`)
        self.ranks = None

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput, sample: bool = True) -> StepResult | None:
        """One forward over `plan` -> the token sampled for each of `plan.sampled`, each one's
        `TokenLogprobs` where its request asks (None elsewhere; None when no request asks), and
        the log-probabilities of the prompt tokens `plan.scored` asks for. A plan that schedules
        nothing runs nothing (-> no tokens), as vLLM v1's runner answers an empty step.
        `sample=False`: the forward alone, -> None (a tensor-parallel worker: rank 0 samples).
        On rank 0 of tensor-parallel ranks (`ranks`), the step's message goes to the others first,
        and the tokens sampled ride with the next one. On one thread while a first start's builds
        compile (`native.yielding_to_builds`)."""
        if self.ranks is not None:
            self.ranks.send()
        if not plan.scheduled:
            return StepResult([]) if sample else None
        # (deferred asked first: once the builds are done, that one question is all a step pays)
        with native.yielding_to_builds() if native.deferred() else contextlib.nullcontext():
            self.backend.prepare_pages(plan.reservation)
            masks = self._start_masks(plan) if sample and self.grammars is not None else None
            if plan.steps > 1:  # lookahead decode steps (`Scheduler.lookahead`, planned where
                # `decodes_in_one_call`): greedy, or beam search's, in one call
                if any(r.beam is not None for r in plan.decodes):  # beam searches (greedy rows beside)
                    result = self._beam_steps(plan, plan.steps)
                else:
                    rows, lookup = (self._lookup_steps(plan.decodes, plan.steps, plan.lookup)
                                    if plan.lookup is not None  # with prompt lookup inside the call
                                    else (self._decode_steps(plan.decodes, plan.steps), None))
                    result = StepResult([row[0] for row in rows], steps=rows, lookup=lookup)
            else:
                scored = checks = None
                if plan.prefills or plan.verifies:
                    logits, scored, checks = self._forward_mixed(plan.decodes, plan.prefills, plan.scored,
                                                                 plan.verifies)
                else:  # decode rows alone: the model's decode step (eager or compiled), [n, V]
                    args = (self.model, *self.backend.decode_inputs(*self._decode_rows(plan.decodes)))
                    logits = (self._decode(*args) if self.forward_hook is None  # (timed where hooked)
                              else self._timed("decode", self._decode, *args))[: len(plan.decodes)]
                if not sample:
                    return None
                prompt_lps = self._prompt_logprobs(scored, plan) if scored is not None else None
                tokens, lps = self._sample(logits, plan, masks) if plan.sampled else ([], None)
                verified = speculative.verify(checks, plan.verifies) if plan.verifies else None
                result = StepResult(tokens, lps, prompt_lps, verified=verified,
                                    beams=beam.candidates(logits, plan.sampled))
        if self.ranks is not None:
            self.ranks.sampled(result.tokens)
        return result

    def _timed(self, kind: str, forward: Callable, *args, **kwargs):
        """`forward(*args, **kwargs)`, reported to `forward_hook` (kind, seconds) where one is set."""
        hook = self.forward_hook
        if hook is None:
            return forward(*args, **kwargs)
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        hook(kind, time.perf_counter() - t0)
        return out

    def _start_masks(self, plan: SchedulerOutput) -> concurrent.futures.Future | None:
        """The grammars' bitmasks of `plan.sampled` (a row per sampled token), as a future: filled
        in a thread while the forward runs, or inline where a fill is short; None where no sampled
        request has a grammar."""
        if not any(r.matcher is not None for r, _ in plan.sampled):
            return None
        matchers = [r.matcher for r, _ in plan.sampled]
        if self._fill_ema < INLINE_FILL_S:  # a hand-off to the thread would cost what it hides
            masks = concurrent.futures.Future()
            masks.set_result(self._fill(matchers))
            self.mask_wait_s += self._last_fill_s
            return masks
        if self._masker is None:
            self._masker = concurrent.futures.ThreadPoolExecutor(1, "fms-paged-grammar")
        return self._masker.submit(self._fill, matchers)

    def _fill(self, matchers: list) -> torch.Tensor:
        t0 = time.perf_counter()
        bitmask = self.grammars.fill(matchers)
        self._last_fill_s = time.perf_counter() - t0
        self.mask_fill_s += self._last_fill_s
        self._fill_ema += 0.25 * (self._last_fill_s - self._fill_ema)
        return bitmask

    def _sample(self, logits: torch.Tensor, plan: SchedulerOutput, masks=None):
        """logits [K, V] of the sampled rows -> (tokens, their log-probabilities or None). `masks`:
        a future of the grammars' bitmask (a row per sampled token), applied before sampling; the
        log-probabilities are the raw ones, before it."""
        rows = [row for _, row in plan.sampled]
        if rows != list(range(logits.shape[0])):  # forked completions read their parent's row
            logits = logits[torch.tensor(rows, device=logits.device)]
        settings = [(r.params.temperature, r.params.top_k, r.params.top_p, r.generator)
                    for r, _ in plan.sampled]
        x = logits  # (sample_each takes the model's dtype: its draws convert their rows to fp32)
        if masks is not None:
            x = logits.float()
            x = x.clone() if x is logits else x
            t0 = time.perf_counter()
            bitmask = masks.result()
            self.mask_wait_s += time.perf_counter() - t0
            self.grammars.apply(x, bitmask, [i for i, (r, _) in enumerate(plan.sampled)
                                                    if r.matcher is not None])
        tokens = sample_each(x, settings)  # [K]
        asking = [i for i, (r, _) in enumerate(plan.sampled) if r.params.logprobs is not None]
        if not asking:
            return tokens.tolist(), None  # the step's one host sync
        return self._with_logprobs(logits, tokens, asking, [plan.sampled[i][0].params.logprobs
                                                            for i in asking])

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asking: list[int],
                       ks: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [K, V], tokens: [K]; rows `asking` want their token's log-probability and the
        top ks[j] -> (tokens, one TokenLogprobs or None per row). One log-softmax and one top-k over
        the asking rows; tokens and log-probabilities come back in one fp32 transfer (token ids
        below 2**24 are exact in fp32; float64, not on every device, past that), the step's one
        host sync."""
        K, A, k = tokens.shape[0], len(asking), min(max(ks), logits.shape[-1])
        dtype = torch.float32 if logits.shape[-1] <= 1 << 24 else torch.float64
        idx = torch.tensor(asking, device=logits.device)
        chosen, top_lp, top_ids = token_logprobs(logits.index_select(0, idx), tokens.index_select(0, idx), k)
        parts = (tokens, chosen, top_lp.flatten(), top_ids.flatten())
        flat = torch.cat([t.to(dtype) for t in parts]).tolist()
        toks = [int(t) for t in flat[:K]]
        out: list[TokenLogprobs | None] = [None] * K
        vals, ids = flat[K + A : K + A + A * k], flat[K + A + A * k :]
        for j, (i, kj) in enumerate(zip(asking, ks)):
            top = tuple((int(ids[j * k + c]), vals[j * k + c]) for c in range(min(kj, k)))
            out[i] = TokenLogprobs(flat[K + j], top)
        return toks, out

    def _decode_rows(self, reqs: list[Request]) -> tuple[list, torch.Tensor, list, list]:
        """A decode batch padded to its bucket: seq ids, last tokens [B] (device), lengths, active."""
        n = len(reqs)
        pad = next(b for b in self.buckets if b >= n) - n
        last = torch.tensor([(r.output or r.prompt)[-1] for r in reqs] + [0] * pad).to(self.backend.device)
        return ([r.seq_id for r in reqs] + [0] * pad, last,
                [r.num_computed for r in reqs] + [0] * pad, [True] * n + [False] * pad)

    def decodes_in_one_call(self) -> bool:
        """Whether lookahead decode steps run in one call now (`Kernel.decodes_in_one_call`, eager
        steps): what the engine asks before it plans them (`Scheduler.lookahead` RESERVEs their
        pages)."""
        return not self.compiled and self.kernel.decodes_in_one_call(self.model, self.backend.view)

    def _decode_steps(self, reqs: list[Request], steps: int) -> list[list[int]]:
        """`steps` greedy decode steps of `reqs` in one call (`Kernel.decode_greedy`) -> each
        request's tokens. Planned only where `decodes_in_one_call` (their pages are RESERVEd)."""
        last = torch.tensor([(r.output or r.prompt)[-1] for r in reqs])
        lengths, ids = torch.tensor([r.num_computed for r in reqs]), torch.tensor([r.seq_id for r in reqs])
        out = self._timed("decode", self.kernel.decode_greedy, self.model, last, lengths, ids,
                          self.backend.view, steps)
        if out is None:
            raise RuntimeError(f"{steps} lookahead decode steps were planned where the model cannot run them "
                               "in one call (ModelRunner.decodes_in_one_call)")
        return out.tolist()

    def _beam_steps(self, plan: SchedulerOutput, steps: int) -> StepResult:
        """`steps` beam-search steps of the groups among `plan.decodes` (whole groups,
        `Scheduler.lookahead`), and greedy decode steps of its other rows, in one call
        (`Kernel.decode_beams`): the groups' beams in turn, best first, then the greedy rows -> the
        step's result: each greedy row's tokens in `steps` (in `plan.sampled`'s order; a beam's
        entry empty: its group books it) and the call's `beam.BeamSteps` (each group's candidates
        per step, as `beam.candidates` gives them)."""
        groups = list(dict.fromkeys(r.beam for r in plan.decodes if r.beam is not None))
        greedy = [r for r in plan.decodes if r.beam is None]
        rows = [b for g in groups for b in g.beams] + greedy
        width = groups[0].width  # (one width: `Scheduler._lookahead_ready`)
        S = max(len(g.stop_ids) for g in groups)
        stops = torch.tensor([list(g.stop_ids) + [-1] * (S - len(g.stop_ids)) for g in groups],
                             dtype=torch.long).view(len(groups), S)
        last = torch.tensor([(r.output or r.prompt)[-1] for r in rows])
        at = torch.tensor([r.num_computed for r in rows])
        scores = torch.tensor([s for g in groups for s in g.scores], dtype=torch.float32)
        out = self._timed("decode", self.kernel.decode_beams, self.model, last, at,
                          torch.tensor([r.seq_id for r in rows]), self.backend.view, steps, width, scores,
                          stops, torch.tensor([g.keep for g in groups]))
        if out is None:
            raise RuntimeError(f"{steps} lookahead beam steps were planned where the model cannot run them "
                               "in one call (ModelRunner.decodes_in_one_call)")
        vals, cands, tables, who, tokens = out  # [steps, groups, K], [steps, groups, 2, K], ...
        K, nb = vals.shape[-1], len(rows) - len(greedy)
        vals, cands = vals.double().tolist(), cands.tolist()  # (fp32 values: exact as doubles)
        per: dict = {}
        for gi, g in enumerate(groups):
            per[g] = []
            for j in range(steps):
                parents, toks = cands[j][gi]
                n = K - parents.count(-1)  # (a group's own keep: min(keep, width * V))
                per[g].append((vals[j][gi][:n], parents[:n], toks[:n]))
        of = dict(zip(map(id, greedy), tokens.tolist()))
        made = [of.get(id(r), []) for r, _ in plan.sampled]
        return StepResult([t[0] if t else -1 for t in made], steps=made, beam_steps=beam.BeamSteps(
            per, [r.seq_id for r in rows[:nb]], tables[:, :nb], who.tolist()[:nb]))

    def _lookup_steps(self, reqs: list[Request], steps: int,
                      lookup: speculative.LookupPlan) -> tuple[list[list[int]], tuple]:
        """`_decode_steps` with prompt lookup speculation inside the call (`Kernel.decode_lookup`,
        `plan.lookup`) -> (each request's tokens, the call's measures for
        `Speculator.observe_lookup`)."""
        hist = lookup.history
        last = torch.tensor([int(h[-1]) for h in hist])
        lengths, ids = torch.tensor([r.num_computed for r in reqs]), torch.tensor([r.seq_id for r in reqs])
        offsets = torch.tensor(list(itertools.accumulate((h.size for h in hist), initial=0)))
        out = self._timed("decode", self.kernel.decode_lookup, self.model, last, lengths, ids,
                          self.backend.view, steps, torch.from_numpy(np.concatenate(hist)), offsets,
                          torch.tensor(lookup.caps), lookup.n_max, lookup.n_min, lookup.max_rows)
        if out is None:
            raise RuntimeError(f"{steps} lookahead decode steps were planned where the model cannot run them "
                               "in one call (ModelRunner.decodes_in_one_call)")
        tokens, stats, timing = out
        return tokens.tolist(), (stats.tolist(), timing.tolist())

    def _prompt_logprobs(self, logits: torch.Tensor, plan: SchedulerOutput) -> list[list[TokenLogprobs]]:
        """logits [M, V] at the positions of `plan.scored`, in its order -> for each entry, the
        `TokenLogprobs` of the prompt token each position predicts (the next one), with its rank and
        the top k of its request's `prompt_logprobs`: one log-softmax, one top-k, one transfer (a
        step with prompts to score syncs twice)."""
        targets = [r.prompt[p + 1] for r, positions in plan.scored for p in positions]
        k = min(max(r.params.prompt_logprobs for r, _ in plan.scored), logits.shape[-1])
        tgt = torch.tensor(targets, device=logits.device)
        chosen, top_lp, top_ids = token_logprobs(logits, tgt, k)
        # rank of each prompt token: 1 + the tokens scored higher (the logits' order is the log-softmax's)
        rank = (logits > logits.gather(1, tgt[:, None])).sum(-1) + 1
        dtype = torch.float32 if logits.shape[-1] <= 1 << 24 else torch.float64
        M = len(targets)
        flat = torch.cat([t.to(dtype) for t in (chosen, rank, top_lp.flatten(), top_ids.flatten())]).tolist()
        vals, ids = flat[2 * M : 2 * M + M * k], flat[2 * M + M * k :]

        def entry(j: int, kr: int) -> TokenLogprobs:  # row j, the top kr
            top = tuple((int(ids[j * k + c]), vals[j * k + c]) for c in range(kr))
            return TokenLogprobs(flat[j], top, int(flat[M + j]))

        out, m = [], 0
        for r, positions in plan.scored:
            out.append([entry(j, r.params.prompt_logprobs) for j in range(m, m + len(positions))])
            m += len(positions)
        return out

    def _forward_mixed(self, dec: list[Request], pre: list[tuple[Request, int]],
                       scored: list[tuple[Request, list[int]]] = (),
                       verifies: list[tuple[Request, list[int]]] = (),
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> (logits of the decode rows, then of the chunks that end their request's tokens and
        sample; logits at the prompt positions `scored` asks for, or None; logits at every
        position of the `verifies` chunks (each request's last token, then its proposals: a
        chunk after the prefill chunks), or None)."""
        starts = [r.num_computed for r, _ in pre]
        chunks = [r.token_slice(s, s + n) for (r, n), s in zip(pre, starts)]
        ids = [r.seq_id for r, _ in pre]
        for r, props in verifies:  # (a decoding request: its one token left to compute, then them)
            starts.append(r.num_computed)
            chunks.append(r.token_slice(r.num_computed, r.num_computed + 1) + props)
            ids.append(r.seq_id)
        padded = 0  # the decode rows, padded to their bucket: the chunks' rows come after them
        if dec:
            dec_rows = self._decode_rows(dec)
            padded = len(dec_rows[0])
            tokens, positions, step, _ = self.backend.mixed_inputs(*dec_rows, ids, chunks, starts)
        else:
            # a one-token step padded to `min_prefill_tokens` (cpp: two): the compiled prefill graph
            # computes every step (eager ops would round each output to a half-precision model's
            # dtype where the graph keeps fp32, so the same token would get other numbers than in
            # a longer step)
            tokens, positions, step, _ = self.backend.prefill_inputs(ids, chunks, starts,
                                                                        self.min_prefill_tokens)
        # the rows whose logits are wanted, in order: the decode rows, the plan's sampled chunks'
        # last tokens (those that end their request's tokens and generate), the prompt positions to
        # score, every row of each verify chunk; all of them, in order, from a step of verifies
        # alone (-> no index)
        # (each chunk's first row, as `last` places its last one: after the padded decode rows)
        first = list(itertools.accumulate((len(c) for c in chunks[:-1]), initial=padded))
        ends = [f + len(c) - 1 for f, c in zip(first, chunks)]
        done = [i for i, (r, n) in enumerate(pre) if r.reaches_end(n) and r.params.max_new_tokens > 0]
        rows = list(range(len(dec))) + [ends[i] for i in done]
        K = len(rows)
        if scored:  # row index of each prompt position to score: its chunk's first row + offset
            chunk = {id(r): j for j, (r, _) in enumerate(pre)}
            rows += [first[chunk[id(r)]] + p - starts[chunk[id(r)]] for r, ps in scored for p in ps]
        S = len(rows)
        if verifies:  # every row of each verify chunk
            rows += [e - len(p) + i for e, (_, p) in zip(ends[len(pre):], verifies)
                     for i in range(len(p) + 1)]
        # (the range is built only where the lengths match: a prefill step wants a few of its rows)
        at = (None if len(rows) == tokens.shape[1] and rows == list(range(len(rows)))
              else torch.tensor(rows, dtype=torch.long, device=tokens.device))
        kind = "mixed" if dec else "prefill"
        if self._prefill is None or tokens.shape[1] < 2:  # 1 token (flex, gather): run eagerly
            logits = self._timed(kind, self.model, tokens, positions, step, logits_at=at)
        else:
            logits = self._timed(kind, self._prefill_logits, tokens, positions, step, at)
        if at is None:  # [1, T, V]
            logits = logits[0]
        return logits[:K], (logits[K:S] if scored else None), (logits[S:] if verifies else None)

    def _prefill_logits(self, tokens: torch.Tensor, positions: torch.Tensor, step, at: torch.Tensor
                        ) -> torch.Tensor:
        """The compiled prefill graph's hidden states, then the LM head at rows `at`."""
        return self.model.logits(prefill_hidden(self._prefill, self.model, tokens, positions, step), at)


def warmup_waves(engine, rng: torch.Generator) -> list[tuple[list[tuple[list[int], int]], tuple | None]]:
    """The synthetic traffic of `warmup`: (wave of (prompt, new tokens), request joining it after
    its first step or None). Each prefill bucket alone, then every row at once (request i makes
    2 + i tokens, so the decode batch shrinks through every bucket while prefill chunks run beside
    decodes), then for each decode bucket b, b one-token prompts decoding while one more request
    is prefilled beside them."""
    rows, vocab = engine.max_num_seqs, engine.vocab_size
    top = min(engine.max_num_batched_tokens, engine.max_model_len - rows - 1,
              engine.capacity // rows - rows - 1)
    lengths = [min(top, 128 << i) for i in range(max(1, top.bit_length() - 6))]

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (max(1, n),), generator=rng).tolist()

    waves = [([(prompt(n), 2)], None) for n in lengths]
    waves.append(([(prompt(lengths[i % len(lengths)]), 2 + i) for i in range(rows)], None))
    waves += [([(prompt(1), 3)] * min(b, rows), (prompt(16), 2)) for b in engine.runner.buckets]
    return waves


def warmup(engine, progress: Callable[[int], Callable[[], None]] | None = None) -> None:
    """Run `warmup_waves` through `engine` (idle). `progress(total)` returns a callable ticked once
    per finished request."""
    waves = warmup_waves(engine, torch.Generator().manual_seed(0))
    tick = progress(sum(len(w) + (j is not None) for w, j in waves)) if progress else None
    def add(p: list[int], n: int) -> None:
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))

    for wave, join in waves:
        for p, n in wave:
            add(p, n)
        outs = []
        if join is not None:
            outs = engine.step()  # the wave is prefilled; `join` is prefilled beside its decodes
            add(*join)
        for out in itertools.chain(outs, engine.stream()):
            if tick is not None and out.finished:
                tick()
