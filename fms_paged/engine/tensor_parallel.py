"""The engine over tensor-parallel ranks: rank 0 is the `Engine` its user drives; every other rank
runs a replica of its scheduler over its own part of the model and of the KV pool, in lockstep.

Every rank runs the same deterministic scheduler (as SGLang's ranks do) rather than rank 0 sending
its plan: the plan names requests, pages and copy-on-write copies that would have to be serialized
each step, and each rank would need a second code path to turn them into model inputs. Replicated,
the only things that cross are what the scheduler cannot know by itself, once per engine step, in
one broadcast from rank 0 (`StepMessage`): the requests submitted and aborted since the last
step, and the tokens rank 0 sampled in the last step (sampling happens once, on rank 0: its
seeded and unseeded generators, grammars and log-probabilities stay there). A worker then books
those tokens (`Scheduler.update`), takes the same submissions and aborts, schedules the same plan
and runs the same forward, whose collectives (an all-reduce per projection pair, the logits'
gather) pair up with rank 0's. Each message also carries how many tokens the last step sampled,
and a worker whose own plan disagrees stops with an error instead of computing the wrong thing.

Launch: `Engine(model, tensor_parallel_size=N)` spawns ranks 1..N-1 on this host (the spawn start
method; they get the model through shared memory and each keeps its part), or, when
torch.distributed is already initialized with N ranks (`torchrun`, several hosts), uses them:
rank 0 builds the `Engine`, the others call `run_worker`. Messages go over a gloo group of their
own, which the workers wait on without a limit (an idle server waits for its next request
indefinitely) and rank 0 sends on within `FMS_PAGED_TP_TIMEOUT_S` (default 60 s); the model's
collectives go over the default group with that timeout too, so a rank that dies or hangs makes
rank 0's step raise within it. A spawned worker dies with its parent (Linux PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fms_paged.engine.scheduler import StepResult
from fms_paged.kv.kernels import choose_kernel
from fms_paged.kv.paged import attention_specs
from fms_paged.kv.quant import storage_dtype
from fms_paged.models.llama import LLaMA
from fms_paged.parallel import TensorParallelError, layout, shard

log = logging.getLogger("fms_paged.engine")
TIMEOUT_ENV = "FMS_PAGED_TP_TIMEOUT_S"
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the message group: rank 0 may be idle for long


@dataclass
class StepMessage:
    """What rank 0 tells the other ranks before each engine step."""

    sampled: int = 0  # tokens the last step sampled (the workers' check)
    tokens: list[int] | None = None  # ... and those tokens (None: the last step ran nothing)
    adds: list[tuple] = field(default_factory=list)  # (id, prompt, params, cache_salt) each
    aborts: list[tuple[int, int | None]] = field(default_factory=list)
    reset: bool = False  # forget the prefix cache and the totals (after a warm-up)
    stop: bool = False
    result: Any = None  # with `stop`: what `run_worker` returns (e.g. `generate`'s tokens)


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, "60")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}; expected seconds (a number > 0)") from None
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}; expected seconds (a number > 0)")
    return datetime.timedelta(seconds=seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(model: torch.nn.Module, rank: int) -> torch.device:
    """The device rank `rank` runs on: the CPU for a CPU model, else GPU `rank` of its kind."""
    dev = next(model.parameters()).device
    return dev if dev.type == "cpu" else torch.device(dev.type, rank)


def share_cores(model: torch.nn.Module, size: int) -> int | None:
    """CPU ranks on one host: each takes its share of the cores for its threads (else `size`
    processes each run a thread per core, and every kernel's threads wait for each other).
    -> this process's torch thread count before, to restore when the ranks stop (None: a GPU
    model, nothing changed)."""
    if next(model.parameters()).device.type != "cpu":
        return None
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // size))
    return before


class Ranks:
    """Rank 0's side: the workers it spawned (if any), the message group, the step messages."""

    def __init__(self, size: int, rank: int, control: Any, procs: list | None = None):
        self.size, self.rank, self.control = size, rank, control  # control: `control_group`
        self.procs = procs or []
        self.pending: StepMessage = StepMessage()  # filled during a step, sent before the next
        self.stopped = False
        self.dead: str | None = None  # why a spawned worker is gone
        self.on_dead = None  # called with that reason, in the watching thread (a server: exit)
        self.threads: int | None = None  # this process's torch threads before `share_cores`
        # (rank 0 in the caller's process: restored by `stop`)
        self._watch: threading.Thread | None = None

    # ------------------------------------------------------------------ start
    @classmethod
    def spawn(cls, model: torch.nn.Module, size: int, make_engine: Callable[..., Any],
              engine_kwargs: dict[str, Any]) -> Ranks:
        """Start ranks 1..size-1 on this host, each building its part and its engine
        (`make_engine(part, **engine_kwargs)`: the `Engine` class, picklable) from `model`; join
        them as rank 0. This process's torch threads are its share of the cores until `stop`."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: start "
                               "the ranks with torchrun and split the model there (Engine then uses "
                               "them), or build the Engine in a fresh process")
        addr, port = "127.0.0.1", _free_port()
        threads = share_cores(model, size)
        ctx = mp.get_context("spawn")
        procs = []
        try:
            for r in range(1, size):
                p = ctx.Process(target=_worker_main, name=f"fms-paged-tp-rank{r}", daemon=False,
                                args=(r, size, addr, port, model, make_engine, engine_kwargs, os.getpid()))
                p.start()
                procs.append(p)
                log.info("fms_paged: tensor-parallel rank %d of %d started (pid %d)", r, size, p.pid)
            init(0, size, addr, port, rank_device(model, 0))
        except BaseException:
            for p in procs:
                p.kill()
            if threads is not None:
                torch.set_num_threads(threads)
            raise
        ranks = cls(size, 0, None, procs)
        ranks.threads = threads
        ranks._watch = threading.Thread(target=ranks._watch_workers, name="fms-paged-tp-watch", daemon=True)
        ranks._watch.start()
        return ranks

    @classmethod
    def joined(cls, size: int) -> Ranks:
        """Rank 0 under an already initialized torch.distributed (torchrun)."""
        if not dist.is_initialized() or dist.get_world_size() != size or dist.get_rank() != 0:
            raise RuntimeError(f"tensor_parallel_size={size}: this process is not rank 0 of {size} "
                               "initialized ranks")
        return cls(size, 0, None)

    def _watch_workers(self) -> None:
        """Log a spawned worker that exits before it is told to: rank 0's next collective with it
        then fails (gloo: at once, the connection closed; at worst after the collective timeout),
        and the step raises."""
        sentinels = {p.sentinel: p for p in self.procs}
        while sentinels and not self.stopped:
            for s in wait(list(sentinels), timeout=1.0):
                p = sentinels.pop(s)
                if not self.stopped:
                    rank = p.name.removeprefix("fms-paged-tp-rank")
                    p.join(5)  # reaped: its exit code known
                    code = p.exitcode
                    killed = code is not None and code < 0
                    why = f" (killed by {signal.Signals(-code).name})" if killed else ""
                    self.dead = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}{why}"
                    log.error("fms_paged: %s", self.dead)
                    if self.on_dead is not None:
                        self.on_dead(self.dead)

    # ------------------------------------------------------------------ each step
    def send(self) -> None:
        """The step's message (what `note_*` gathered since the last one) to the other ranks."""
        msg, self.pending = self.pending, StepMessage()
        broadcast(msg, self.control)

    def note_add(self, request_id: int, prompt: list[int], params: Any, cache_salt: str | None) -> None:
        """A request rank 0's engine admitted: the others queue it with the next message."""
        self.pending.adds.append((request_id, prompt, params, cache_salt))

    def note_abort(self, request_id: int, index: int | None) -> None:
        """An abort rank 0's engine applied: the others apply it with the next message."""
        self.pending.aborts.append((request_id, index))

    def note_reset(self) -> None:
        """Rank 0 forgot its totals and prefix cache (after a warm-up): so do the others."""
        self.pending.reset = True

    def sampled(self, tokens: list[int]) -> None:
        """The tokens rank 0 sampled in the step just run: the others book them with the next
        message (and check that their own plan sampled as many)."""
        self.pending.sampled, self.pending.tokens = len(tokens), tokens

    def stop(self, result: Any = None, timeout: float = 30.0) -> None:
        """Tell the workers to stop (their `run_worker` returns `result`) and wait for those
        spawned here (those that do not stop: killed)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.pending.stop, self.pending.result = True, result
            self.send()
        except Exception as e:  # a dead or hung peer: no worker waits for a message any more
            log.warning("fms_paged: could not tell the tensor-parallel ranks to stop (%s); killing them", e)
            timeout = 0.0
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.threads is not None:
            torch.set_num_threads(self.threads)


def broadcast(msg: StepMessage | None, group: Any) -> StepMessage:
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def control_group(ranks: Ranks | None = None) -> Any:
    """The group of the step messages (every rank creates it, at the same point: it is a
    collective): gloo; rank 0's `Ranks` send on it. A group's timeout is each process's own:
    rank 0's is the collective timeout (a send to a hung rank gives up), the workers' one an idle
    server does not reach (they wait for the next step as long as rank 0 has none)."""
    timeout = collective_timeout() if ranks is not None else IDLE_TIMEOUT
    group = dist.new_group(backend="gloo", timeout=timeout)
    if ranks is not None:
        ranks.control = group
    return group


def init(rank: int, size: int, addr: str, port: int, device: torch.device) -> None:
    """Join the `size` ranks at addr:port: gloo on the CPU, NCCL on CUDA (each rank its GPU)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=collective_timeout())


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several ranks torchrun started (RANK and
    WORLD_SIZE in its environment, as torchrun sets them), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def join_torchrun(device: torch.device) -> tuple[int, int]:
    """Join torchrun's ranks (its environment gives the rendezvous) -> (rank, world size): gloo on
    the CPU, NCCL on CUDA with this process's GPU the node-local rank's."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                            timeout=collective_timeout())
    return dist.get_rank(), dist.get_world_size()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (a worker never outlives rank 0;
    SIGKILL, since a worker leaves SIGTERM to rank 0: see `_worker_main`)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _leave_to_rank0(signum: int, frame) -> None:
    """SIGTERM in a spawned rank: nothing; rank 0 stops the ranks (`_worker_main`)."""


def _worker_main(rank: int, size: int, addr: str, port: int, model: torch.nn.Module,
                 make_engine: Callable[..., Any], engine_kwargs: dict[str, Any], parent: int) -> None:
    """A spawned rank's process (its own: the thread count it sets is its own to set). A Ctrl-C or
    a supervisor's SIGTERM sent to the process group reaches this process too; rank 0 decides when
    the ranks stop (a server drains first, then rank 0 tells its workers to stop), so SIGINT is
    ignored and SIGTERM caught by a no-op here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave_to_rank0)
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(1)
    device = rank_device(model, rank)
    share_cores(model, size)
    init(rank, size, addr, port, device)
    model = shard(model, rank, size, dist.group.WORLD).to(device)
    engine = make_engine(model, **engine_kwargs)
    run_worker(engine)
    engine.shutdown()
    dist.destroy_process_group()


def split_for_engine(model: torch.nn.Module, size: int, backend, make_engine: Callable[..., Any],
                     settings: dict):
    """-> (the model, rank 0's `Ranks` or None, the step-message group or None): `model`
    unchanged without tensor parallelism; else this rank's part (split here on rank 0, the
    other ranks spawned, each building its engine with `make_engine(part, **settings)`, or
    joined)."""
    tp = getattr(model, "tp", None)
    if tp is None and size == 1:
        return model, None, None
    if backend is not None:
        raise TensorParallelError("tensor parallelism builds each rank's own pool: pass no backend")
    if tp is not None:  # a split model: its rank (torchrun, or a worker spawned here)
        if size not in (1, tp.size):
            raise TensorParallelError(f"tensor_parallel_size={size}, but the model is split over "
                                      f"{tp.size} ranks")
        ranks = Ranks.joined(tp.size) if tp.rank == 0 else None
        return model, ranks, control_group(ranks)
    if not isinstance(model, LLaMA):
        raise TensorParallelError(f"tensor parallelism splits fms_paged's own models; got "
                                  f"{type(model).__name__} (an IBM FMS model keeps FMS's own: "
                                  "distributed_strategy='tp')")
    c = model.config
    layout(c.nheads, c.kvheads, model.layers[0].ff_sub_module.wg.out_features, size)
    with warnings.catch_warnings():  # the kernel every rank will build (announced by each)
        warnings.simplefilter("ignore")
        kv = settings.get("kv_cache_dtype") or c.kv_cache_dtype
        choose_kernel(settings["kernel"], model.device, c.page_size, head_dim=c.head_dim,
                      dtype=model.dtype, sinks=any(s.sinks is not None for s in attention_specs(model)),
                      kv_dtype=storage_dtype(kv, model.dtype))
    dev = model.device
    if dev.type not in ("cpu", "cuda"):
        raise TensorParallelError(f"tensor parallelism runs on CPUs (gloo) and CUDA GPUs (NCCL), "
                                  f"not {dev.type}")
    if dev.type == "cuda" and size > torch.cuda.device_count():
        raise TensorParallelError(f"tensor_parallel_size={size} > the {torch.cuda.device_count()} "
                                  "CUDA devices here (rank r runs on GPU r)")
    if torch.distributed.is_initialized():
        ranks = Ranks.joined(size)
    else:
        ranks = Ranks.spawn(model, size, make_engine, settings)
    model = shard(model, 0, size, torch.distributed.group.WORLD).to(rank_device(model, 0))
    return model, ranks, control_group(ranks)


def run_worker(engine) -> Any:
    """A worker rank's loop: each message from rank 0, then the same step as rank 0's; until told
    to stop (-> the result rank 0 stopped it with: `Engine.shutdown(result)`). `engine`: this
    rank's `Engine` over its part of the model (`fms_paged.parallel.shard`), driven through its
    public surface: `book`, `forget_totals`, `enqueue`, `queue_abort`, `take_submissions`, its
    `scheduler` and `runner`."""
    if engine.tp_rank == 0:
        raise RuntimeError("run_worker is for the ranks other than 0: rank 0 drives its Engine")
    plan = None
    while True:
        msg = broadcast(None, engine.control)
        mine = 0 if plan is None else len(plan.sampled)
        if msg.sampled != mine:
            raise RuntimeError(f"tensor-parallel rank {engine.tp_rank} diverged from rank 0: its last "
                               f"step sampled {mine} tokens, rank 0's {msg.sampled}")
        if plan is not None:
            engine.book(plan, StepResult(msg.tokens))
            plan = None
        if msg.stop:
            return msg.result
        if msg.reset:
            engine.forget_totals()
        for rid, prompt, params, cache_salt in msg.adds:
            engine.enqueue(rid, prompt, params, cache_salt)
        for rid, index in msg.aborts:
            engine.queue_abort(rid, index)
        engine.take_submissions()
        step = engine.scheduler.schedule()
        if step.scheduled:
            engine.runner.run(step, sample=False)
            plan = step
