"""The continuous-batching engine: requests arrive at any time, are admitted as pages free up, and
are preempted (then recomputed) instead of failing when the pool runs dry.

One loop owns the page pool. `step()` takes the requests submitted since the last step (from any
thread), then, as nano-vllm and vLLM v1 do:

    plan = scheduler.schedule()             # host only: who runs, how many tokens, preemption
    result = runner.run(plan)               # the device: inputs, one forward, sampling
    outputs = book(plan, result)            # `Scheduler.update`: forks, cache inserts, stops,
                                            # finishing; finished requests leave, stats counted

Tensor parallelism (`fms_paged.engine.tensor_parallel`) stays out of the step: rank 0's runner
sends each step's message, and the other ranks drive their engines through the public surface
`enqueue`, `queue_abort`, `take_submissions`, `book` and `forget_totals`.

A process serving for weeks runs it, so the engine keeps nothing of a request past its end: the
final output of each completion carries the request's statistics (`RequestOutput.stats`), and the
engine keeps only running totals of them (`metrics()`), O(1) memory whatever it has served.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import time
from collections.abc import Iterator, Sequence

import torch

from fms_paged.engine import beam
from fms_paged.engine import runner as model_runner
from fms_paged.engine.draft import DraftModel, load_draft
from fms_paged.engine.prefix_cache import PrefixCache
from fms_paged.engine.request import Request, RequestOutput, SamplingParams, Status, check_prompt
from fms_paged.engine.runner import ModelRunner, check_modes
from fms_paged.engine.scheduler import Scheduler, SchedulerOutput, StepResult
from fms_paged.engine.speculative import SpeculativeConfig, SpeculativeConfigError, Speculator
from fms_paged.engine.structured import Grammar, Grammars
from fms_paged.engine.tensor_parallel import split_for_engine
from fms_paged.kv.budget import KVBudgetError, kv_cache_budget
from fms_paged.kv.paged import PagedBackend, attention_specs, model_groups
from fms_paged.kv.quant import check_kv_cache_dtype
from fms_paged.kv.spec import release_horizon
from fms_paged.parallel import TensorParallelError


def check_pages(num_pages: int, need: int, max_model_len: int, page_size: int, fits: int) -> None:
    """KVBudgetError unless `num_pages` holds `need` pages (one sequence of max_model_len at its
    most pages at once, in every layer slice, and the null page); `fits`: the longest sequence
    those pages hold (`LayerGroups.capacity`), which the message suggests."""
    if num_pages < need:
        raise KVBudgetError(
            f"num_pages={num_pages} cannot hold one sequence of max_model_len={max_model_len} "
            f"tokens: that needs {need} pages of {page_size} tokens (the null page "
            f"included); pass num_pages>={need}" + (f" or max_model_len<={fits}" if fits > 0 else "")
        )


# decode_steps="auto": lookahead decode steps where they pay and cannot hurt: at most this many in
# one call, and as many as the engine's timed decode steps fit in this many seconds (what a call
# holds a stream's tokens back, and delays a request arriving meanwhile, by at most: about one
# step of a 1B model in bf16 on a 2-core CPU, which then decodes a token a step)
AUTO_DECODE_STEPS, LOOKAHEAD_BUDGET_S = 8, 0.05


def check_decode_steps(steps) -> None:
    """`decode_steps`: an int >= 1 or "auto" (ValueError naming the value otherwise)."""
    if steps != "auto" and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"decode_steps={steps!r}; expected an int >= 1 or 'auto'")


class Engine:
    """Continuous batching over a paged model (`attn_impl="paged"`, or an IBM FMS model through
    `fms_paged.integrations.fms.paged_model`, applied here to a model from the `fms` package).

    max_num_seqs: requests running at once (rows of the page table).
    max_num_batched_tokens: tokens in one forward (decodes + prefill chunks), >= max_num_seqs.
    num_pages: pool size; None sizes it by memory (`fms_paged.kv.budget.kv_cache_budget`, with
        `kv_memory_fraction`).
    compile: "auto" (compiled steps where the flex kernel runs; the cpp kernel's run eagerly
        through the C++ operators, a step's layers in one call), True or False
        (`fms_paged.engine.runner.ModelRunner`).
    cuda_graphs: "auto" (decode steps replayed from a CUDA graph per decode bucket where the
        compiled flex kernel runs on CUDA), True (required: ValueError elsewhere) or False.
    max_model_len: longest prompt + output (default: the model's `max_expected_seq_len`).
    kernel: the paged attention kernel (`fms_paged.kv.kernels.KERNELS`).
    backend: an existing `PagedBackend` (or a `fms_paged.kv.cache.PagedCache`: its backend) to
        run on (its pool and rows) instead of a new one; the engine's scheduler owns its page table
        from then on.
    enable_prefix_caching: share the KV of full pages whose tokens (and `cache_salt`) a request
        starts with, computed once and kept after their requests finish until the pool needs the
        pages (`fms_paged.engine.prefix_cache`); outputs do not change.
    tokenizer: the model's (`fms_paged.load_tokenizer`), for requests with a grammar
        (`SamplingParams.grammar`: structured outputs), which it compiles against.
    tensor_parallel_size: ranks to split the model over (`fms_paged.parallel`: heads and MLP,
        each rank its kv heads' slice of every page; gloo on the CPU, NCCL on CUDA, GPU r for rank
        r). The engine spawns ranks 1.. on this host and splits `model` (one of ours, whole, the
        same on every rank) in place, or, under torchrun, uses the ranks there
        (`fms_paged.engine.tensor_parallel`). A model already split (`model.tp`) brings its own
        rank: rank 0 is driven as any engine, the others by `run_worker`.
    decode_steps: up to this many greedy decode steps in one forward where every running request
        decodes greedily (no log-probabilities, no grammar) and none waits (vLLM's multi-step
        scheduling): on the cpp kernel, one operator call with no host work between the steps
        (`fms_paged::decode_greedy`); a request's tokens of such a step arrive together, and those
        after its stop are dropped. Beam searches take such steps too, greedy requests beside them,
        where the searches running have one width (`fms_paged::decode_beams`). 1: a token per step.
        "auto" (default): as many (up to `AUTO_DECODE_STEPS`) as fit in `LOOKAHEAD_BUDGET_S` by the
        engine's timed decode steps, so that a call holds a stream's tokens back, and delays a
        request arriving meanwhile, by at most about that long; a model whose decode step takes
        longer gets one (docs/design.md).
    kv_cache_dtype: what the pages store (`fms_paged.kv.quant.KV_CACHE_DTYPES`): "auto" the
        model's dtype, "int8" / "fp8_e4m3" 8-bit values with their scales; None: the model
        config's (`get_model(..., kv_cache_dtype=...)`). Ignored with a `backend` (its own).
    speculative: speculative decoding, as vLLM's `speculative_config`: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} (prompt
        lookup, `fms_paged.engine.speculative`): each decoding request proposes up to k tokens
        from its own tokens, verified in one forward; greedy outputs do not change, sampled ones
        keep their distribution (rejection sampling). None (default): off. Not with tensor
        parallelism.
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
        cuda_graphs: bool | str = "auto",
        tokenizer=None,
        tensor_parallel_size: int = 1,
        decode_steps: int | str = "auto",
        kv_cache_dtype: str | None = None,
        speculative: dict | SpeculativeConfig | None = None,
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
        check_modes(compile, cuda_graphs)
        if kv_cache_dtype is not None:
            check_kv_cache_dtype(kv_cache_dtype)
        check_decode_steps(decode_steps)
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or (
                tensor_parallel_size < 1):
            raise TensorParallelError(f"tensor_parallel_size={tensor_parallel_size!r}; expected an int >= 1")
        speculative = SpeculativeConfig.parse(speculative)
        if speculative is not None and (tensor_parallel_size > 1 or getattr(model, "tp", None) is not None):
            raise SpeculativeConfigError("speculative decoding with tensor parallelism is not supported "
                                         f"(tensor_parallel_size={tensor_parallel_size})")
        settings = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        num_pages=num_pages, kv_memory_fraction=kv_memory_fraction, compile=compile,
                        max_model_len=max_model_len, kernel=kernel,
                        enable_prefix_caching=enable_prefix_caching, cuda_graphs=cuda_graphs,
                        tokenizer=tokenizer, kv_cache_dtype=kv_cache_dtype)
        c = model.config
        max_model_len = c.max_expected_seq_len if max_model_len is None else max_model_len
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not (
            1 <= max_model_len <= c.max_expected_seq_len
        ):
            raise ValueError(
                f"max_model_len={max_model_len!r}; expected an int in [1, {c.max_expected_seq_len}] "
                "(the model's max_expected_seq_len)"
            )
        # every layer windowed: pages behind the widest window are released (`Scheduler`), and a
        # request holds at most the pages of a step and the window before it; with layer groups
        # (`fms_paged.kv.groups`), each sliding group holds its own window's pages
        horizon = release_horizon(attention_specs(model))
        groups = model_groups(model)
        need = groups.min_pool_pages(max_model_len, c.page_size, max_num_batched_tokens)
        if backend is None and num_pages is not None:
            if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
                raise ValueError(f"num_pages={num_pages!r}; expected an int >= 2 or None")
            check_pages(num_pages, need, max_model_len, c.page_size,
                        groups.capacity(num_pages, c.page_size, max_num_batched_tokens, max_model_len))
        model, self._ranks, self.control = split_for_engine(model, tensor_parallel_size, backend, Engine,
                                                             settings)
        try:
            self._build(model, backend, num_pages, need, groups, horizon, max_num_seqs,
                        max_num_batched_tokens,
                        max_model_len, kv_memory_fraction, kernel, enable_prefix_caching, compile,
                        cuda_graphs, tokenizer, decode_steps, kv_cache_dtype, speculative)
        except BaseException:
            self.shutdown()  # the ranks spawned or joined for this engine are let go
            raise

    def _build(self, model, backend, num_pages, need, groups, horizon, max_num_seqs, max_num_batched_tokens,
               max_model_len, kv_memory_fraction, kernel, enable_prefix_caching, compile, cuda_graphs,
               tokenizer, decode_steps, kv_cache_dtype, speculative=None) -> None:
        c = model.config
        self.model = model
        self.budget = None
        if backend is None:
            if num_pages is None:
                self.budget = kv_cache_budget(model, max_num_batched_tokens, max_model_len,
                                              kv_memory_fraction, kv_cache_dtype)
                num_pages = self.budget.num_pages
            if self.control is not None:  # the fewest any rank's memory holds: one page table
                agreed = torch.tensor([num_pages])
                torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=self.control)
                num_pages = int(agreed)
            check_pages(num_pages, need, max_model_len, c.page_size,
                        groups.capacity(num_pages, c.page_size, max_num_batched_tokens, max_model_len))
            backend = PagedBackend(model, max_num_seqs, max_model_len, num_pages=num_pages,
                                   kernel=kernel, kv_cache_dtype=kv_cache_dtype)
        else:
            backend = getattr(backend, "backend", backend)  # a PagedCache: its backend
        if backend.max_batch < max_num_seqs:
            raise ValueError(f"backend has {backend.max_batch} rows, fewer than max_num_seqs={max_num_seqs}")
        self.backend, self.pm = backend, backend.pm
        self.max_model_len = min(max_model_len, self.pm.max_seq_len)
        # the longest request the pool can hold: a page per token in the full groups, the pages of a
        # step and the window before it in the sliding ones
        self.capacity = groups.capacity(self.pm.num_pages, self.pm.page_size, max_num_batched_tokens,
                                        self.max_model_len)
        self.horizon = horizon
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}; expected a bool")
        # (layer groups with no full-attention group have no pages to name cached entries by)
        self.prefix_cache = PrefixCache(self.pm) if enable_prefix_caching and (
            not groups.grouped or groups.windows[0] is None) else None
        self.runner = ModelRunner(model, backend, max_num_seqs, compile, cuda_graphs)
        if self.runner.compiled and hasattr(model, "rope_tables"):
            # a compiled step reads the RoPE tables as they were when it was traced (a graph cannot
            # grow them, `RotaryEmbedding.ensure`): grown now to every position the model takes, so
            # that no later engine on the model grows them under a traced graph (a recompile)
            model.rope_tables(model.config.max_expected_seq_len)
        self.runner.ranks = self._ranks  # rank 0 of tensor-parallel ranks: each run sends the step
        # lookahead decode steps where the runner runs them in one call (never split over ranks)
        ready = self.runner.decodes_in_one_call if self.control is None else None
        self.speculator = None
        if speculative is not None:
            draft = None
            if speculative.method == "draft_model":
                draft = DraftModel(load_draft(speculative.model, model), c.src_vocab_size, max_num_seqs,
                                   self.max_model_len, kernel)
            self.speculator = Speculator(speculative, draft)
        self._decode_steps, self._token_s = decode_steps, None  # (auto: a decode token step's seconds)
        # (auto: the most steps a call; with prompt lookup inside the call, as many forwards' tokens)
        self._auto_cap = AUTO_DECODE_STEPS * (1 + speculative.num_speculative_tokens if (
            self.speculator is not None and self.speculator.in_call) else 1)
        self.scheduler = Scheduler(self.pm, max_num_seqs, max_num_batched_tokens, cache=self.prefix_cache,
                                   horizon=horizon,
                                   decode_steps=1 if decode_steps == "auto" else decode_steps,
                                   lookahead_ready=ready, speculator=self.speculator)
        self.vocab_size = c.src_vocab_size
        eos = c.eos_token_id
        self.eos = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        # submission: any thread appends (deque.append is atomic); the loop drains in step()
        self._submitted: collections.deque[Request] = collections.deque()
        # (request id, completion index or None: all of them), applied at the next step
        self._aborted: collections.deque[tuple[int, int | None]] = collections.deque()
        self._live: dict[int, list[Request]] = {}  # completions submitted and not finished, by id
        self._ids = itertools.count()  # next() is atomic in CPython
        self.tokenizer, self._grammars = tokenizer, None
        self._reset_totals()


    @property
    def decode_steps(self) -> int | str:
        """Greedy decode steps one forward may take (`Scheduler.lookahead`), or "auto"; settable."""
        return self._decode_steps

    @decode_steps.setter
    def decode_steps(self, steps: int | str) -> None:
        check_decode_steps(steps)
        self._decode_steps = steps
        self.scheduler.decode_steps = 1 if steps == "auto" else steps
        if steps == "auto" and self._token_s is not None:
            self._auto_steps(self._token_s)

    def _auto_steps(self, token_s: float) -> None:
        """decode_steps="auto": a decode step took `token_s` seconds a token -> its recent mean,
        and the lookahead steps that fit in `LOOKAHEAD_BUDGET_S` by it (at most
        `AUTO_DECODE_STEPS`; with prompt lookup inside the call, whose forwards give several
        tokens, that many times 1 + num_speculative_tokens: the time bound holds either way)."""
        m = token_s if self._token_s is None else self._token_s + 0.2 * (token_s - self._token_s)
        self._token_s = m
        self.scheduler.decode_steps = max(1, min(self._auto_cap, int(LOOKAHEAD_BUDGET_S / m)))

    @property
    def tp_ranks(self):
        """Rank 0's handle on the other tensor-parallel ranks (`tensor_parallel.Ranks`), else None."""
        return self._ranks

    @property
    def tp_rank(self) -> int:
        """This engine's tensor-parallel rank (0 without tensor parallelism)."""
        tp = getattr(self.model, "tp", None)
        return 0 if tp is None else tp.rank

    @property
    def grammars(self) -> Grammars:
        """The grammars of structured outputs, compiled for the engine's tokenizer (made on first
        use: xgrammar is imported and the vocabulary read then)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.grammar needs the model's tokenizer: Engine(..., "
                                 "tokenizer=fms_paged.load_tokenizer(checkpoint_dir))")
            self._grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos))
            self.runner.grammars = self._grammars
        return self._grammars

    def _reset_totals(self) -> None:
        """The running totals behind `metrics()` (the scheduler and prefix cache count theirs)."""
        self._steps = 0
        self._finished_by_reason: dict[str, int] = {}
        # latency key -> [sum of seconds, requests that have it]
        self._latency_sums = {k: [0.0, 0] for k in ("ttft", "tpot", "e2e")}

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
        if params.use_beam_search:  # k rows, and the k beams' pages
            beam.check_request(params, len(prompt), self.max_num_seqs, self.pm.page_size,
                               self.pm.num_pages - 1, self.backend.groups.num_slices,
                               self.control is not None)
        rid = next(self._ids)
        self.enqueue(rid, prompt, params, cache_salt, arrival_time)
        return rid

    def enqueue(self, rid: int, prompt: list[int], params: SamplingParams, cache_salt: str | None = None,
                arrival_time: float | None = None) -> None:
        """Queue a request under id `rid` as it is (`add_request` checks it and picks the id; a
        tensor-parallel worker queues rank 0's requests under rank 0's ids). Any thread."""
        completions = [self._request(rid, i, params.n, prompt,
                                     params.completion(i) if params.n > 1 else params, cache_salt)
                       for i in range(params.n)]
        req = completions[0]
        req.forks = completions[1:]  # FORKed from req once its prompt is prefilled
        if params.use_beam_search:  # the completions are the beams of one search
            beam.BeamGroup(completions, params)
        req.submitted = params
        if arrival_time is not None:
            for r in completions:
                r.arrival = float(arrival_time)
        self._live[rid] = completions
        self._submitted.append(req)

    def _request(self, rid: int, index: int, n: int, prompt: list[int], params: SamplingParams,
                 cache_salt: str | None) -> Request:
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(params.seed)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        prompt_lps = [] if params.prompt_logprobs is not None and index == 0 else None
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        return Request(rid, prompt, params, stop, generator=generator, cache_salt=cache_salt,
                       index=index, n=n, prompt_lps=prompt_lps, matcher=matcher)

    def abort(self, request_id: int, index: int | None = None) -> None:
        """Stop a request (every completion of it, or only completion `index`); its pages are freed
        at the next step, which reports it finished with reason "abort". ValueError for an id
        that is not live (unknown, or already finished), or a completion that is not. Safe to call
        from any thread; a request that finishes before the next step stays finished as it was."""
        live = self._live.get(request_id)
        if live is None:
            raise ValueError(
                f"abort: request id {request_id!r} is not live (never submitted here, or finished)"
            )
        if index is not None and not any(r.index == index for r in list(live)):
            raise ValueError(f"abort: completion {index!r} of request {request_id} is not live "
                             f"(live: {sorted(r.index for r in list(live))})")
        self.queue_abort(request_id, index)

    def queue_abort(self, request_id: int, index: int | None = None) -> None:
        """Queue an abort as it is, applied by the next `take_submissions` and ignored if the
        request has finished by then (`abort` checks it first; a tensor-parallel worker replays
        rank 0's). Any thread."""
        self._aborted.append((request_id, index))

    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (a server's backpressure check): safe to call
        from any thread (lengths of a deque and a list only)."""
        return len(self._submitted) + len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the loop
    def has_unfinished(self) -> bool:
        return bool(self._live or self._submitted or self._aborted)

    def step(self) -> list[RequestOutput]:
        """One engine step -> the outputs of the requests that produced a token or finished in it."""
        # new requests queued, aborts applied
        outputs = self.take_submissions() if self._submitted or self._aborted else []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()  # host only: who runs, how many tokens, their pages
        result = self.runner.run(plan)  # the device: one forward, sampling
        booked = self.book(plan, result)  # tokens appended, stops, finished requests dropped
        outputs += booked
        seconds = time.perf_counter() - t0
        if self.speculator is not None:
            if plan.lookup is None:  # (its proposal lengths weigh a row's cost; a lookahead call's
                self.speculator.timed(plan, seconds)  # proposals time themselves)
            if (plan.lookup is not None or plan.verifies) and not plan.prefills:  # (inside calls or not)
                tokens = sum(len(o.new_token_ids) for o in booked)
                self.speculator.rate(plan.lookup is not None, seconds, tokens)
        if self._decode_steps == "auto" and (plan.decodes or plan.verifies) and not plan.prefills:
            # (a step that verifies between steps counts as one: with speculation on, every step
            # may verify, and the lookahead calls, where prompt lookup verifies inside, must start)
            self._auto_steps(seconds / plan.steps)
        return outputs

    def book(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Book a step's results (`Scheduler.update`): finished completions leave the live table,
        their statistics join the totals. -> the step's outputs. A tensor-parallel worker books
        rank 0's tokens here too."""
        outputs, finished = self.scheduler.update(plan, result)
        for req in finished:
            self._forget(req)
        for out in outputs:
            if out.stats is not None:
                self._count(out.stats)
        if plan.scheduled:
            self._steps += 1
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every submitted request has finished, yielding outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def take_submissions(self) -> list[RequestOutput]:
        """The loop's intake: requests submitted since the last step go to the scheduler, aborts
        asked since are applied (-> their final outputs). On rank 0 of tensor-parallel ranks, both
        are noted for the other ranks' next message."""
        ranks = self._ranks
        while self._submitted:
            req = self._submitted.popleft()
            if ranks is not None:
                ranks.note_add(req.request_id, req.prompt, req.submitted, req.cache_salt)
            if req.status is not Status.FINISHED:  # an abort can overtake its submission
                self.scheduler.add(req)
        outputs = []
        while self._aborted:
            rid, index = self._aborted.popleft()
            if ranks is not None:
                ranks.note_abort(rid, index)
            for req in list(self._live.get(rid, ())):  # (none left: it finished meanwhile)
                # (a beam search ends as a whole)
                if index is None or req.index == index or req.beam is not None:
                    self.scheduler.finish(req)
                    self._forget(req)
                    lps = None if req.params.logprobs is None else []
                    stats = req.stats("abort")
                    self._count(stats)
                    outputs.append(RequestOutput(rid, [], True, "abort", req.index, lps, stats))
        return outputs

    def _forget(self, req: Request) -> None:
        """A finished completion leaves the live table (the id with its last completion)."""
        live = self._live[req.request_id]
        live.remove(req)
        if not live:
            del self._live[req.request_id]

    def _count(self, stats: dict) -> None:
        """Add a finished completion's statistics to the running totals."""
        reason = stats["finish_reason"]
        self._finished_by_reason[reason] = self._finished_by_reason.get(reason, 0) + 1
        for key, acc in self._latency_sums.items():
            if stats[key] is not None:
                acc[0] += stats[key]
                acc[1] += 1

    def warmup(self, progress: bool = True) -> float:
        """Compile the shapes serving will meet before the first request does, -> seconds: prefill
        chunks of every packed-length bucket up to the token budget, decode batches of every
        bucket size, and a prefill beside the decodes of every bucket size (synthetic requests,
        `runner.warmup_waves`). The totals they added to and their cached pages are then
        dropped. Compiled code lands in torch's on-disk caches, so a second process on the same
        machine warms up in seconds. No-op (0.0) when nothing here compiles (eager steps of the
        cpp or gather kernel; the flex kernel compiles its attention even in eager steps). With a
        tokenizer and xgrammar installed, the grammars are made too (xgrammar's import and the
        vocabulary's reading, ~1 s, not the first structured request's)."""
        t0 = time.perf_counter()
        grammars = self.tokenizer is not None and importlib.util.find_spec("xgrammar") is not None
        if grammars:
            self.grammars.matcher(Grammar("json_object"))
        if not (self.runner.compiled or self.backend.kernel.always_compiles):
            return time.perf_counter() - t0 if grammars else 0.0
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine: call it before submitting requests")
        bar = None

        def start(total: int):
            nonlocal bar
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print("fms_paged engine: compiling its shapes ...", flush=True)
                return lambda: None
            bar = tqdm(total=total, desc="fms_paged engine: compiling its shapes", unit="req", leave=False)
            return lambda: bar.update(1)

        model_runner.warmup(self, start if progress else None)
        if bar is not None:
            bar.close()
        self.forget_totals()  # forget the synthetic requests
        if self._ranks is not None:
            self._ranks.note_reset()
        return time.perf_counter() - t0

    def forget_totals(self) -> None:
        """The totals and the prefix cache as after a start (what a warm-up's requests left; a
        tensor-parallel worker follows rank 0's)."""
        self._reset_totals()
        self.scheduler.num_output_tokens = self.scheduler.num_prompt_computed = 0
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.reset_totals()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.queries = self.prefix_cache.hits = 0
            self.prefix_cache.evictions = self.prefix_cache.collisions = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached page: those no request holds return to the pool at once."""
        if self._ranks is not None:
            raise RuntimeError("reset_prefix_cache() under tensor parallelism: not supported (every "
                               "rank's cache must stay the same)")
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def shutdown(self, result=None) -> None:
        """Tensor parallelism (no-op without it): on rank 0, stop the other ranks' `run_worker`
        loops (which return `result`); on every rank, release the step-message group, and the
        process group too where this engine spawned the ranks (under torchrun it is the caller's).
        The engine takes no more steps after."""
        if self.control is None:
            return
        spawned = False
        if self._ranks is not None:
            spawned = bool(self._ranks.procs)
            self._ranks.stop(result)
            self._ranks = None
            if getattr(self, "runner", None) is not None:  # (absent when the build failed)
                self.runner.ranks = None
        torch.distributed.destroy_process_group(self.control)
        self.control = None
        if spawned:
            torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Engine state and totals since it started (or warmed up), with the mean latencies
        (seconds) of the finished completions: per-request figures are in each completion's final
        output (`RequestOutput.stats`), not kept here. Free pages include cached pages no request
        holds (reusable at once, evicted on demand)."""
        total = self.pm.num_pages - 1
        free = self.scheduler.available_pages()

        def mean(key: str) -> float | None:
            s, n = self._latency_sums[key]
            return s / n if n else None

        return {
            "running": len(self.scheduler.running),
            "waiting": self.num_waiting(),
            "kv_pages_total": total,
            "kv_pages_used": total - free,
            "kv_pages_free": free,
            "kv_used_pct": 100.0 * (total - free) / total,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self._steps,
            "output_tokens": self.scheduler.num_output_tokens,
            "prompt_tokens_computed": self.scheduler.num_prompt_computed,
            "finished_requests": sum(self._finished_by_reason.values()),
            "finished_by_reason": dict(self._finished_by_reason),
            "mean_ttft_s": mean("ttft"),
            "mean_tpot_s": mean("tpot"),
            "mean_e2e_s": mean("e2e"),
            **(self.prefix_cache.metrics() if self.prefix_cache else {}),
            **(self.speculator.metrics() if self.speculator else {}),
        }
