"""Perplexity over non-overlapping windows, each scored from its own start (its first token is
context only), through the model's KV-cache backend in chunks of `chunk` tokens (chunked prefill:
later chunks read the earlier ones' K/V from the cache), or with no cache (the whole window through
plain causal attention: the independent reference). Both agree up to float round-off."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fms_paged.bench.latency import with_config
from fms_paged.data import DatasetSource, heldout_text
from fms_paged.kv.cache import make_cache
from fms_paged.tokenizers import load_tokenizer


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_ids: list[int], window: int = 256, chunk: int | None = None,
               use_cache: bool = True, cache_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """-> {"ppl": exp(mean NLL), "nll": mean NLL per predicted token, "tokens": predicted tokens,
    "windows"}. `cache_kwargs` go to `make_cache` (e.g. the paged backend's `kernel=`)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    max_len = model.config.max_expected_seq_len
    if window > max_len:
        raise ValueError(f"window={window} exceeds the model's maximum sequence length {max_len}")
    stream = [int(t) for t in token_ids]  # windows; a short tail kept if it has a token to predict
    windows = [w for w in (stream[i : i + window] for i in range(0, len(stream), window)) if len(w) >= 2]
    if not windows:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {len(token_ids)}")
    total, count = 0.0, 0  # summed NLL in float64, predicted tokens
    nll_sum = lambda logits, targets: F.cross_entropy(logits.double(), targets, reduction="sum").item()
    cache = make_cache(model, 1, window, **(cache_kwargs or {})) if use_cache else None
    for w in windows:
        ids = torch.tensor(w, dtype=torch.long, device=model.device)  # [n]
        if cache is None:
            total += nll_sum(model(ids[None])[0][:-1], ids[1:])  # logits: [n, V]
        else:
            size = chunk or len(w)
            cache.reset()
            for start in range(0, len(w), size):
                piece = w[start : start + size]
                tokens, positions, step, _ = cache.prefill([0], [piece], [start])
                logits = model(tokens, positions, step)[0, : len(piece)]  # [n_chunk, V]
                targets = ids[start + 1 : start + len(piece) + 1]  # the last chunk lacks its final target
                total += nll_sum(logits[: len(targets)], targets)
            cache.release([0])
        count += len(w) - 1
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": len(windows)}


def heldout_perplexity(model: torch.nn.Module, tokenizer: Any, max_chars: int = 200_000, window: int = 256,
                       chunk: int | None = None, use_cache: bool = True,
                       cache_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Perplexity on the first `max_chars` characters of the running interpreter's held-out stdlib
    files (`fms_paged.data.heldout_text`), encoded without BOS as one token stream."""
    ids = tokenizer.encode(heldout_text(max_chars), add_special_tokens=False)
    return dict(perplexity(model, ids, window=window, chunk=chunk, use_cache=use_cache,
                           cache_kwargs=cache_kwargs), max_chars=max_chars, window=window)


def eval_tokens(model: torch.nn.Module, model_path: str | None, text_file: str | None = None,
                chars: int = 20_000, dataset: DatasetSource | None = None) -> tuple[list[int], str]:
    """-> (token ids, what they are): the first `chars` characters of `text_file`, of `dataset`'s
    text column or of the stdlib held-out split, through the checkpoint's tokenizer, or as bytes
    (mod vocab) without one."""
    if text_file and dataset is not None:
        raise ValueError(f"argument --dataset: not allowed with --text-file ({dataset} and {text_file})")
    if text_file:
        text, what = Path(text_file).read_text(encoding="utf-8", errors="replace")[:chars], text_file
    elif dataset is not None:
        text, what = dataset.text(chars), f"dataset {dataset}"
    else:
        text, what = heldout_text(chars)[:chars], "stdlib held-out split"
    if model_path and any((Path(model_path) / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
        return load_tokenizer(model_path).encode(text, add_special_tokens=False), f"{what}, {len(text)} chars"
    vocab = model.config.src_vocab_size
    return [b % vocab for b in text.encode("utf-8")], f"{what}, {len(text)} chars as bytes"


def by_backend(model: torch.nn.Module, impls: list[str], ids: list[int], window: int,
               kernel: str = "auto") -> dict[str, Any]:
    """Perplexity with no cache (the reference) and through each KV backend of `impls` (the paged
    one on `kernel`), on twins of `model` sharing its weights."""
    window = min(window, model.config.max_expected_seq_len)
    by: dict[str, Any] = {"no-cache": (ref := perplexity(model, ids, window=window, use_cache=False))}
    for impl in [i for i in impls if i != "no-cache"]:
        r = perplexity(with_config(model, attn_impl=impl), ids, window=window,
                       cache_kwargs={"kernel": kernel} if impl == "paged" else None)
        by[impl] = dict(r, rel_diff_vs_reference=abs(r["ppl"] - ref["ppl"]) / ref["ppl"])
    return {"by_backend": by, "tokens": ref["tokens"], "window": window}
