"""Layer groups: which layers keep which history, and how their pages share one pool.

Layers whose attention needs the same history form a group: the full-attention layers (every
earlier key), or the layers of one window size (the last `window` keys). A full group holds a page
for every token; a sliding group holds only the pages its window and the step being computed
touch, and gives the rest back as the window passes them (vLLM's hybrid KV cache manager).

How the groups share memory (vLLM's choice, not TensorRT-LLM's pool per window): every page of the
pool has the same bytes and any group takes pages from the one free pool, so no split of the memory
between groups is fixed in advance (a fixed split starves one group or the other whenever the
requests' lengths differ from what the split assumed). For pages of equal bytes, each group is cut
into *slices* of `u` layers, `u` the greatest common divisor of the groups' layer counts (Gemma 3
270M: 15 sliding + 3 full layers -> u = 3: one full slice and five sliding slices). A page id
belongs to one slice at a time and holds that slice's `u` layers; the pool is `u` tensors (per K
and V), and the j-th layer of every slice reads and writes tensor j. Each slice has its own page
table: row `slice * max_seqs + seq` of one `PageManager` (`fms_paged.kv.page_groups`).

A model whose layers all keep the same history is one slice of all its layers: one page table,
one tensor per layer, as before groups existed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fms_paged.kv.geometry import pages_held
from fms_paged.kv.spec import AttentionSpec, release_horizon


@dataclass(frozen=True)
class LayerGroups:
    """The slices of a model's layers (see the module docstring).

    slice_of: [nlayers] the slice of each layer; position_of: [nlayers] its index within the slice
    (the pool tensor it reads); windows: per slice, its window (None: full attention); slice_layers:
    per slice, its layers in order.
    """

    slice_of: tuple[int, ...]
    position_of: tuple[int, ...]
    windows: tuple[int | None, ...]
    slice_layers: tuple[tuple[int, ...], ...]

    @property
    def num_slices(self) -> int:
        return len(self.windows)

    @property
    def layers_per_slice(self) -> int:
        """u: the layers a page holds, and the pool tensors per K and per V."""
        return len(self.slice_layers[0])

    @property
    def grouped(self) -> bool:
        """Whether pages are held per slice (more than one slice)."""
        return self.num_slices > 1

    @property
    def sliding(self) -> tuple[int, ...]:
        """The slices whose layers are windowed."""
        return tuple(g for g, w in enumerate(self.windows) if w is not None)

    def min_pool_pages(self, max_model_len: int, page_size: int, chunk: int = 1) -> int:
        """The fewest pages a pool needs to serve one sequence of `max_model_len` tokens computing
        at most `chunk` tokens a step: the most each slice holds at once (`pages_held` under its
        window) and the null page."""
        return sum(pages_held(max_model_len, page_size, w, chunk) for w in self.windows) + 1

    def capacity(self, num_pages: int, page_size: int, chunk: int, max_model_len: int) -> int:
        """The longest sequence (tokens, at most `max_model_len`) a pool of `num_pages` pages holds
        alone: its sliding slices hold their window's pages, its full slices a page per `page_size`
        tokens."""
        full = sum(w is None for w in self.windows)
        sliding = sum(pages_held(max_model_len, page_size, w, chunk) for w in self.windows if w is not None)
        usable = num_pages - 1 - sliding
        if usable < 0:
            return 0
        return max_model_len if not full else min(max_model_len, usable // full * page_size)

    def describe(self) -> str:
        """e.g. "1 full slice + 5 sliding slices (window 512) of 3 layers"."""
        kinds: dict[int | None, int] = {}
        for w in self.windows:
            kinds[w] = kinds.get(w, 0) + 1
        parts = [f"{n} {'full' if w is None else f'sliding (window {w})'} slice{'s' * (n > 1)}"
                 for w, n in kinds.items()]
        return f"{' + '.join(parts)} of {self.layers_per_slice} layer{'s' * (self.layers_per_slice > 1)}"


def layer_groups(specs: Sequence[AttentionSpec], grouped: bool = True) -> LayerGroups:
    """The slices of layers with these specs. `grouped=False`, or layers that all keep the same
    history, give one slice of every layer (one page table). Groups are ordered full first, then by
    window; a group's layers are cut into slices of `u` consecutive layers of that group."""
    n = len(specs)
    kinds: dict[int | None, list[int]] = {}
    for layer, spec in enumerate(specs):
        kinds.setdefault(spec.window, []).append(layer)
    if not grouped or len(kinds) <= 1:  # one slice: releases behind the widest window, if all have one
        window = release_horizon(specs)
        return LayerGroups((0,) * n, tuple(range(n)), (window,), (tuple(range(n)),))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    u = math.gcd(*(len(kinds[w]) for w in order))
    slice_of, position_of = [0] * n, [0] * n
    windows, slice_layers = [], []
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), u):
            g = len(windows)
            windows.append(w)
            slice_layers.append(tuple(layers[start : start + u]))
            for j, layer in enumerate(layers[start : start + u]):
                slice_of[layer], position_of[layer] = g, j
    return LayerGroups(tuple(slice_of), tuple(position_of), tuple(windows), tuple(slice_layers))
