"""CPU weights in transparent huge pages.

A decode step on the CPU streams every weight from memory once, in short runs (a block of a few
weight rows per GEMV tile, many matrices per step). With 4 KiB pages that is a TLB miss every
4 KiB and a hardware prefetcher that stops at every page boundary; with 2 MiB pages neither. The
loader (`get_model`, `load_hf`) therefore places a CPU model's parameters in one anonymous mapping
that is 2 MiB-aligned and marked `MADV_HUGEPAGE` before it is touched, so that the kernel backs it
with huge pages where it has them (Linux with transparent huge pages set to `madvise` or `always`;
elsewhere, or under `never`, it is ordinary memory and nothing changes).

Each parameter is a tensor of its own storage (`torch.frombuffer` at its offset), so saving,
copying and sharing behave as for any tensor; the mapping is unmapped when the last of them is
freed. `FMS_PAGED_HUGE_PAGES=0` turns this off.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start: a cache line


def available() -> bool:
    """Whether weights can be placed in huge pages here: Linux, `MADV_HUGEPAGE` known to Python,
    and not turned off by `FMS_PAGED_HUGE_PAGES=0`."""
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get("FMS_PAGED_HUGE_PAGES", "1") != "0"
    )


class HugePageArena:
    """`nbytes` of anonymous memory, 2 MiB-aligned and advised for huge pages, handed out as
    tensors by `empty` in order. Pages are only backed once written, so an arena sized from an upper
    bound costs no memory for what it does not hand out."""

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"HugePageArena: nbytes must be positive, got {nbytes}")
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # (shared: shmem, no THP)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = (-whole.data_ptr()) % HUGE_PAGE  # the first 2 MiB boundary
        del whole
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._used = self._start
        self._end = self._start + nbytes

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous tensor in the arena, or None where it has no room left."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        offset = -(-self._used // _ALIGN) * _ALIGN
        if offset + nbytes > self._end:
            return None
        self._used = offset + nbytes
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset).view(shape)


def arena_for(sizes: Iterable[int]) -> HugePageArena | None:
    """An arena for tensors of these byte sizes (with each one's alignment slack), or None where
    huge pages are not `available()` or they fill less than one huge page (nothing to gain)."""
    sizes = list(sizes)
    nbytes = sum(sizes) + _ALIGN * len(sizes)
    if not available() or nbytes < HUGE_PAGE:
        return None
    return HugePageArena(nbytes)


def place_in_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters (tied ones once) into one huge-page arena, in place
    (`param.data`), and return the bytes moved (0: not `available()`, or nothing to move). Values,
    dtypes, shapes and `requires_grad` are unchanged."""
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel()]  # (tied: once)
    arena = arena_for(p.nbytes for p in params)
    if arena is None:
        return 0
    moved = 0
    with torch.no_grad():
        for p in params:
            dst = arena.empty(p.shape, p.dtype)
            dst.copy_(p)
            p.data = dst
            moved += p.nbytes
    return moved
