"""The interface `generate` (and the engine) drive a KV-cache backend through, and its factory.

A backend turns "these sequences get these new tokens" into model inputs plus the per-step
`AttentionStep`; the layout of the inputs is the backend's choice (dense: right-padded [B, S];
paged: packed [1, T] for prefill). `last` indexes each sequence's last token in the flattened
[B' * S'] logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from fms_paged.kv.contiguous import ContiguousKVCache, DenseStep
from fms_paged.kv.paged import PagedBackend, check_chunks


class KVCacheBackend(Protocol):
    def reset(self) -> None: ...

    def prefill(
        self,
        seq_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        starts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, object, torch.Tensor]:
        """Append `prompts[i]` to sequence `seq_ids[i]`, whose first `starts[i]` tokens (default 0)
        are already cached (chunked prefill). -> tokens [B', S'], positions [B', S'], step,
        last [len(seq_ids)]"""
        ...

    def decode(
        self,
        seq_ids: Sequence[int],
        tokens: torch.Tensor,
        lengths: Sequence[int],
        active: Sequence[bool],
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """One new token per row; tokens: [B] (device), lengths: host tokens cached per row."""
        ...

    def release(self, seq_ids: Sequence[int]) -> None: ...


class DenseBackend:
    """Rows 0..B-1 of a preallocated contiguous cache; batches right-padded (the baseline)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int):
        c = model.config
        self.cache = ContiguousKVCache(
            c.nlayers, max_batch, max_seq_len, c.kvheads, c.head_dim, model.dtype, model.device
        )
        self.device = model.device

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes

    def reset(self) -> None:
        pass  # stale rows are never read: the mask only admits positions already written

    @staticmethod
    def _check_rows(seq_ids: Sequence[int]) -> None:
        if list(seq_ids) != list(range(len(seq_ids))):
            raise ValueError(
                f"the dense backend serves rows 0..B-1 in order, got seq_ids={seq_ids}"
            )

    def prefill(self, seq_ids, prompts, starts=None):
        self._check_rows(seq_ids)
        starts = [0] * len(prompts) if starts is None else list(starts)
        check_chunks(seq_ids, [len(p) for p in prompts], starts)
        B, S = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(B, S, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p)
        # padded tokens get positions past their row's end: they are overwritten before being read
        positions = torch.tensor(starts)[:, None] + torch.arange(S)
        last = torch.tensor([b * S + len(p) - 1 for b, p in enumerate(prompts)])
        positions = positions.to(self.device)
        step = self.cache.step(positions, max(starts) + S, mask_free=not any(starts))
        return tokens.to(self.device), positions, step, last.to(self.device)

    def decode(self, seq_ids, tokens, lengths, active):
        self._check_rows(seq_ids)
        positions = torch.tensor(list(lengths), dtype=torch.long)[:, None].to(self.device)
        step: DenseStep = self.cache.step(positions, max(lengths) + 1, mask_free=len(lengths) == 1)
        return tokens[:, None], positions, step

    def release(self, seq_ids) -> None:
        pass


def make_cache(
    model: torch.nn.Module, max_batch: int, max_seq_len: int, **kwargs
) -> KVCacheBackend:
    """The backend named by `model.config.attn_impl`, sized for `max_batch` x `max_seq_len`."""
    impl = model.config.attn_impl
    if impl == "sdpa":
        return DenseBackend(model, max_batch, max_seq_len, **kwargs)
    if impl == "paged":
        return PagedBackend(model, max_batch, max_seq_len, **kwargs)
    raise ValueError(f"attn_impl={impl!r}; expected 'sdpa' or 'paged'")
