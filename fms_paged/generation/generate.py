"""Batch generation: prefill once, then one token per step from the KV cache.

Works with either backend (`attn_impl="sdpa"` dense or `"paged"`); greedy decoding returns the same
tokens for both. Finished sequences stay in their batch row (static shapes), but the paged backend
erases their pages at once so the memory is reusable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fms_paged.generation.sampling import check_sampling_args, sample
from fms_paged.kv.cache import KVCacheBackend, make_cache

_MODEL_EOS: Any = object()


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


def decode_fn(cache: KVCacheBackend, compile: bool) -> Callable:
    """The decode-step function for `cache`: eager, or the shared compiled one for its shapes."""
    if not compile:
        return decode_one_token
    return compiled_decode(getattr(cache, "kernel", None) == "flex")


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int,
                     max_new_tokens: int = 0) -> list[list[int]]:
    """Return prompts as lists of Python ints, or raise a typed error naming the offending value."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"prompt {i} token {j} is {t!r} ({type(t).__name__}); expected int")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i} token {j} = {t} is outside the vocabulary [0, {vocab_size})")
            ids.append(int(t))
        if len(ids) + max_new_tokens > max_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's maximum sequence length {max_len}"
            )
        out.append(ids)
    return out


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = _MODEL_EOS,
    on_token: Callable[[int, int], None] | None = None,
    cache: KVCacheBackend | None = None,
    compile: bool = False,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` new tokens for each prompt; returns only the new tokens.

    Greedy by default; `temperature > 0` samples (optionally top-k / top-p) from a generator seeded
    with `seed`. A sequence stops after emitting an EOS token (`eos_id`; default: the model config's
    `eos_token_id`; `None` disables). `on_token(prompt_index, token)` streams tokens as they come.
    `cache` reuses a backend made by `fms_paged.kv.make_cache` (else one is made for this call).
    `compile=True` runs each decode step as one compiled graph (`compiled_decode`); the first call
    compiles it (tens of seconds on a CPU), later calls with the same shapes reuse it.
    """
    config = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    check_sampling_args(temperature, top_k, top_p)
    prompts = validate_prompts(prompts, config.src_vocab_size, config.max_expected_seq_len,
                               max_new_tokens)
    if eos_id is _MODEL_EOS:
        eos_id = config.eos_token_id
    eos = set() if eos_id is None else ({eos_id} if isinstance(eos_id, int) else set(eos_id))

    n = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    if cache is None:
        cache = make_cache(model, max_batch=n, max_seq_len=max_len)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=model.device)
        generator.manual_seed(seed if seed is not None else torch.initial_seed())

    seq_ids = list(range(n))
    decode = decode_fn(cache, compile)
    cache.reset()
    tokens, positions, step, last = cache.prefill(seq_ids, prompts)
    logits = model(tokens, positions, step)  # [B', S', V]
    next_tok = sample(logits.flatten(0, 1)[last].float(), temperature, top_k, top_p, generator)

    out: list[list[int]] = [[] for _ in range(n)]
    lengths = [len(p) for p in prompts]  # tokens in the cache per sequence
    active = [True] * n
    for _ in range(max_new_tokens):
        host_tok = next_tok.tolist()  # the one host sync per step: EOS checks and streaming
        for i in range(n):
            if not active[i]:
                continue
            out[i].append(host_tok[i])
            if on_token is not None:
                on_token(i, host_tok[i])
            if host_tok[i] in eos or len(out[i]) == max_new_tokens:
                active[i] = False
                cache.release([i])
        if not any(active):
            break
        tokens, positions, step = cache.decode(seq_ids, next_tok, lengths, active)
        for i in range(n):
            lengths[i] += active[i]
        logits = decode(model, tokens, positions, step)  # [B, V]
        next_tok = sample(logits.float(), temperature, top_k, top_p, generator)
    cache.release([i for i in range(n) if active[i]])
    return out
