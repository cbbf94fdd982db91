"""Perplexity over non-overlapping windows, through the KV-cache backend or with no cache at all.

Each window of `window` tokens is scored from its own start: its first token is context only, every
later token is predicted from the window's tokens before it. With `use_cache=True` the window is fed
through `make_cache(model, 1, window)` in chunks of `chunk` tokens (chunked prefill: later chunks read
the earlier chunks' K/V from the cache); with `use_cache=False` the whole window goes through
`model(tokens[None])` with plain causal attention (the independent reference). Both give the same
numbers up to float round-off, whatever `attn_impl` is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fms_paged.kv.cache import make_cache


def _windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a short tail is kept if it has at least one token to predict."""
    out = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in out if len(w) >= 2]


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    # logits: [n, V], targets: [n] -> summed NLL in float64
    return F.cross_entropy(logits.double(), targets, reduction="sum").item()


@torch.inference_mode()
def perplexity(
    model: torch.nn.Module,
    token_ids: list[int],
    window: int = 256,
    chunk: int | None = None,
    use_cache: bool = True,
    cache_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """-> {"ppl": exp(mean NLL), "nll": mean NLL per predicted token, "tokens": predicted tokens,
    "windows": number of windows}. `token_ids`: one token stream (ints); `cache_kwargs` go to
    `make_cache` (e.g. the paged backend's `kernel=`)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    max_len = model.config.max_expected_seq_len
    if window > max_len:
        raise ValueError(f"window={window} exceeds the model's maximum sequence length {max_len}")
    windows = _windows([int(t) for t in token_ids], window)
    if not windows:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {len(token_ids)}")
    device = model.device
    total, count = 0.0, 0
    cache = make_cache(model, 1, window, **(cache_kwargs or {})) if use_cache else None
    for w in windows:
        ids = torch.tensor(w, dtype=torch.long, device=device)  # [n]
        if cache is None:
            logits = model(ids[None])[0]  # [n, V]
            total += _nll_sum(logits[:-1], ids[1:])
        else:
            size = chunk or len(w)
            cache.reset()
            for start in range(0, len(w), size):
                piece = w[start : start + size]
                tokens, positions, step, _ = cache.prefill([0], [piece], [start])
                logits = model(tokens, positions, step)[0, : len(piece)]  # [n_chunk, V]
                targets = ids[start + 1 : start + len(piece) + 1]  # the last chunk lacks its final target
                total += _nll_sum(logits[: len(targets)], targets)
            cache.release([0])
        count += len(w) - 1
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": len(windows)}


def heldout_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    max_chars: int = 200_000,
    window: int = 256,
    chunk: int | None = None,
    use_cache: bool = True,
    cache_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Perplexity on the first `max_chars` characters of the running interpreter's held-out stdlib
    files (`fms_paged.data.heldout_text`), encoded without BOS as one token stream."""
    from fms_paged.data import heldout_text

    ids = tokenizer.encode(heldout_text(max_chars), bos=False)
    result = perplexity(model, ids, window=window, chunk=chunk, use_cache=use_cache,
                        cache_kwargs=cache_kwargs)
    result.update(max_chars=max_chars, window=window)
    return result
