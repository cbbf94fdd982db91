"""Tensor side of the paged KV cache: the only code of the PageManager that touches the device.

The PageManager does its bookkeeping on the host (numpy + a deque) and calls these helpers to
move small index arrays to the device and to read/write the KV pools. None of them reads device
memory back to the host (no `.item()`, `.tolist()`, `nonzero`, boolean masking), so they are safe
on the decode hot path.

Pool layout (one tensor per layer, or one stacked tensor for all layers):
    # pool: [L, Hkv, num_pages * P, D]   slot = page * P + offset, slot dim is -2
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from fms_paged.kv.geometry import page_slots
from fms_paged.kv.quant import dequantize, is_quantized, quantize, raw


def as_int_array(values: Sequence[int] | np.ndarray | torch.Tensor, what: str) -> np.ndarray:
    """Host ints (list / numpy / CPU tensor) -> 1-D int64 numpy array; ValueError otherwise."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{what} must be host data, got a tensor on {values.device}")
        values = values.numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a 1-D sequence of ints, got {values!r}")
    return arr.astype(np.int64, copy=False)


def as_int_list(values: Sequence[int] | np.ndarray | torch.Tensor, what: str) -> list[int]:
    """Host ints -> a list of Python ints (cheaper than numpy for a handful of values)."""
    if isinstance(values, (np.ndarray, torch.Tensor)):
        return as_int_array(values, what).tolist()
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{what} must be a 1-D sequence of ints, got {values!r}") from None


def to_device(arr: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host array (numpy, or a contiguous CPU tensor) -> tensor on `device` in one copy, without
    waiting for the device.

    On CUDA the array is staged in pinned memory so the copy is asynchronous; the caching host
    allocator keeps the staging buffer alive until the copy has run.
    """
    host = arr if isinstance(arr, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(device, non_blocking=True)
    return host.to(device)


def scatter_int32(dst: torch.Tensor, flat_idx: torch.Tensor, values: torch.Tensor) -> None:
    """dst.view(-1)[flat_idx] = values (cast to int32), in place, no host sync.

    # dst: any contiguous int32 tensor; flat_idx, values: [K] int64 on dst.device
    """
    if flat_idx.numel():
        dst.view(-1).index_copy_(0, flat_idx, values.to(torch.int32))


def fill_int32(dst: torch.Tensor, flat_idx: torch.Tensor, value: int) -> None:
    """dst.view(-1)[flat_idx] = value, in place, no host sync."""
    if flat_idx.numel():
        dst.view(-1).index_fill_(0, flat_idx, value)


def check_pool_pair(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Pools must be 4-D `[L, Hkv, N, D]`, same shape, dtype and device."""
    if k_pool.dim() != 4:
        raise ValueError(f"k_pool must be [L, Hkv, num_pages*P, D], got shape {tuple(k_pool.shape)}")
    for name, got, want in (
        ("shape", tuple(v_pool.shape), tuple(k_pool.shape)),
        ("dtype", v_pool.dtype, k_pool.dtype),
        ("device", v_pool.device, k_pool.device),
    ):
        if got != want:
            raise ValueError(f"v_pool {name} {got} does not match k_pool {name} {want}")


def _check_kv(name: str, x: torch.Tensor, pool: torch.Tensor, num_tokens: int) -> None:
    """x must be [T, Hkv, D] (or [L, T, Hkv, D]) with the pool's dtype and device."""
    L, H, _, D = pool.shape
    if is_quantized(pool.dtype):  # an 8-bit pool takes any float k/v: ASSIGN quantizes them
        if not x.is_floating_point():
            raise TypeError(f"{name} dtype {x.dtype}: an 8-bit pool ({pool.dtype}) takes float k/v")
    elif x.dtype != pool.dtype:
        raise TypeError(f"{name} dtype {x.dtype} does not match pool dtype {pool.dtype}")
    if x.device != pool.device:
        raise TypeError(f"{name} device {x.device} does not match pool device {pool.device}")
    want = [(num_tokens, H, D)] if L == 1 else []
    want.append((L, num_tokens, H, D))
    if tuple(x.shape) not in want:
        shapes = " or ".join(str(list(w)) for w in want)
        raise ValueError(f"{name} shape {list(x.shape)}, expected {shapes} ([L, T, Hkv, D])")


def write_slots(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write new keys/values into the pools at `slots`: one `index_copy_` per pool, no host sync.

    # k_pool, v_pool: [L, Hkv, num_pages*P, D]
    # slots: [T] int64 on the pools' device (from PageManager.slots)
    # k, v: [T, Hkv, D] when L == 1, else [L, T, Hkv, D] (all layers at once)
    # k_scales, v_scales: [L, Hkv, num_pages*P, G] fp32 for 8-bit pools (`fms_paged.kv.quant`), else None
    For a stacked pool written one layer at a time, pass `pool[layer : layer + 1]`. An 8-bit pool's
    new tokens are quantized here, once (values and their scales written at the same slots).
    Raises TypeError (dtype/device) or ValueError (shape); the pools are unchanged on error.
    """
    check_pool_pair(k_pool, v_pool)
    if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != k_pool.device:
        raise ValueError(
            f"slots must be a 1-D int64 tensor on {k_pool.device}, got "
            f"{slots.dtype} {list(slots.shape)} on {slots.device}"
        )
    T = slots.shape[0]
    _check_kv("k", k, k_pool, T)
    _check_kv("v", v, v_pool, T)
    quantized = is_quantized(k_pool.dtype)
    if quantized and (k_scales is None or v_scales is None):
        raise ValueError(f"an 8-bit pool ({k_pool.dtype}) needs its k_scales and v_scales")
    for pool, scales, x in ((k_pool, k_scales, k), (v_pool, v_scales, v)):
        x4 = (x.unsqueeze(0) if x.dim() == 3 else x).transpose(1, 2)  # [L, Hkv, T, D]
        if quantized:
            x4, s = quantize(x4, pool.dtype, scales.shape[-1])  # [L, Hkv, T, D], [L, Hkv, T, G]
            scales.index_copy_(2, slots, s)
        raw(pool).index_copy_(2, slots, raw(x4))


_FEW_COPIES = 4  # copy_pages: up to this many pages, a slice copy each (see there)


def copy_pages(pools: tuple[torch.Tensor, ...], src: np.ndarray, dst: np.ndarray, P: int) -> None:
    """Copy whole pages src[i] -> dst[i] in every pool (copy-on-write). A contiguous pool viewed
    as [L * Hkv, num_pages, P * D] copies whole pages (a page is one run of P * D values per
    head): a few pages (beam search's step) one `copy_` of a page each, cheaper than an index op
    pair; more, one index op per pool. Any other pool: slot by slot, one index op per pool.

    # pools: each [L, Hkv, num_pages*P, D] (an 8-bit pool's scales [L, Hkv, num_pages*P, G]
    # are pools too: pass them, and FORK copies a page's scales with its values)
    # src, dst: [K] host page ids, dst distinct
    """
    if src.size == 0:
        return
    few = list(zip(src.tolist(), dst.tolist())) if src.size <= _FEW_COPIES else None
    by_page: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    by_slot: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for pool in pools:
        if pool.dim() != 4:
            raise ValueError(f"pool must be [L, Hkv, num_pages*P, D], got {list(pool.shape)}")
        pool = raw(pool)
        if pool.is_contiguous():
            L, H, S, D = pool.shape
            pages = pool.view(L * H, S // P, P * D)
            if few is not None:
                for s, d in few:
                    pages[:, d].copy_(pages[:, s])
                continue
            if pool.device not in by_page:
                both = to_device(np.concatenate([src, dst]).astype(np.int64), pool.device)
                by_page[pool.device] = (both[: src.size], both[src.size :])
            s, d = by_page[pool.device]
            pages.index_copy_(1, d, pages.index_select(1, s))
            continue
        if pool.device not in by_slot:
            src_slots = page_slots(src, P).reshape(-1)  # [K*P]
            both = to_device(np.concatenate([src_slots, page_slots(dst, P).reshape(-1)]), pool.device)
            by_slot[pool.device] = (both[: src_slots.size], both[src_slots.size :])
        s, d = by_slot[pool.device]
        pool.index_copy_(2, d, pool.index_select(2, s))


def read_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
               k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GATHER: the keys and values at `slots`, one `index_select` per pool, no host sync.

    # k_pool, v_pool: [L, Hkv, num_pages*P, D]; slots: any shape [...] int64 on the pools' device
    # k_scales, v_scales: [L, Hkv, num_pages*P, G] for 8-bit pools, else None
    # returns k, v: [L, Hkv, ..., D]
    An 8-bit pool's gathered values are dequantized (with their scales gathered alike) to `dtype`
    (default fp32); a 16/32-bit pool's come back as stored.
    The slots are trusted (the page manager computed them from its table, `PageManager.slots`,
    or a step from the device page table): an index_select still refuses one outside the pool.
    """
    L, H, _, D = k_pool.shape
    flat = slots.reshape(-1)
    out = []
    for pool, scales in ((k_pool, k_scales), (v_pool, v_scales)):
        x = raw(pool).index_select(2, flat).view(pool.dtype)  # [L, H, K, D]
        if is_quantized(pool.dtype):
            if scales is None:
                raise ValueError(f"an 8-bit pool ({pool.dtype}) is read with its scales")
            x = dequantize(x, scales.index_select(2, flat), dtype or torch.float32)
        out.append(x.view(L, H, *slots.shape, D))
    return out[0], out[1]
