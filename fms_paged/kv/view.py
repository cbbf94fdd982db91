"""What a paged step sees of its backend (`PoolView`), and the host data a step is built from
(`PrefillBatch`, `DecodeBatch`).

A step never holds the backend or its page manager: it reads the per-layer pools, the device page
table and page->logical index, the page size and each layer's `AttentionSpec`, and it is built from
plain host data that the backend read off the page manager (the slots of the new tokens, each
sequence's pages). Page-table changes happen before (RESERVE by the step's owner), never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fms_paged.kv.spec import AttentionSpec, release_horizon, windows


@dataclass(frozen=True)
class PoolView:
    """The pools and tables of a paged backend, as its steps read them."""

    k_pools: Sequence[torch.Tensor]  # per layer [1, Hkv, num_pages * P, D]
    v_pools: Sequence[torch.Tensor]
    page_table: torch.Tensor  # [max_seqs, max_pages_per_seq] int32 on device (the page manager's)
    phys_to_logical: torch.Tensor  # [num_pages] int32 on device
    page_size: int
    # the page size as the cpp op takes it: an int a compiled step takes as an input (SymInt)
    page_size_arg: int
    num_pages: int
    max_blocks: int  # rows x pages a sequence can hold: the width of a prefill BlockMask's lists
    specs: tuple[AttentionSpec, ...]  # one per layer
    gqa_group: int  # query heads per kv head
    device: torch.device
    # the layers a step over this view serves (None: every layer), and the slices the model's
    # pages are held in (`fms_paged.kv.groups`): a grouped model's step is one step per slice,
    # each over a view of the slice's layers, its sequences being the slice's page-table rows
    layers: tuple[int, ...] | None = None
    num_slices: int = 1
    # per layer: an 8-bit pool's scales [1, Hkv, num_pages * P, G] fp32 (`fms_paged.kv.quant`),
    # None for a 16/32-bit pool
    k_scales: Sequence[torch.Tensor | None] = ()
    v_scales: Sequence[torch.Tensor | None] = ()
    compute_dtype: torch.dtype | None = None  # q, k, v's (the model's): what 8-bit pages dequantize to

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s (k_scales, v_scales), (None, None) for 16/32-bit pools."""
        if not self.k_scales:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers served: a step prepares its masks once per window."""
        return windows(self._served())

    @property
    def horizon(self) -> int | None:
        """Positions before `start - horizon + 1` are on released pages (every layer served is
        windowed)."""
        return release_horizon(self._served())

    def _served(self) -> tuple[AttentionSpec, ...]:
        return self.specs if self.layers is None else tuple(self.specs[i] for i in self.layers)


@dataclass
class PrefillBatch:
    """Prefill chunks of one step: chunk i appends `counts[i]` tokens to sequence `seq_ids[i]`,
    whose first `starts[i]` tokens are cached (RESERVEd already for the new ones)."""

    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    tokens: torch.Tensor  # [1, T] host int64, the chunks packed
    positions: np.ndarray  # [T] logical position of each token
    slots: torch.Tensor  # [T] int64 on device: pool slot of each new token (`PageManager.slots`)
    pages: list[list[int]]  # each sequence's pages in logical order (0 where released)
    min_tokens: int = 1  # a kernel that pads short steps pads to at least this many tokens

    @property
    def last(self) -> np.ndarray:
        """[len(seq_ids)] index of each chunk's last token in the packed row."""
        return np.cumsum(self.counts) - 1


@dataclass
class DecodeBatch:
    """Decode rows of one step (padded to a bucket): row i appends token `tokens[i]` at position
    `lengths[i]` of `seq_ids[i]`; inactive rows (padding) are computed and discarded."""

    seq_ids: list[int]
    tokens: torch.Tensor  # [B] int64 on device
    lengths: list[int]  # tokens cached per row before this one: its position
    active: list[bool]
    slots: list[int]  # pool slot of each row's new token (0, the null page's, for inactive rows)

    def rows(self) -> list[tuple[int, int, int]]:
        """(seq, position, slot) per row; an inactive row is (0, -1, 0): any valid table row, a
        position that sees nothing, the null page's slot."""
        return [(s, n, slot) if a else (0, -1, 0)
                for s, n, a, slot in zip(self.seq_ids, self.lengths, self.active, self.slots)]
