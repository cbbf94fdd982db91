"""The CPU paged-attention kernel (`cpu_attention.cpp`, built by `fms_paged.native`): a torch op.

The kernel attends prefill chunks and decode rows of one step in a single call, reading K and V in
place through the page table (no GATHER into logical order, no BlockMask), with the step's rows
spread over the intra-op threads. It is the paged backend's `kernel="cpp"`, chosen by `"auto"` on
the CPU for fp32, bf16 and fp16 models whose head dim is a multiple of 16 and whose pages hold a
multiple of 8 tokens, when no `score_mod` is asked for. One library per head dim and dtype; in
bf16 and fp16 it reads the half-precision pools and computes in fp32 (`cpu_attention.cpp`).

Besides the causal mask and the softmax scale, a call may ask for the per-layer attention variants
of the model families the project serves, each the function Hugging Face transformers computes:

- `window` (0: none): a sliding window, as Mistral, Gemma 2 / 3 and gpt-oss layers have: the query
  at position p sees keys max(0, p - window + 1) .. p. The kernel touches no page wholly older
  than its queries' windows, so a long sequence's windowed layers cost what the window holds.
- `softcap` (0.0: none): Gemma 2's logit soft-cap: each scaled score s becomes
  softcap * tanh(s / softcap) before the mask and the softmax.
- `sinks` (None: none): gpt-oss's attention sinks, one learned logit per query head ([H] fp32) that
  joins the softmax's denominator and adds nothing to the output:
  out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)).

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
    "SymInt page_size, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor"
)


_i32p, _i64p, _f32p = native.pointer("i32"), native.pointer("i64"), native.pointer("f32")
_i32, _i64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


@functools.cache
def attention_args(dtype: torch.dtype) -> type[ctypes.Structure]:
    """The kernel's argument struct for tensors of `dtype` (`cpu_attention.cpp`, which says what each
    field holds), field for field; `native.bind` checks the library's layout against it. Set fields
    by name: an unknown name (`__slots__`) or a value of the wrong type raises."""
    tp = native.pointer(native.elem(dtype)[1])
    fields = [
        ("q", tp), ("q_st", _i64), ("q_sh", _i64), ("n_tokens", _i64),
        ("k", tp), ("v", tp), ("pool_tokens", _i64),
        ("pages", _i32p), ("n_seqs", _i64), ("pages_st", _i64),
        ("chunks", _i64p), ("n_chunks", _i64), ("out", tp),
        ("H", _i32), ("Hkv", _i32), ("P", _i32), ("scale", _f32), ("threads", _i32),
        ("softcap", _f32), ("window", _i64), ("sinks", _f32p),
    ]
    return type("FmsPagedAttentionArgs", (ctypes.Structure,), {"__slots__": (), "_fields_": fields})


def _build(head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[ctypes._CFuncPtr | None, str | None]:
    """The kernel for `head_dim` and `dtype`, built for `native.isa()` -> (function of an
    `attention_args(dtype)`, None) or (None, why not); raises `native.LayoutMismatch` for a library
    whose struct is not the mirror's."""
    return _built(head_dim, dtype, native.isa())


@functools.cache
def _built(head_dim: int, dtype: torch.dtype, which: str) -> tuple[ctypes._CFuncPtr | None, str | None]:
    lib, why = native._load(SOURCE, which, HEAD_DIM=head_dim, FMS_ELEM=native.elem(dtype)[0])
    if lib is None:
        return None, why
    return native.bind(lib, "fms_paged_attention", attention_args(dtype)), None


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int) -> str | None:
    """Why the kernel cannot serve this model here (None if it can; builds it if need be)."""
    if device.type != "cpu":
        return f"it runs on the CPU, the model is on {device.type}"
    if dtype not in native.ELEM_TYPES:
        return f"it takes {', '.join(str(d) for d in native.ELEM_TYPES)}, the model is {dtype}"
    if head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}"
    if page_size % PAGE_MULTIPLE:
        return f"page_size={page_size} is not a multiple of {PAGE_MULTIPLE}"
    if os.environ.get("FMS_PAGED_FORCE_GATHER"):
        return "FMS_PAGED_FORCE_GATHER is set"
    return _build(head_dim, dtype)[1]


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x: [B, H, S, D] -> (a tensor holding its B * S tokens, token stride, head stride), D contiguous."""
    B, H, S, D = x.shape
    rows = x.transpose(1, 2)  # [B, S, H, D]
    if not (B == 1 or S == 1 or rows.stride(0) == S * rows.stride(1)) or rows.stride(3) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0) if S == 1 else rows.stride(1), rows.stride(2)


_F32 = torch.finfo(torch.float32)


def _check_variants(H: int, window: int, softcap: float, sinks: torch.Tensor | None) -> None:
    """ValueError naming the value unless window is an int >= 0, softcap 0.0 or a normal finite
    float32 (its reciprocal must be finite too), and sinks None or a contiguous fp32 CPU [H]."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 2**63:
        raise ValueError(f"paged_attention: window={window!r}; expected an int >= 0 (0: no window)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            softcap == 0 or _F32.tiny <= softcap <= _F32.max):
        raise ValueError(f"paged_attention: softcap={softcap!r}; expected 0.0 (none) or a finite float32 "
                         f"in [{_F32.tiny:.4g}, {_F32.max:.4g}]")
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.dtype == torch.float32
                                  and tuple(sinks.shape) == (H,) and sinks.device.type == "cpu"
                                  and sinks.is_contiguous()):
        got = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
               f"{'' if sinks.is_contiguous() else ', not contiguous'}"
               if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
        raise ValueError(f"paged_attention: sinks must be None or a contiguous torch.float32 CPU tensor "
                         f"[{H}] (one logit per query head), got {got}")


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    chunks: torch.Tensor, page_size: int, scale: float, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' pages.

    q: [B, H, S, D] (its B * S tokens in the chunks' offsets; D contiguous); k_pool, v_pool:
    [1, Hkv, NP, D] contiguous, of q's dtype (fp32, bf16 or fp16); page_table: [seqs, max_pages]
    int32; chunks: [n, 4] int64 rows (seq, first position, tokens, offset of the first token), seq
    -1 for rows to leave at zero -> [B, S, H, D] contiguous, of q's dtype (computed in fp32). The
    step's own keys and values are in the pools already (ASSIGN: `fms_paged.kv._pool_ops.write_slots`).

    Scores are q k^T * scale. The layer's variants (module docstring), each off by default:
    window: keys seen per query (0: all); softcap: the logit soft-cap (0.0: none); sinks: [H] fp32,
    one sink logit per query head (None: none).
    """
    B, H, S, D = q.shape
    dt, i64 = q.dtype, torch.int64
    if dt not in native.ELEM_TYPES:
        kinds = ", ".join(map(str, native.ELEM_TYPES))
        raise ValueError(f"paged_attention: q is {dt}; the kernel takes {kinds}")
    _check_variants(H, window, softcap, sinks)
    want = [("q", q, dt, 4), ("k_pool", k_pool, dt, 4), ("v_pool", v_pool, dt, 4),
            ("page_table", page_table, torch.int32, 2), ("chunks", chunks, i64, 2)]
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
    kernel, why = _build(D, dt)
    if kernel is None:
        raise RuntimeError(f"fms_paged CPU attention kernel unavailable: {why}")
    Hkv = k_pool.shape[1]
    rows, q_st, q_sh = _rows(q)
    out = torch.empty(B, S, H, D, dtype=q.dtype)
    n = chunks.shape[0]
    args = attention_args(dt)(
        q=rows.data_ptr(), q_st=q_st, q_sh=q_sh, n_tokens=B * S,
        k=k_pool.data_ptr(), v=v_pool.data_ptr(), pool_tokens=k_pool.shape[2],
        pages=page_table.data_ptr(), n_seqs=page_table.shape[0], pages_st=page_table.shape[1],
        chunks=chunks.data_ptr(), n_chunks=n, out=out.data_ptr(),
        H=H, Hkv=Hkv, P=page_size, scale=scale, threads=torch.get_num_threads(),
        softcap=softcap, window=window, sinks=None if sinks is None else sinks.data_ptr(),
    )
    err = kernel(args)
    if err == 1:
        raise ValueError(
            f"paged_attention: nheads={H} over kvheads={Hkv} with page_size={page_size}: "
            f"heads must divide evenly and pages hold a multiple of {PAGE_MULTIPLE}")
    if err:
        raise ValueError(
            f"paged_attention: chunk {err - 2} {chunks[err - 2].tolist()} (seq, first position, tokens, "
            f"offset) is outside the page table ({page_table.shape[0]} seqs x {page_table.shape[1]} pages "
            f"of {page_size}) or the step's {B * S} tokens")
    return out


def _op(q, k_pool, v_pool, page_table, chunks, page_size, scale, window=0, softcap=0.0, sinks=None):
    return paged_attention(q, k_pool, v_pool, page_table, chunks, page_size, scale, window, softcap, sinks)


_LIB.impl("paged_attention", _op, "CPU")


@torch.library.register_fake("fms_paged::paged_attention")
def _paged_attention_fake(q, k_pool, v_pool, page_table, chunks, page_size, scale, window=0, softcap=0.0,
                          sinks=None):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D)
