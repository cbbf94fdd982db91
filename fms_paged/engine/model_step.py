"""The model's steps: a decode step eager or compiled whole (gpt-fast's `decode_one_token`), and a
prefill step compiled piecewise around its attention (vLLM's way on the CPU)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from fms_paged import native
from fms_paged.kv.kernels import Kernel, compile_shape_variants


def decode_one_token(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                     step: object) -> torch.Tensor:
    """One decode step: tokens, positions [B, 1] -> logits of the new position [B, V]."""
    return model(tokens, positions, step)[:, -1]


@functools.cache
def compiled_decode(static_shapes: bool, cpp_wrapper: bool = False) -> Callable:
    """`decode_one_token` under torch.compile (fullgraph): the whole decode step, from the step's
    metadata (`prepare`) through every layer to the logits, is one compiled graph, so per-op
    Python overhead goes away. `static_shapes=True` for the paged cpp and flex backends (their
    decode shapes never change); the dense backend's attention span grows every step, so it is
    compiled with automatic dynamic shapes (one recompilation on the second step, then none).
    `cpp_wrapper=True` (the CPU): inductor's code that calls the graph's kernels and ops in turn is
    C++ instead of Python; a decode step's ~10 calls per layer made it the step's main host cost.
    That wrapper is one long function (every layer's calls in turn) that gcc is slow to optimize, so
    it is built apart from the kernels, at inductor's wrapper level (-O1): the warm-up is shorter
    and the step no slower (docs/benchmarks.md)."""
    options = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True} if cpp_wrapper else None
    return compile_shape_variants(decode_one_token, fullgraph=True,
                                  dynamic=False if static_shapes else None, options=options)


def decode_fn(cache: object, compile: bool, collectives: bool = False) -> Callable:
    """The decode-step function for a KV cache (a paged one, which has a `Kernel`, or the dense
    one): eager, or the shared compiled one for its shapes. `collectives`: the model is split over
    ranks (`fms_paged.parallel`); inductor's C++ wrapper cannot call torch's functional
    collectives (torch 2.13), so its graph keeps the Python one.

    A compiled step waits first for the builds this process started in the background
    (`native.wait_for_builds`: a first start's) and loads the kernel its steps call
    (`Kernel.load`): a graph traced before they are loaded would trace torch's fallbacks, or
    operators not registered yet, for good."""
    if not compile:
        return decode_one_token
    kernel: Kernel | None = getattr(cache, "kernel", None)
    native.wait_for_builds()
    if kernel is not None:
        kernel.load(getattr(cache, "backend", cache).view)
    if kernel is not None and kernel.dynamic_shapes:
        getattr(cache, "backend", cache).mark_dynamic()  # (a PagedCache's backend, or the backend)
    cpu = getattr(getattr(cache, "device", None), "type", None) == "cpu"
    fn = compiled_decode(kernel is not None and kernel.static_decode, cpu and not collectives)
    return functools.partial(_rows_dynamic, fn) if kernel is not None and kernel.dynamic_shapes else fn


def smallest_batch(fn: Callable) -> int:
    """The fewest rows a decode batch of `fn` (from `decode_fn`) should have: 2 for the steps whose
    batch is dynamic past one row (`_rows_dynamic`), where a 1-row batch would compile a graph of
    its own; 1 otherwise."""
    return 2 if isinstance(fn, functools.partial) and fn.func is _rows_dynamic else 1


def _rows_dynamic(fn: Callable, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                  step: object) -> torch.Tensor:
    """`fn` (the compiled decode step of a kernel of dynamic shapes: cpp) with the batch dimension
    dynamic: one graph for every decode bucket past 1, rather than one per bucket (the projections
    pick their CPU path by the rows when they run: `fms_paged::linear`). A batch of 1 would be a
    graph of its own (Dynamo specializes sizes 0 and 1), so the engine pads a lone request to 2 rows
    (`smallest_batch`).
    Together with the backend's dynamic pool and page size (`PagedBackend`), a model shape has one
    engine decode graph, whatever its engines' pools."""
    for s in getattr(step, "steps", (step,)):  # (pages held per layer group: a step per group)
        torch._dynamo.maybe_mark_dynamic(s.slots, 0)
        torch._dynamo.maybe_mark_dynamic(s.chunks, 0)
    for t in (tokens, positions):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return fn(model, tokens, positions, step)


# ---------------------------------------------------------------------------- CUDA graphs
CUDA_GRAPH_MODES = ("auto", True, False)


def cuda_graphs_unavailable_reason(backend: object, compiled: bool) -> str | None:
    """Why a backend's decode step cannot be replayed from CUDA graphs (None if it can): graphs
    need the compiled flex step on CUDA, whose inputs (tokens, the [6, B] decode metadata) have
    fixed shapes per decode bucket and whose state (pools, page table) is updated in place."""
    if backend.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if not backend.kernel.cuda_graphs:
        return f"CUDA graphs need the flex kernel, not {backend.kernel.name!r}"
    if not compiled:
        return "CUDA graphs need the compiled decode step (compile=False was asked for)"
    groups = getattr(backend, "groups", None)
    if groups is not None and groups.grouped:
        return ("CUDA graphs replay one decode step's metadata: a model whose pages are held per layer "
                f"group ({groups.describe()}) builds a step per group")
    return None


def capture_cuda_graph(run: Callable[[], torch.Tensor],
                       pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `run` (a decode step over static input tensors) as a CUDA graph -> (replay, the
    graph's output tensor). `run` is called twice first on a side stream (compiles, cuBLAS
    workspaces, the allocator's blocks), as torch's docs ask; each call writes the step's K/V into
    the same slots, so the extra calls change nothing. The graphs of an engine share one memory
    pool; the engine's warm-up meets its buckets largest first (its waves shrink the batch), so the
    smaller graphs reuse the larger ones' memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph.replay, out


class GraphedDecode:
    """The compiled flex decode step replayed from one CUDA graph per decode bucket (vLLM's CUDA
    graph runner, gpt-fast's "reduce-overhead"): a step's ~10 kernel launches per layer become one
    graph launch. Each bucket's graph reads static buffers (tokens [B, 1], decode metadata [6, B])
    that each call copies its inputs into; the pools, page table and page->logical map it reads
    are the backend's own tensors, written in place by ASSIGN and the page manager. A bucket is
    captured on its first call. The returned logits are the graph's output buffer: valid until the
    next call of that bucket.

    `capture(run, pool) -> (replay, out)`: `capture_cuda_graph` (tests substitute a plain call)."""

    def __init__(self, fn: Callable,
                 capture: Callable[[Callable[[], torch.Tensor], object], tuple] = capture_cuda_graph):
        self.fn, self.capture = fn, capture
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor, Callable[[], None], torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture is capture_cuda_graph else None

    def __call__(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                 step: object) -> torch.Tensor:
        # tokens, positions: [B, 1]; step: a FlexDecodeStep (its positions are decode_meta[5])
        B = tokens.shape[0]
        if B not in self.graphs:
            self.graphs[B] = self._record(model, tokens, step)
        static_tokens, static_meta, replay, out = self.graphs[B]
        static_tokens.copy_(tokens)
        static_meta.copy_(step.decode_meta)
        replay()
        return out

    def _record(self, model: torch.nn.Module, tokens: torch.Tensor, step: object) -> tuple:
        static_tokens, static_meta = tokens.clone(), step.decode_meta.clone()  # [B, 1], [6, B]
        static_step = type(step)(step.view, step.kernel, static_meta)  # same pools, static buffer
        B = static_tokens.shape[0]

        def run() -> torch.Tensor:
            return self.fn(model, static_tokens, static_meta[5].view(B, 1), static_step)

        replay, out = self.capture(run, self.pool)
        return static_tokens, static_meta, replay, out


# ---------------------------------------------------------------------------- compiled prefill
# A prefill (or mixed) step's attention depends on its chunks: their number, lengths and masks
# change every step. In the compiled prefill it is one opaque op per layer, which runs the step
# in effect (eager: SDPA per chunk, the decode rows' flex kernel); everything around it (RoPE,
# norms, SwiGLU, residuals, the projections) is one graph with the token count dynamic, so the
# pointwise work fuses and the Python cost of the layers goes away.
_LIB = torch.library.Library("fms_paged", "FRAGMENT")
_LIB.define("step_attend(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor")
_ACTIVE: list = []  # the step the op attends through, set by `prefill_hidden`


def _step_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    # q: [B, H, S, D]; k, v: [B, Hkv, S, D]; layer: the layer's index (a 0-d tensor, an input of
    # the block's subgraph) -> [B, S, H, D] contiguous (the layout the output projection reads;
    # the fake below promises it)
    return _ACTIVE[-1].attend(int(layer), q, k, v).transpose(1, 2).contiguous()


_LIB.impl("step_attend", _step_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("fms_paged::step_attend")
def _step_attend_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)


class DeferredStep:
    """The `AttentionStep` a block of the compiled prefill is traced with: its attention is the op
    `fms_paged::step_attend` on the layer index `layer` (a tensor), run by the step
    `prefill_hidden` puts in effect."""

    def __init__(self, layer: torch.Tensor):
        self.layer = layer

    def prepare(self) -> DeferredStep:
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.fms_paged.step_attend(q, k, v, self.layer).transpose(1, 2)


@torch.compiler.nested_compile_region
def _block(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           layer: torch.Tensor) -> torch.Tensor:
    return block(x, cos, sin, DeferredStep(layer))


def prefill_layers(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The layers of a prefill step around deferred attention -> hidden states [B, S, D]. Compiled,
    each block is a nested compile region: the blocks of a model are alike but for their weights,
    their layer index and the RoPE table they read (inputs of the region; a layer's attention
    spec is applied inside the opaque attention op), so inductor compiles one block and calls it
    for every layer: the graph compiles in about half the time of one traced layer by layer."""
    x, ropes = model.embed(tokens, positions)
    index = torch.arange(len(model.layers))
    for i, block in enumerate(model.layers):
        x = _block(block, x, *ropes[block.rope_index], index[i])
    return x


@functools.cache
def compiled_prefill() -> Callable:
    """`prefill_layers` under torch.compile with dynamic shapes (the token count): one graph for
    every step length of 2 or more tokens (the projections pick their CPU path when they run).
    Its weights stay graph inputs, so the graph is shared by models of one shape and lands in
    inductor's on-disk cache."""
    fn = compile_shape_variants(prefill_layers, fullgraph=True, dynamic=True)

    def run(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # floats as constants: with dynamic shapes Dynamo would make each RMSNorm's eps a symbolic
        # input of the block's region, which invoke_subgraph does not take
        with torch._dynamo.config.patch(specialize_float=True):
            return fn(model, tokens, positions)

    return run


@contextlib.contextmanager
def _in_effect(step: object) -> Iterator[None]:
    _ACTIVE.append(step)
    try:
        yield
    finally:
        _ACTIVE.pop()


def prefill_hidden(fn: Callable, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                   step: object) -> torch.Tensor:
    """`fn` (`compiled_prefill()` or `prefill_layers`) on a prefill step -> hidden states."""
    with _in_effect(step.prepare()):
        return fn(model, tokens, positions)
