"""The model's steps: a decode step eager or compiled whole (gpt-fast's `decode_one_token`), and a
prefill step compiled piecewise around its attention (vLLM's way on the CPU)."""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable, Iterator

import torch
import torch._inductor.config

from fms_paged.kv.paged import allow_shape_variants

# inductor options of the "tuned" decode step (CPU): weights frozen into the graph as constants and
# each GEMM autotuned between ATen (MKL) and inductor's C++ GEMM template, which prepacks the frozen
# weight into its own blocked layout. Measured on a 2-vCPU AMD EPYC with a SmolLM2-135M-shaped model:
# the projections. GEMVs at ~21 GB/s against ~10 GB/s through MKL, decode 1.5-2.5x faster.
TUNED_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


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
    That wrapper is one long function (every layer's calls in turn) and gcc spent ~67 s on it at -O3
    for a 30-layer model, so it is built apart from the kernels, at inductor's wrapper level (-O1):
    measured on a 2-vCPU AMD EPYC, SmolLM2-135M-shaped engine, a cold warm-up ~300 -> 228 s, and
    the decode step no slower (1 request 19.9 / 21.5 ms against 22.3 / 23.3 ms, alternate runs)."""
    allow_shape_variants()
    options = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True} if cpp_wrapper else None
    return torch.compile(decode_one_token, fullgraph=True, dynamic=False if static_shapes else None,
                         options=options)


# model -> (its weights' identity and versions when compiled, its tuned step); weak keys, so a
# model's compiled step goes with it
_TUNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model: torch.nn.Module) -> tuple:
    # storage and in-place version counter of every weight: any change to the weights changes it
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def compiled_decode_tuned(model: torch.nn.Module) -> Callable:
    """The decode step compiled with `TUNED_OPTIONS` for `model` alone (static shapes).

    Freezing bakes the weights into the graph, so the step is bound to this model object (another
    model raises ValueError). It runs on a code object of its own, so Dynamo never hands its graphs
    to another model's step. The step is kept per model and handed to every later engine of the
    same model (its graphs are not compiled twice in a process) until the weights change (another
    tensor or an in-place write: a new step is compiled). Inductor reads `freezing` from its global
    config (not from `torch.compile(options=...)`), so the options are patched in around each
    call. It cannot store graphs holding MKL-packed weights in its on-disk graph cache ("mkldnn
    tensors unpickleable"): each process compiles these graphs again, while the GEMM autotuning
    choices are cached on disk and not measured again."""
    key = _weights_key(model)
    known = _TUNED.get(model)
    if known is not None and known[0] == key:
        return known[1]
    allow_shape_variants()
    code = decode_one_token.__code__.replace(co_name=f"decode_one_token_tuned_{id(model):x}")
    fn = torch.compile(types.FunctionType(code, decode_one_token.__globals__), fullgraph=True,
                       dynamic=False)
    owner = weakref.ref(model)

    def step(m: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, s: object) -> torch.Tensor:
        if m is not owner():
            raise ValueError("this tuned decode step was compiled for another model (weights frozen in)")
        with torch._inductor.config.patch(TUNED_OPTIONS):
            return fn(m, tokens, positions, s)

    _TUNED[model] = (key, step)
    return step


def decode_fn(cache: object, compile: bool | str, model: torch.nn.Module | None = None) -> Callable:
    """The decode-step function for a KV-cache backend: eager, the shared compiled one for its
    shapes, or (`compile="tuned"`, paged cpp or flex backend, `model` given) the tuned one."""
    if not compile:
        return decode_one_token
    kernel = getattr(cache, "kernel", None)
    if compile == "tuned":
        if model is None or kernel not in ("cpp", "flex"):
            raise ValueError(
                f"compile='tuned' needs the cpp or flex kernel and its model; this backend runs {kernel!r}")
        return compiled_decode_tuned(model)
    cpu = getattr(getattr(cache, "device", None), "type", None) == "cpu"
    fn = compiled_decode(kernel in ("cpp", "flex"), cpu)
    return functools.partial(_rows_dynamic, fn) if kernel == "cpp" else fn


def smallest_batch(fn: Callable) -> int:
    """The fewest rows a decode batch of `fn` (from `decode_fn`) should have: 2 for the steps whose
    batch is dynamic past one row (`_rows_dynamic`), where a 1-row batch would compile a graph of
    its own; 1 otherwise."""
    return 2 if isinstance(fn, functools.partial) and fn.func is _rows_dynamic else 1


def _rows_dynamic(fn: Callable, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                  step: object) -> torch.Tensor:
    """`fn` (the compiled decode step of the cpp kernel) with the batch dimension dynamic: one graph
    for every decode bucket past 1, rather than one per bucket (the projections pick their CPU path
    by the rows when they run: `fms_paged::linear`). A batch of 1 would be a graph of its own (Dynamo
    specializes sizes 0 and 1), so the engine pads a lone request to 2 rows (`smallest_batch`).
    Together with the backend's dynamic pool and page size (`PagedBackend`), a model shape has one
    engine decode graph, whatever its engines' pools; with empty compile caches it costs 10-60 s
    here (a 2-vCPU AMD EPYC, 4 to 30 layers; for 30 layers ~23 s of it is gcc on the C++ wrapper)."""
    for t in (tokens, positions, step.slots, step.chunks):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return fn(model, tokens, positions, step)


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
    each block is a nested compile region: the blocks of a model are alike but for their weights
    and their layer index (both inputs of the region), so inductor compiles one block and calls it
    for every layer (a 30-layer SmolLM2-shaped graph compiled in 21 s against 44; 2-vCPU AMD EPYC)."""
    x, cos, sin = model.embed(tokens, positions)
    index = torch.arange(len(model.layers))
    for i, block in enumerate(model.layers):
        x = _block(block, x, cos, sin, index[i])
    return x


@functools.cache
def compiled_prefill() -> Callable:
    """`prefill_layers` under torch.compile with dynamic shapes (the token count): one graph for
    every step length of 2 or more tokens (the projections pick their CPU path when they run).
    Its weights stay graph inputs, so the graph is shared by models of one shape and lands in
    inductor's on-disk cache."""
    allow_shape_variants()
    fn = torch.compile(prefill_layers, fullgraph=True, dynamic=True)

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
