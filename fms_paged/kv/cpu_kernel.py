"""The CPU paged-attention kernel (`cpu_attention.cpp`, built by `fms_paged.native`): a torch op.

The kernel attends prefill chunks and decode rows of one step in a single call, reading K and V in
place through the page table (no GATHER into logical order, no BlockMask), with the step's rows
spread over the intra-op threads. It is the paged backend's `kernel="cpp"`, chosen by `"auto"` on
the CPU for fp32 models whose head dim is a multiple of 16 and whose pages hold a multiple of 8
tokens, when no `score_mod` is asked for. One library per head dim.

In a compiled graph the kernel is the opaque op `fms_paged::paged_attention`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from fms_paged import native

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# the kernel's tile sizes: 16 query rows per vector, 8 keys (of one page) per score tile
HEAD_DIM_MULTIPLE = 16
PAGE_MULTIPLE = 8

_LIB = torch.library.Library("fms_paged", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor page_table, Tensor chunks, "
    "SymInt page_size, float scale) -> Tensor"
)


@functools.cache
def _build(head_dim: int) -> tuple[ctypes.CDLL | None, str | None]:
    """The kernel library for `head_dim` -> (library, None) or (None, why not)."""
    lib, why = native.load(SOURCE, HEAD_DIM=head_dim)
    if lib is not None:
        fn = lib.fms_paged_attention
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ctypes.c_int, ptr, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ptr, i64, i64, ptr, i64, i64,
                       ptr, i64]
    return lib, why


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int) -> str | None:
    """Why the kernel cannot serve this model here (None if it can; builds it if need be)."""
    if device.type != "cpu":
        return f"it runs on the CPU, the model is on {device.type}"
    if dtype != torch.float32:
        return f"it computes in float32, the model is {dtype}"
    if head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}"
    if page_size % PAGE_MULTIPLE:
        return f"page_size={page_size} is not a multiple of {PAGE_MULTIPLE}"
    if os.environ.get("FMS_PAGED_FORCE_GATHER"):
        return "FMS_PAGED_FORCE_GATHER is set"
    return _build(head_dim)[1]


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x: [B, H, S, D] -> (a tensor holding its B * S tokens, token stride, head stride), D contiguous."""
    B, H, S, D = x.shape
    rows = x.transpose(1, 2)  # [B, S, H, D]
    if not (B == 1 or S == 1 or rows.stride(0) == S * rows.stride(1)) or rows.stride(3) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0) if S == 1 else rows.stride(1), rows.stride(2)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    chunks: torch.Tensor, page_size: int, scale: float,
                    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' pages.

    q: [B, H, S, D] (its B * S tokens in the chunks' offsets; D contiguous); k_pool, v_pool:
    [1, Hkv, NP, D] contiguous; page_table: [seqs, max_pages] int32; chunks: [n, 4] int64 rows
    (seq, first position, tokens, offset of the first token), seq -1 for rows to leave at zero;
    new: the step's own keys and values ([B, Hkv, S, D] each) and their slots ([B * S] int64), to
    ASSIGN into the pools first (in the same call) -> [B, S, H, D] contiguous.
    """
    B, H, S, D = q.shape
    f32, i64 = torch.float32, torch.int64
    want = [("q", q, f32, 4), ("k_pool", k_pool, f32, 4), ("v_pool", v_pool, f32, 4),
            ("page_table", page_table, torch.int32, 2), ("chunks", chunks, i64, 2)]
    if new is not None:
        want += [("k", new[0], f32, 4), ("v", new[1], f32, 4), ("slots", new[2], i64, 1)]
    for name, t, dtype, dims in want:
        if t.dtype != dtype or t.dim() != dims or t.device.type != "cpu":
            raise ValueError(f"paged_attention: {name} must be a {dims}-D {dtype} CPU tensor, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    pool = (1, k_pool.shape[1], k_pool.shape[2], D)
    if tuple(k_pool.shape) != pool or tuple(v_pool.shape) != pool or chunks.shape[1] != 4:
        raise ValueError(f"paged_attention: pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)}, chunks "
                         f"{tuple(chunks.shape)}: expected two pools [1, Hkv, NP, {D}] and chunks [n, 4]")
    if not all(t.is_contiguous() for t in (k_pool, v_pool, page_table, chunks)):
        raise ValueError("paged_attention: the pools, the page table and the chunks must be contiguous")
    lib, why = _build(D)
    if lib is None:
        raise RuntimeError(f"fms_paged CPU attention kernel unavailable: {why}")
    rows, q_st, q_sh = _rows(q)
    store = (None, 0, 0, None, 0, 0, None, 0)
    if new is not None:
        k, v, slots = new
        (kr, k_st, k_sh), (vr, v_st, v_sh) = _rows(k), _rows(v)
        if not slots.is_contiguous() or slots.numel() != B * S:
            raise ValueError(f"paged_attention: slots must be {B * S} contiguous, got {tuple(slots.shape)}")
        store = (kr.data_ptr(), k_st, k_sh, vr.data_ptr(), v_st, v_sh, slots.data_ptr(), slots.numel())
    out = torch.empty(B, S, H, D, dtype=q.dtype)
    n = chunks.shape[0]
    err = lib.fms_paged_attention(
        rows.data_ptr(), q_st, q_sh, B * S, k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[2],
        page_table.data_ptr(), page_table.shape[0], page_table.shape[1], chunks.data_ptr(), n, out.data_ptr(),
        H, k_pool.shape[1], page_size, scale, torch.get_num_threads(), *store,
    )
    if err == 1:
        raise ValueError(
            f"paged_attention: nheads={H} over kvheads={k_pool.shape[1]} with page_size={page_size}: "
            f"heads must divide evenly and pages hold a multiple of {PAGE_MULTIPLE}")
    if 2 <= err < 2 + n:
        raise ValueError(
            f"paged_attention: chunk {err - 2} {chunks[err - 2].tolist()} (seq, first position, tokens, "
            f"offset) is outside the page table ({page_table.shape[0]} seqs x {page_table.shape[1]} pages "
            f"of {page_size}) or the step's {B * S} tokens")
    if err:
        raise ValueError(f"paged_attention: a new token's slot is outside the pool's {k_pool.shape[2]} slots")
    return out


def _op(q, k_pool, v_pool, page_table, chunks, page_size, scale):
    return paged_attention(q, k_pool, v_pool, page_table, chunks, page_size, scale)


_LIB.impl("paged_attention", _op, "CPU")


@torch.library.register_fake("fms_paged::paged_attention")
def _paged_attention_fake(q, k_pool, v_pool, page_table, chunks, page_size, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)
