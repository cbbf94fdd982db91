"""The engine loop: one thread owns the `Engine` (and so the page pool) and steps it while it has
work; the HTTP front end (an asyncio event loop in another thread) submits and aborts through the
engine's thread-safe `add_request` / `abort`, and gets each request's outputs on an asyncio queue.

A request's queue is registered under the same lock as its submission, and the loop dispatches a
step's outputs under that lock, so no output can arrive before its queue exists. A step's outputs go
to the event loop in one `call_soon_threadsafe`. When every completion of a request has finished, its
queue is dropped: the loop keeps nothing of a finished request."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence

from fms_paged.engine import Engine, RequestOutput, SamplingParams

log = logging.getLogger("fms_paged.serve")
METRICS_INTERVAL_S = 0.05  # how often a busy loop refreshes the engine gauges


class State(enum.Enum):
    WARMING_UP = "warming up"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineDead(RuntimeError):
    """The engine loop stopped (an error in a step, or shutdown): in-flight requests end with it."""


class _Sink:
    __slots__ = ("loop", "queue", "remaining")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, remaining: int):
        self.loop, self.queue, self.remaining = loop, queue, remaining


class EngineLoop:
    """engine: an idle Engine. warmup: compile its shapes first (`Engine.warmup`, with its progress
    bar) before it reports READY. Callbacks, all in the loop thread: on_finished(out) for each
    finished completion, on_tokens(n) with the tokens a step generated, on_state(metrics_dict) with
    `Engine.metrics()` at most every `METRICS_INTERVAL_S` while busy and once when it goes idle,
    on_ready(warmup seconds) once."""

    def __init__(self, engine: Engine, warmup: bool = True,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_state: Callable[[dict], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None,
                 on_ready: Callable[[float], None] | None = None):
        self.engine = engine
        self.state = State.WARMING_UP
        self.error: BaseException | None = None
        self.warmup_s: float | None = None
        self._warmup = warmup
        self._on_finished, self._on_state = on_finished, on_state
        self._on_tokens, self._on_ready = on_tokens, on_ready
        self._lock = threading.Lock()
        self._sinks: dict[int, _Sink] = {}
        # (request id, index) -> the finish reason to count for a completion the server ended itself
        # (a stop string: "stop"), dropped with its final output
        self._reasons: dict[tuple[int, int], str] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fms-paged-engine", daemon=True)

    # ------------------------------------------------------------------ front end (event loop)
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, arrival: float | None,
               queue: asyncio.Queue) -> int:
        """-> the request id; its `RequestOutput`s arrive on `queue` (an asyncio queue of the
        calling event loop; several requests may share one), or an `EngineDead` if the loop dies.
        ValueError / TypeError from `Engine.add_request` pass through (nothing queued)."""
        if self.state is not State.READY:
            raise EngineDead(f"the engine is {self.state.value}")
        sink = _Sink(asyncio.get_running_loop(), queue, params.n)
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, arrival_time=arrival)
            self._sinks[rid] = sink
        self._wake.set()
        return rid

    def abort(self, request_id: int, index: int | None = None, reason: str = "abort") -> None:
        """Abort a request (or only its completion `index`) if it is still running (its pages free
        at the next step); else nothing. `reason`: what the metrics count it as (a completion ended
        by a stop string is "stop", not "abort"; needs `index`)."""
        with self._lock:
            if request_id in self._sinks:
                try:
                    self.engine.abort(request_id, index)
                except ValueError:  # finished in the step that is dispatching now
                    return
                if reason != "abort" and index is not None:
                    self._reasons[(request_id, index)] = reason
        self._wake.set()

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    def live_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what is running, stop the thread, wait for it."""
        with self._lock:
            for rid in list(self._sinks):
                try:
                    self.engine.abort(rid)
                except ValueError:
                    pass
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            if self._warmup:
                self.warmup_s = self.engine.warmup(progress=True)
            self.state = State.READY
            if self._on_ready is not None:
                self._on_ready(self.warmup_s or 0.0)
            self._publish_state()
            last = time.perf_counter()
            while True:
                if not self.engine.has_unfinished():
                    if self._stop.is_set():
                        break
                    self._publish_state()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._dispatch(outputs)
                if time.perf_counter() - last > METRICS_INTERVAL_S:
                    self._publish_state()
                    last = time.perf_counter()
            self.state = State.STOPPED
        except BaseException as e:  # a step failed: every waiting client gets an error, /health 503
            log.exception("fms-paged serve: the engine loop died")
            self.error, self.state = e, State.DEAD
        finally:
            with self._lock:
                sinks, self._sinks = list(self._sinks.values()), {}
            err = EngineDead(f"the engine loop {'died: ' + repr(self.error) if self.error else 'stopped'}")
            for s in sinks:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, err)

    def _publish_state(self) -> None:
        if self._on_state is not None:
            self._on_state(self.engine.metrics())

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        if self._on_tokens is not None:
            self._on_tokens(sum(len(o.new_token_ids) for o in outputs))
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:  # the warm-up's own requests, or a request nobody awaits
                    continue
                batches.setdefault(sink.loop, []).append((sink.queue, out))
                if out.finished:
                    sink.remaining -= 1
                    if sink.remaining == 0:
                        del self._sinks[out.request_id]
                    reason = self._reasons.pop((out.request_id, out.index), None)
                    if self._on_finished is not None:
                        counted = out
                        if reason is not None and out.finish_reason == "abort" and out.stats:
                            counted = dataclasses.replace(out, stats={**out.stats, "finish_reason": reason})
                        self._on_finished(counted)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)
