"""The engine loop, in a process of its own: it builds the model and the `Engine` (and so owns the
page pool), and steps it while it has work. The HTTP front end (an asyncio event loop in the parent
process) submits and aborts through a pipe and gets each request's outputs on an asyncio queue.

Why a process and not a thread: the front end's Python work (parsing, detokenizing, writing each
token's chunk) and the engine's Python work between kernels would share one GIL, and every kernel
launch of the engine would wait for the front end to let go of it; vLLM splits its API server and
its engine core into processes for the same reason. Requests get ids from the front end; the loop
maps them to the engine's and back. A step's outputs cross the pipe in one message, with the
engine's gauges at most every `METRICS_INTERVAL_S`; a reader thread in the front end hands them to
the event loop in one `call_soon_threadsafe`. When every completion of a request has finished, both
sides drop it: nothing of a finished request is kept."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fms_paged.engine import RequestOutput, SamplingParams

log = logging.getLogger("fms_paged.serve")
METRICS_INTERVAL_S = 0.05  # how often a busy loop sends the engine gauges


class State(enum.Enum):
    STARTING = "starting"
    WARMING_UP = "warming up"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineDead(RuntimeError):
    """The engine loop stopped (an error in a step, or shutdown): in-flight requests end with it."""


class EngineBuildError(ValueError):
    """The engine process could not load the model or build the engine (the message says why)."""


def build_engine(spec: dict[str, Any]):
    """The model and `Engine` a spec describes (`serve.server.engine_spec`)."""
    from fms_paged.engine import Engine
    from fms_paged.models.loaders import load_for_engine
    from fms_paged.tokenizers import load_tokenizer

    size, rank = spec.get("tensor_parallel_size", 1), None
    if spec.get("torchrun"):  # one of torchrun's ranks: join them (this rank's GPU set first)
        from fms_paged.device import resolve_device
        from fms_paged.engine.tensor_parallel import join_torchrun

        rank, size = join_torchrun(resolve_device(spec["device"]))
    quantization = spec.get("quantization")
    if quantization is not None and size > 1:
        from fms_paged.modules.quantized import QuantizationError

        raise QuantizationError(f"quantization={quantization!r} with tensor_parallel_size={size}: a "
                                "quantized model is not split over ranks; serve it on one")
    model = load_for_engine(spec["model_dir"], spec.get("loader", "auto"), spec["device"], spec["dtype"],
                            spec["page_size"], quantization, spec.get("quantization_group_size", 128))
    if rank is not None:  # keep this rank's part: the model brings its rank to the Engine
        from fms_paged.parallel import shard

        model, size = shard(model, rank, size), 1
    return Engine(model, spec["max_num_seqs"], spec["max_num_batched_tokens"],
                  tokenizer=load_tokenizer(spec["model_dir"]), kv_memory_fraction=spec["kv_memory_fraction"],
                  max_model_len=spec["max_model_len"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                  enable_prefix_caching=spec["enable_prefix_caching"],
                  compile=False if spec["enforce_eager"] else "auto", tensor_parallel_size=size,
                  speculative=spec.get("speculative"))


def _engine_main(conn, spec: dict[str, Any]) -> None:
    """The engine process: build, report, warm up, then serve messages and step until told to stop
    (or until the front end's end of the pipe closes)."""
    # The front end decides when this process stops: it drains its requests, then sends "stop". A
    # Ctrl-C or a supervisor's SIGTERM reaches the whole process group (systemd's
    # KillMode=control-group, `kill -TERM -PGID`), this process included; SIGINT is ignored and
    # SIGTERM caught by a no-op, not ignored, so that processes spawned from here (tensor-parallel
    # ranks) start with SIGTERM's default action and still die with their parent (PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _defer_to_front_end)
    logging.basicConfig(level=spec.get("log_level", "info").upper(),  # as the front end's
                        format="%(levelname)s %(name)s: %(message)s")
    from fms_paged.device import keep_freed_cpu_memory

    keep_freed_cpu_memory()  # a serving process keeps its step buffers (see the function)
    try:
        engine = build_engine(spec)
    except Exception as e:
        conn.send(("build_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("built", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                         "capacity": engine.capacity}))
    if engine.tp_ranks is not None:  # a rank gone: the front end hears why, this process ends
        engine.tp_ranks.on_dead = lambda why: _die(conn, why)
    try:
        warmup_s = engine.warmup(progress=True) if not spec["enforce_eager"] else 0.0
        conn.send(("ready", warmup_s))
        _serve(conn, engine)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as e:
        logging.getLogger("fms_paged.serve").exception("fms-paged serve: the engine loop died")
        try:
            conn.send(("dead", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
    finally:
        engine.shutdown()


def _defer_to_front_end(signum: int, frame) -> None:
    """SIGTERM in the engine process: nothing; the front end drains and then sends "stop"."""


def _die(conn, why: str) -> None:
    """A tensor-parallel rank died (its peers' next collective would wait for it): say why to the
    front end and end this process at once (its own workers die with it)."""
    try:
        conn.send(("dead", why))
    except (OSError, EOFError):
        pass
    os._exit(1)


def _serve(conn, engine) -> None:
    to_engine: dict[int, int] = {}  # front-end id -> engine request id
    to_front: dict[int, tuple[int, list[int]]] = {}  # engine id -> (front-end id, [completions left])
    last = 0.0
    while True:
        if not engine.has_unfinished():
            conn.send(("state", engine.metrics()))
            conn.poll(None)
        while conn.poll(0):
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                _, fid, prompt, params, arrival = msg
                try:
                    rid = engine.add_request(prompt, params, arrival_time=arrival)
                except (TypeError, ValueError) as e:
                    conn.send(("reject", fid, str(e)))
                    continue
                to_engine[fid], to_front[rid] = rid, (fid, [params.n])
            elif kind == "abort":
                _, fid, index = msg
                rid = to_engine.get(fid)
                if rid is not None:
                    try:
                        engine.abort(rid, index)
                    except ValueError:  # that completion finished already
                        pass
            elif kind == "stop":
                for rid in list(to_front):
                    engine.abort(rid)
                while engine.has_unfinished():
                    engine.step()
                return
        if not engine.has_unfinished():
            continue
        outputs = engine.step()
        wire = []  # plain tuples: a step's outputs pickle in microseconds, dataclasses do not
        for out in outputs:
            fid, left = to_front[out.request_id]
            if out.finished:
                left[0] -= 1
                if not left[0]:
                    del to_front[out.request_id], to_engine[fid]
            wire.append((fid, out.new_token_ids, out.finished, out.finish_reason, out.index,
                         out.logprobs, out.stats, out.prompt_logprobs))
        now = time.perf_counter()
        state = None
        if now - last > METRICS_INTERVAL_S:
            state, last = engine.metrics(), now
        if wire or state is not None:
            conn.send(("out", wire, state, now))


class _Sink:
    __slots__ = ("loop", "queue", "n", "remaining", "started")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, n: int):
        self.loop, self.queue, self.n, self.remaining, self.started = loop, queue, n, n, False


class EngineLoop:
    """The front end's handle on the engine process.

    spec: what `build_engine` builds. `start()` starts the process and waits until the engine is
    built (EngineBuildError if it cannot be: a bad checkpoint or flag fails before the port opens);
    it then warms up (`Engine.warmup`, its progress bar on stderr) and reports READY. Callbacks, in
    the front end's reader thread: on_finished(out) for each finished completion, on_tokens(n) with
    the tokens a step generated, on_state(metrics_dict) with `Engine.metrics()` at most every
    `METRICS_INTERVAL_S` while busy and once when idle, on_ready(warm-up seconds) once, on_dead(why)
    if the engine process stops unasked."""

    def __init__(self, spec: dict[str, Any],
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_state: Callable[[dict], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None,
                 on_ready: Callable[[float], None] | None = None,
                 on_dead: Callable[[str], None] | None = None):
        self.spec = spec
        self.state = State.STARTING
        self.error: str | None = None
        self.warmup_s: float | None = None
        self.info: dict[str, Any] = {}
        self._on_finished, self._on_state = on_finished, on_state
        self._on_tokens, self._on_ready, self._on_dead = on_tokens, on_ready, on_dead
        self._lock = threading.Lock()  # the sinks, and the pipe's sending end
        self._sinks: dict[int, _Sink] = {}
        self._waiting = 0  # submitted requests that have produced nothing yet
        self._ids = itertools.count()
        self._reasons: dict[tuple[int, int], str] = {}  # (id, index) -> reason to count it under
        self._proc = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Start the engine process; -> its `info` (max_model_len, vocab_size, capacity) once built."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or torch state
        self._conn, child = ctx.Pipe()
        # tensor-parallel: the engine process spawns its ranks, which a daemonic process may not
        # (its ranks die with it: PDEATHSIG)
        tp = self.spec.get("tensor_parallel_size", 1) > 1
        self._proc = ctx.Process(target=_engine_main, args=(child, self.spec), name="fms-paged-engine",
                                 daemon=not tp)
        self._proc.start()
        child.close()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise EngineBuildError(f"the engine process built nothing in {timeout:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise EngineBuildError(f"the engine process exited ({self._proc.exitcode}) while "
                                   "building the engine") from None
        if kind == "build_error":
            self._proc.join(10)
            raise EngineBuildError(payload)
        self.info, self.state = payload, State.WARMING_UP
        self._reader = threading.Thread(target=self._read, name="fms-paged-engine-reader", daemon=True)
        self._reader.start()
        return self.info

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is running, stop the engine process, wait for it."""
        if self._proc is None:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)
        self.state = State.STOPPED

    # ------------------------------------------------------------------ front end (event loop)
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, arrival: float | None,
               queue: asyncio.Queue) -> int:
        """-> the request's id; its `RequestOutput`s arrive on `queue` (an asyncio queue of the
        calling event loop; several requests may share one) as (output, time its step ended), or
        an `EngineDead` if the engine stops. Checks belong to the caller: a request the engine
        refuses arrives as an error."""
        if self.state is not State.READY:
            raise EngineDead(f"the engine is {self.state.value}" + (f": {self.error}" if self.error else ""))
        fid = next(self._ids)
        with self._lock:
            self._sinks[fid] = _Sink(asyncio.get_running_loop(), queue, params.n)
            self._waiting += 1
            self._conn.send(("add", fid, list(prompt_ids), params, arrival))
        return fid

    def abort(self, request_id: int, index: int | None = None, reason: str = "abort") -> None:
        """Abort a request (or only its completion `index`) if it is still running (its pages free
        at the engine's next step); else nothing. `reason`: what the metrics count it as (a
        completion ended by a stop string is "stop"; needs `index`)."""
        with self._lock:
            if request_id not in self._sinks:
                return
            if reason != "abort" and index is not None:
                self._reasons[(request_id, index)] = reason
        try:
            self._send(("abort", request_id, index))
        except OSError:  # the engine process is gone; its requests end with EngineDead
            pass

    def num_waiting(self) -> int:
        """Submitted requests that have produced no token yet (waiting, or in their prefill)."""
        return self._waiting

    def _send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "out":
                    wire, state, made_at = rest
                    if wire:
                        self._dispatch([RequestOutput(*w) for w in wire], made_at)
                    if state is not None and self._on_state is not None:
                        self._on_state(state)
                elif kind == "state":
                    if self._on_state is not None:
                        self._on_state(rest[0])
                elif kind == "ready":
                    self.warmup_s, self.state = rest[0], State.READY
                    if self._on_ready is not None:
                        self._on_ready(rest[0])
                elif kind == "reject":
                    self._end(rest[0], ValueError(rest[1]))
                elif kind == "dead":
                    self.error = rest[0]
                    break
        except (EOFError, OSError):
            pass
        if self._stopping:
            self.state = State.STOPPED
        else:
            self.error = self.error or f"the engine process exited ({self._proc.exitcode})"
            self.state = State.DEAD
            if self._on_dead is not None:
                self._on_dead(self.error)
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
            self._reasons.clear()
        err = EngineDead(f"the engine loop stopped: {self.error or 'shut down'}")
        for s in sinks:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, err)

    def _end(self, fid: int, err: BaseException) -> None:
        with self._lock:
            sink = self._sinks.pop(fid, None)
            if sink is not None and not sink.started:
                self._waiting -= 1
        if sink is not None:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, err)

    def _dispatch(self, outputs: list[RequestOutput], made_at: float) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        if self._on_tokens is not None:
            self._on_tokens(sum(len(o.new_token_ids) for o in outputs))
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if not sink.started:
                    sink.started = True
                    self._waiting -= 1
                batches.setdefault(sink.loop, []).append((sink.queue, out))
                if out.finished:
                    sink.remaining -= 1
                    reason = self._reasons.pop((out.request_id, out.index), None)
                    if sink.remaining == 0:
                        del self._sinks[out.request_id]
                        for i in range(sink.n):  # a reason noted after its completion ended
                            self._reasons.pop((out.request_id, i), None)
                    if reason is not None and out.finish_reason == "abort" and out.stats:
                        out.stats["finish_reason"] = reason
                    if self._on_finished is not None:
                        self._on_finished(out)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch, made_at)


def _deliver(batch: list[tuple[asyncio.Queue, RequestOutput]], made_at: float) -> None:
    """Each output onto its request's queue, as (output, when its step ended: the
    `time.perf_counter()` clock, which is the same monotonic clock in both processes)."""
    for queue, out in batch:
        queue.put_nowait((out, made_at))
