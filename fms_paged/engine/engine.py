"""The continuous-batching engine: requests arrive at any time, are admitted as pages free up, and
are preempted (then recomputed) instead of failing when the pool runs dry.

One loop owns the page pool: `step()` takes the requests submitted since the last step (from any
thread), lets the `Scheduler` pick what runs, has the paged backend build the step (RESERVE,
slots, BlockMask), runs the model once, samples each request with its own settings, and returns
what each request produced. A step whose requests all decode runs as one decode batch (rows padded
to a few bucket sizes; the compiled decode step where compilation works); a step with prefill
chunks packs them into one row after the decode rows (`PagedBackend.mixed`: one forward, a
BlockMask for each part; the GATHER kernel packs decodes as 1-token chunks instead).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from fms_paged.engine.model_step import compiled_prefill, decode_fn, prefill_hidden, smallest_batch
from fms_paged.engine.prefix_cache import PrefixCache
from fms_paged.engine.request import Request, RequestOutput, SamplingParams, Status, check_prompt
from fms_paged.engine.sampling import sample_each
from fms_paged.engine.scheduler import Scheduler, SchedulerOutput
from fms_paged.kv.budget import KVBudgetError, kv_cache_budget, sequence_pages
from fms_paged.kv.paged import PagedBackend
from fms_paged.models.llama import LLaMA

COMPILE_MODES = ("auto", True, False, "tuned")
# kernels whose steps compile with fixed decode shapes ("auto" compiles where one runs)
COMPILED_KERNELS = ("cpp", "flex")


def decode_buckets(max_num_seqs: int, smallest: int = 1) -> list[int]:
    """Decode batch sizes compiled: 1, 4, 8, 16, 32, ... up to max_num_seqs. A lone request gets
    a bucket of its own: on the CPU, MKL's GEMMs with 8 rows took about twice as long as with one
    (measured: one SmolLM2-shaped request decoded 1.5x faster in a 1-row than in an 8-row step).
    `smallest=2` (the cpp kernel's compiled step, one graph for every batch past 1 row): a lone
    request decodes beside an inactive row instead, in that graph; its GEMV kernel reads each
    weight once for all the rows (README: Devices)."""
    sizes = [1, 4] + [8 << i for i in range(max_num_seqs.bit_length())]
    return sorted({max(smallest, min(max_num_seqs, b)) for b in sizes})


class Engine:
    """Continuous batching over a paged model (`attn_impl="paged"`, or an IBM FMS model through
    `fms_paged.integrations.fms.paged_model`, applied here to a model from the `fms` package).

    max_num_seqs: requests running at once (rows of the page table).
    max_num_batched_tokens: tokens in one forward (decodes + prefill chunks), >= max_num_seqs.
    num_pages: pool size; None sizes it by memory (`fms_paged.kv.budget.kv_cache_budget`, with
        `kv_memory_fraction`).
    compile: True compiles the decode step (one graph per decode bucket) and, for our LLaMA, the
        prefill and mixed steps around their attention (`model_step.compiled_prefill`: one graph
        for every token count); "auto" does where compiled FlexAttention works here, False runs
        eagerly. "tuned" (flex kernel) also freezes
        the weights into the decode graphs and autotunes their GEMMs (inductor's C++ GEMM
        template; `fms_paged.engine.model_step.TUNED_OPTIONS`): faster decode on a CPU, but every
        process compiles it again (minutes for a 100M-parameter model) and the model's weights must
        not change afterwards.
    max_model_len: longest prompt + output (default: the model's `max_expected_seq_len`).
    kernel: the paged attention kernel (`fms_paged.kv.paged.KERNELS`).
    backend: an existing `PagedBackend` to run on (its pool and rows) instead of a new one.
    enable_prefix_caching: share the KV of full pages whose tokens (and `cache_salt`) a request
        starts with, computed once and kept after their requests finish until the pool needs the
        pages (`fms_paged.engine.prefix_cache`); outputs do not change.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        num_pages: int | None = None,
        kv_memory_fraction: float | None = None,
        compile: bool | str = "auto",
        *,
        max_model_len: int | None = None,
        kernel: str = "auto",
        backend: PagedBackend | None = None,
        enable_prefix_caching: bool = True,
    ):
        if type(model).__module__.startswith("fms."):  # an IBM FMS model: through our plugin
            from fms_paged.integrations.fms import paged_model

            model = paged_model(model)
        c = model.config
        if c.attn_impl != "paged":
            raise ValueError(
                f"Engine needs a model built with attn_impl='paged', got attn_impl={c.attn_impl!r}: "
                "load it with get_model(..., attn_impl='paged') (the dense backend keeps static "
                "batches through generate())"
            )
        for name, val in (("max_num_seqs", max_num_seqs),
                          ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r}; expected an int >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} < max_num_seqs={max_num_seqs}: "
                "every running request needs a token of the step's budget to decode"
            )
        if compile not in COMPILE_MODES or isinstance(compile, int) and not isinstance(compile, bool):
            raise ValueError(f"compile={compile!r}; expected one of {COMPILE_MODES}")
        max_model_len = c.max_expected_seq_len if max_model_len is None else max_model_len
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not (
            1 <= max_model_len <= c.max_expected_seq_len
        ):
            raise ValueError(
                f"max_model_len={max_model_len!r}; expected an int in [1, {c.max_expected_seq_len}] "
                "(the model's max_expected_seq_len)"
            )
        self.model = model
        self.budget = None
        if backend is None:
            if num_pages is None:
                self.budget = kv_cache_budget(model, max_num_batched_tokens, max_model_len,
                                              kv_memory_fraction)
                num_pages = self.budget.num_pages
            elif isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
                raise ValueError(f"num_pages={num_pages!r}; expected an int >= 2 or None")
            need = sequence_pages(max_model_len, c.page_size)
            if num_pages < need:
                raise KVBudgetError(
                    f"num_pages={num_pages} cannot hold one sequence of max_model_len={max_model_len} "
                    f"tokens: that needs {need} pages of {c.page_size} tokens (the null page "
                    f"included); pass num_pages>={need} or max_model_len<={(num_pages - 1) * c.page_size}"
                )
            backend = PagedBackend(model, max_num_seqs, max_model_len, num_pages=num_pages,
                                   kernel=kernel)
        elif backend.max_batch < max_num_seqs:
            raise ValueError(f"backend has {backend.max_batch} rows, fewer than max_num_seqs={max_num_seqs}")
        self.backend, self.pm = backend, backend.pm
        self.max_model_len = min(max_model_len, self.pm.max_seq_len)
        self.capacity = (self.pm.num_pages - 1) * self.pm.page_size  # tokens the pool can ever hold
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}; expected a bool")
        self.prefix_cache = PrefixCache(self.pm) if enable_prefix_caching else None
        self.scheduler = Scheduler(self.pm, max_num_seqs, max_num_batched_tokens, backend.release,
                                   cache=self.prefix_cache)
        self.compiled = backend.kernel in COMPILED_KERNELS if compile == "auto" else bool(compile)
        self._decode = decode_fn(backend, "tuned" if compile == "tuned" else self.compiled, model)
        # prefill and mixed steps: our LLaMA compiled around its attention (`compiled_prefill`)
        self._prefill = compiled_prefill() if self.compiled and isinstance(model, LLaMA) else None
        self.buckets = decode_buckets(max_num_seqs, smallest_batch(self._decode))
        self.vocab_size = c.src_vocab_size
        self.eos = frozenset() if c.eos_token_id is None else frozenset([c.eos_token_id])
        # submission: any thread appends (deque.append is atomic); the loop drains in step()
        self._submitted: collections.deque[Request] = collections.deque()
        self._aborted: collections.deque[int] = collections.deque()
        self._live: dict[int, list[Request]] = {}  # completions submitted and not finished, by id
        self._ids = itertools.count()  # next() is atomic in CPython
        self._finished_stats: dict[int, dict] = {}
        self._steps = 0
        self._tokens_out = 0
        self._prompt_computed = 0  # prompt tokens run through the model (not served by the cache)

    # ------------------------------------------------------------------ submission (any thread)
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> int:
        """Queue a request; returns its id. Raises TypeError / ValueError naming a bad value (an
        empty or out-of-vocabulary prompt, a request longer than the model or the pool can hold);
        nothing is queued then. Safe to call from any thread while another steps the engine.
        `cache_salt`: only requests with the same salt share prefix-cache pages (e.g. per tenant).
        `arrival_time`: when the request arrived (`time.perf_counter()` clock; default now), the
        start of its TTFT and end-to-end latency."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = check_prompt(prompt_ids, self.vocab_size)
        total = len(prompt) + params.max_new_tokens
        limit = min(self.max_model_len, self.capacity)
        if total > limit:
            which = ("max_model_len" if limit == self.max_model_len
                     else f"the page pool's capacity ({self.pm.num_pages - 1} pages of {self.pm.page_size})")
            raise ValueError(
                f"request too long: prompt of {len(prompt)} tokens + max_new_tokens="
                f"{params.max_new_tokens} = {total} tokens > {limit}, {which}"
            )
        rid = next(self._ids)
        completions = [self._request(rid, i, params.n, prompt,
                                     params.completion(i) if params.n > 1 else params, cache_salt)
                       for i in range(params.n)]
        req = completions[0]
        req.forks = completions[1:]  # FORKed from req once its prompt is prefilled
        if arrival_time is not None:
            for r in completions:
                r.arrival = float(arrival_time)
        self._live[rid] = completions
        self._submitted.append(req)
        return rid

    def _request(self, rid: int, index: int, n: int, prompt: list[int], params: SamplingParams,
                 cache_salt: str | None) -> Request:
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(params.seed)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        return Request(rid, prompt, params, stop, generator=generator, cache_salt=cache_salt,
                       index=index, n=n)

    def abort(self, request_id: int) -> None:
        """Stop a request (every completion of it); its pages are freed at the next step, which
        reports it finished with reason "abort". ValueError for an id that is not live (unknown,
        or already finished)."""
        if request_id not in self._live:
            raise ValueError(
                f"abort: request id {request_id!r} is not live (never submitted here, or finished)"
            )
        self._aborted.append(request_id)

    # ------------------------------------------------------------------ the loop
    def has_unfinished(self) -> bool:
        return bool(self._live or self._submitted or self._aborted)

    def step(self) -> list[RequestOutput]:
        """Admit submissions, apply aborts, schedule, run one forward, sample; -> the outputs of
        the requests that produced a token or finished in this step."""
        outputs = self._take_submissions()
        plan = self.scheduler.schedule()
        if plan.scheduled:
            outputs += self._run(plan)
            self._steps += 1
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every submitted request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def _take_submissions(self) -> list[RequestOutput]:
        while self._submitted:
            req = self._submitted.popleft()
            if req.status is not Status.FINISHED:  # an abort can overtake its submission
                self.scheduler.add(req)
        outputs = []
        while self._aborted:
            for req in list(self._live.get(self._aborted.popleft(), ())):
                if req.status is not Status.FINISHED:
                    self._finish(req, "abort")
                    outputs.append(RequestOutput(req.request_id, [], True, "abort", req.index))
        return outputs

    @torch.inference_mode()
    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        dec, pre = [], []  # decodes (the one token left to compute), prefill chunks
        for r, n in plan.scheduled:
            if r.num_computed + 1 == r.num_tokens:
                dec.append(r)
            else:
                pre.append((r, n))
        if pre and (not dec or self.backend.kernel == "gather"):
            dec, pre = [], plan.scheduled  # every token in one packed row (decodes: 1-token chunks)
        if pre:
            logits = self._forward_mixed(dec, pre)
        else:
            logits = self._forward_decode(dec)  # [n, V]
        # logits rows: the decode rows, then the chunks that reach their request's last token
        sampled = dec + [r for r, n in pre if r.num_computed + n == r.num_tokens]
        P, cache = self.pm.page_size, self.prefix_cache
        for r, n in plan.scheduled:
            self._prompt_computed += max(0, min(r.num_computed + n, len(r.prompt)) - r.num_computed)
            r.num_computed += n
            if cache is not None and r.num_computed // P > len(r.cache_chain):  # a page filled up
                cache.insert(r.seq_id, r.token_slice(0, r.num_computed), r.num_computed,
                             r.cache_chain, r.cache_salt)
        rows = list(range(len(sampled)))
        for i, r in enumerate(list(sampled)):
            if r.forks:  # its prompt is prefilled: the other completions share it from here
                forked = self._fork(r)
                sampled += forked
                rows += [i] * len(forked)  # ... and sample their first token from its logits
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        settings = [(r.params.temperature, r.params.top_k, r.params.top_p, r.generator) for r in sampled]
        tokens = sample_each(logits.float(), settings).tolist()  # the step's one host sync
        now = time.perf_counter()
        outputs = []
        for r, tok in zip(sampled, tokens):
            r.output.append(tok)
            r.token_times.append(now)
            self._tokens_out += 1
            reason = None
            if tok in r.stop_ids:
                reason = "stop"
            elif len(r.output) >= r.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._finish(r, reason)
            outputs.append(RequestOutput(r.request_id, [tok], reason is not None, reason, r.index))
        return outputs

    def _fork(self, parent: Request) -> list[Request]:
        """Completions 1.. of `parent` (its prompt just prefilled) FORK its pages, while rows
        are free -> those, running and computed as far as the parent; the others wait in the
        queue, to be prefilled on their own (from the prefix cache where it is on)."""
        forks, parent.forks = parent.forks, []
        running = []
        for child in forks:
            if child.status is Status.FINISHED:  # aborted meanwhile
                continue
            if not self.scheduler.admit_fork(parent, child):
                self.scheduler.waiting.appendleft(child)
                continue
            running.append(child)
        return running

    def _decode_rows(self, reqs: list[Request]) -> tuple[list, torch.Tensor, list, list]:
        """A decode batch padded to its bucket: seq ids, last tokens [B] (device), lengths, active."""
        n = len(reqs)
        pad = next(b for b in self.buckets if b >= n) - n
        last = torch.tensor([(r.output or r.prompt)[-1] for r in reqs] + [0] * pad).to(self.model.device)
        return ([r.seq_id for r in reqs] + [0] * pad, last,
                [r.num_computed for r in reqs] + [0] * pad, [True] * n + [False] * pad)

    def _forward_decode(self, reqs: list[Request]) -> torch.Tensor:
        tokens, positions, step = self.backend.decode(*self._decode_rows(reqs))
        return self._decode(self.model, tokens, positions, step)[: len(reqs)]

    def _forward_mixed(self, dec: list[Request], pre: list[tuple[Request, int]]) -> torch.Tensor:
        """Logits of the decode rows, then of the chunks that end their request's tokens."""
        starts = [r.num_computed for r, _ in pre]
        chunks = [r.token_slice(s, s + n) for (r, n), s in zip(pre, starts)]
        ids = [r.seq_id for r, _ in pre]
        if dec:
            tokens, positions, step, last = self.backend.mixed(*self._decode_rows(dec), ids, chunks, starts)
        else:
            tokens, positions, step, last = self.backend.prefill(ids, chunks, starts)
        done = [i for i, ((r, n), s) in enumerate(zip(pre, starts)) if s + n == r.num_tokens]
        at = torch.cat([torch.arange(len(dec)), torch.tensor(done, dtype=torch.long)]).to(last.device)
        at[len(dec):] = last.index_select(0, at[len(dec):])
        if self._prefill is None or tokens.shape[1] < 2:  # 1 token: a shape of its own, run eagerly
            return self.model(tokens, positions, step, logits_at=at)
        return self.model.logits(prefill_hidden(self._prefill, self.model, tokens, positions, step), at)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req)
        live = self._live.get(req.request_id, [])
        if req in live:
            live.remove(req)
        if not live:
            self._live.pop(req.request_id, None)
        stats = req.latencies()
        stats.update(prompt_tokens=len(req.prompt), output_tokens=len(req.output),
                     preemptions=req.num_preemptions, finish_reason=reason)
        # keyed by request id; the completions of an n > 1 request by (request id, index)
        key = req.request_id if req.n == 1 else (req.request_id, req.index)
        self._finished_stats[key] = stats

    def warmup(self, progress: bool = True) -> float:
        """Compile the shapes serving will meet before the first request does, -> seconds: prefill
        chunks of every packed-length bucket up to the token budget, decode batches of every
        bucket size, and a prefill beside the decodes of every bucket size (synthetic requests). Their
        statistics and cached pages are then dropped. Compiled code lands in torch's on-disk
        caches, so a second process on the same machine warms up in seconds. No-op (0.0) when
        nothing here compiles (eager model, GATHER kernel or flex-eager)."""
        if not (self.compiled or self.backend.kernel in COMPILED_KERNELS):
            return 0.0
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine: call it before submitting requests")
        t0 = time.perf_counter()
        budget, rows = self.max_num_batched_tokens, self.max_num_seqs
        top = min(budget, self.max_model_len - rows - 1, self.capacity // rows - rows - 1)
        lengths = [min(top, 128 << i) for i in range(max(1, top.bit_length() - 6))]
        rng = torch.Generator().manual_seed(0)

        def prompt(n: int) -> list[int]:
            return torch.randint(0, self.vocab_size, (max(1, n),), generator=rng).tolist()

        # each prefill bucket alone, then every row at once: request i makes 2 + i tokens, so the
        # decode batch shrinks through every bucket while prefill chunks run beside decodes; then
        # for each decode bucket b, b one-token prompts decode while one more request is prefilled
        # beside them (the all-rows wave reaches the small buckets only after every prompt is in)
        # (wave, request joining it after its first step or None)
        waves = [([(prompt(n), 2)], None) for n in lengths]
        waves.append(([(prompt(lengths[i % len(lengths)]), 2 + i) for i in range(rows)], None))
        waves += [([(prompt(1), 3)] * min(b, rows), (prompt(16), 2)) for b in self.buckets]
        bar = None
        if progress:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=sum(len(w) + (j is not None) for w, j in waves),
                           desc="fms_paged engine: compiling its shapes", unit="req", leave=False)
            except ImportError:
                print("fms_paged engine: compiling its shapes ...", flush=True)
        ids = set()

        def add(p: list[int], n: int) -> None:
            ids.add(self.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))

        for wave, join in waves:
            for p, n in wave:
                add(p, n)
            outs = []
            if join is not None:
                outs = self.step()  # the wave is prefilled; `join` is prefilled beside its decodes
                add(*join)
            for out in itertools.chain(outs, self.stream()):
                if bar is not None and out.finished:
                    bar.update(1)
        if bar is not None:
            bar.close()
        for rid in ids:  # forget the synthetic requests
            self._finished_stats.pop(rid, None)
        self._steps = self._tokens_out = self._prompt_computed = 0
        self.scheduler.num_preemptions = 0
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.queries = self.prefix_cache.hits = 0
            self.prefix_cache.evictions = self.prefix_cache.collisions = 0
        return time.perf_counter() - t0

    def reset_prefix_cache(self) -> None:
        """Forget every cached page: those no request holds return to the pool at once."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Engine state and per-request latencies (seconds) of the finished requests. Free pages
        include cached pages no request holds (reusable at once, evicted on demand)."""
        total = self.pm.num_pages - 1
        free = self.scheduler.available_pages()
        done = list(self._finished_stats.values())

        def mean(key: str) -> float | None:
            vals = [d[key] for d in done if d[key] is not None]
            return statistics.fmean(vals) if vals else None

        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._submitted),
            "kv_pages_total": total,
            "kv_pages_used": total - free,
            "kv_pages_free": free,
            "kv_used_pct": 100.0 * (total - free) / total,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self._steps,
            "output_tokens": self._tokens_out,
            "prompt_tokens_computed": self._prompt_computed,
            "finished_requests": len(done),
            "mean_ttft_s": mean("ttft"),
            "mean_tpot_s": mean("tpot"),
            "mean_e2e_s": mean("e2e"),
            **(self.prefix_cache.metrics() if self.prefix_cache else {}),
            "requests": dict(self._finished_stats),
        }
