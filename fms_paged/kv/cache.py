"""The interface a static batch (dense `generate`, the benchmarks, FMS's own `generate`) drives a
KV cache through, and its factory.

A cache turns "these sequences get these new tokens" into model inputs plus the per-step
`AttentionStep`; the layout of the inputs is the backend's choice (dense: right-padded [B, S];
paged: packed [1, T] for prefill). `last` indexes each sequence's last token in the flattened
[B' * S'] logits. The paged one (`PagedCache`) is the owner of its page table: it RESERVEs each
step's pages, then hands the step to its `PagedBackend`, which only reads (the engine's
scheduler plays that part for the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from fms_paged.kv.contiguous import ContiguousKVCache, DenseStep
from fms_paged.kv.paged import PagedBackend, attention_specs, check_chunks
from fms_paged.kv.spec import release_horizon


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
            c.nlayers, max_batch, max_seq_len, c.kvheads, c.head_dim, model.dtype, model.device,
            attention_specs(model),
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


class PagedCache:
    """A `PagedBackend` driven by static batches: it RESERVEs each step's pages (the one owner of
    its page table), prepares them, then builds the step; with every layer windowed, it first
    releases the pages behind the window (as the engine's scheduler does). `backend`, `pm` and
    `kernel` are its backend's."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, **kwargs):
        self._attach(PagedBackend(model, max_batch, max_seq_len, **kwargs))

    @classmethod
    def on(cls, backend: PagedBackend) -> PagedCache:
        """Static steps over an existing backend's pools (whose page table nothing else changes
        meanwhile)."""
        cache = cls.__new__(cls)
        cache._attach(backend)
        return cache

    def _attach(self, backend: PagedBackend) -> None:
        self.backend, self.pm, self.kernel = backend, backend.pm, backend.kernel
        self.device, self.max_batch = backend.device, backend.max_batch
        self.horizon = release_horizon(backend.specs)

    def _release_behind_windows(self, seq_ids: Sequence[int], first: Sequence[int]) -> None:
        """With every layer windowed: ERASE the pages of each live sequence that no layer reads
        again (`PageManager.release_behind_window`; `first[i]`: the step's first new position)."""
        self.pm.release_behind_window(seq_ids, first, self.horizon)

    @property
    def kv_bytes(self) -> int:
        return self.backend.kv_bytes

    @property
    def k_pools(self) -> list[torch.Tensor]:
        return self.backend.k_pools

    @property
    def v_pools(self) -> list[torch.Tensor]:
        return self.backend.v_pools

    def reset(self) -> None:
        self.pm.reset()

    def release(self, seq_ids: Sequence[int]) -> None:
        live = set(self.pm.live_seqs)
        ids = [s for s in seq_ids if s in live]
        if ids:
            self.pm.erase(ids)

    def _reserve_prefill(self, seq_ids, prompts, starts) -> list[int]:
        starts = [0] * len(prompts) if starts is None else list(starts)
        check_chunks(seq_ids, [len(p) for p in prompts], starts)
        live = set(self.pm.live_seqs)
        for s, start in zip(seq_ids, starts):
            have = self.pm.length(s) if s in live else 0
            if start != have:
                raise ValueError(f"prefill of seq {s} starts at {start}, but it holds {have} tokens")
        self._release_behind_windows(seq_ids, starts)
        self.backend.prepare_pages(self.pm.reserve(seq_ids, [s + len(p) for s, p in zip(starts, prompts)]))
        return starts

    def _reserve_decode(self, seq_ids, lengths, active) -> None:
        ids = [s for s, a in zip(seq_ids, active) if a]
        held = [n for n, a in zip(lengths, active) if a]
        for s, n in zip(ids, held):
            have = self.pm.length(s)
            if have != n:
                raise ValueError(f"seq {s} holds {have} tokens, but the step says {n}")
        self._release_behind_windows(ids, held)
        self.backend.prepare_pages(self.pm.reserve(ids, [n + 1 for n in held]))

    def prefill(self, seq_ids, prompts, starts=None, min_tokens: int = 1):
        """`KVCacheBackend.prefill`; `min_tokens`: a kernel that pads short steps (cpp) pads a step
        of fewer tokens to that many, tokens of no sequence (zero attention output, their keys and
        values written to the null page)."""
        starts = self._reserve_prefill(seq_ids, prompts, starts)
        return self.backend.prefill_inputs(seq_ids, prompts, starts, min_tokens)

    def decode(self, seq_ids, tokens, lengths, active):
        """`KVCacheBackend.decode`. ValueError if a row's length is not what its sequence holds;
        nothing changes then."""
        if len(lengths) != len(seq_ids) or len(active) != len(seq_ids):
            raise ValueError(f"decode got {len(seq_ids)} seq_ids, {len(lengths)} lengths and "
                             f"{len(active)} active flags")
        self._reserve_decode(seq_ids, lengths, active)
        return self.backend.decode_inputs(seq_ids, tokens, lengths, active)

    def mixed(self, dec_ids, dec_tokens, dec_lengths, dec_active, pre_ids, chunks, starts):
        """Decode rows and prefill chunks in one packed row (`PagedBackend.mixed_inputs`)."""
        self._reserve_decode(dec_ids, dec_lengths, dec_active)
        starts = self._reserve_prefill(pre_ids, chunks, starts)
        return self.backend.mixed_inputs(dec_ids, dec_tokens, dec_lengths, dec_active, pre_ids, chunks,
                                         starts)


def make_cache(
    model: torch.nn.Module, max_batch: int, max_seq_len: int, **kwargs
) -> KVCacheBackend:
    """The cache named by `model.config.attn_impl`, sized for `max_batch` x `max_seq_len`."""
    impl = model.config.attn_impl
    if impl == "sdpa":
        return DenseBackend(model, max_batch, max_seq_len, **kwargs)
    if impl == "paged":
        return PagedCache(model, max_batch, max_seq_len, **kwargs)
    raise ValueError(f"attn_impl={impl!r}; expected 'sdpa' or 'paged'")
