"""One decode step of the model, eager or compiled whole (gpt-fast's `decode_one_token`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


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


def decode_fn(cache: object, compile: bool) -> Callable:
    """The decode-step function for a KV-cache backend: eager, or the shared compiled one for its
    shapes."""
    if not compile:
        return decode_one_token
    return compiled_decode(getattr(cache, "kernel", None) == "flex")
