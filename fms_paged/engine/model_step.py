"""One decode step of the model, eager or compiled whole (gpt-fast's `decode_one_token`)."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable

import torch
import torch._inductor.config

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
def compiled_decode(static_shapes: bool) -> Callable:
    """`decode_one_token` under torch.compile (fullgraph): the whole decode step, from the step's
    metadata (`prepare`) through every layer to the logits, is one compiled graph, so per-op
    Python overhead goes away. `static_shapes=True` for the paged flex backend (its decode shapes
    never change); the dense backend's attention span grows every step, so it is compiled with
    automatic dynamic shapes (one recompilation on the second step, then none)."""
    return torch.compile(decode_one_token, fullgraph=True, dynamic=False if static_shapes else None)


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
    shapes, or (`compile="tuned"`, paged flex backend, `model` given) the tuned one."""
    if not compile:
        return decode_one_token
    if compile == "tuned":
        kernel = getattr(cache, "kernel", None)
        if model is None or kernel != "flex":
            raise ValueError(
                f"compile='tuned' needs the flex kernel and its model; this backend runs {kernel!r}")
        return compiled_decode_tuned(model)
    return compiled_decode(getattr(cache, "kernel", None) == "flex")
