"""The CPU paged-attention kernel (`csrc/kernels/attention.cpp`, built and loaded by `fms_paged.native`)
as the paged backend sees it: whether it serves a model here, and its operator's checked call.

The kernel attends prefill chunks and decode rows of one step in a single call, reading K and V in
place through the page table (no GATHER into logical order, no BlockMask), with the step's rows
spread over the intra-op threads. It is the paged backend's `kernel="cpp"`, chosen by `"auto"` on
the CPU for fp32, bf16 and fp16 models whose head dim is a multiple of 16 and whose pages hold a
multiple of 8 tokens, when no `score_mod` is asked for. One library per head dim and dtype; in
bf16 and fp16 it reads the half-precision pools and computes in fp32 (`attention.cpp`). 8-bit KV
pages (`kv_cache_dtype="int8"`, `fms_paged.kv.quant`) are read by a second build of it (kind
"attention_i8"): int8 pools with one fp32 scale per row, dequantized in registers as loaded.

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

The kernel is the operator `torch.ops.fms_paged.paged_attention` (`csrc/ops/ops.cpp`, which
validates its arguments and calls the kernel library `fms_paged.native` loaded), the same call in
eager mode and in a compiled graph.
"""

from __future__ import annotations

import os

import torch

from fms_paged import native
from fms_paged.native import HEAD_DIM_MULTIPLE, PAGE_MULTIPLE

__all__ = ["HEAD_DIM_MULTIPLE", "PAGE_MULTIPLE", "paged_attention", "unavailable_reason"]


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, page_size: int,
                       kv_int8: bool = False) -> str | None:
    """Why the kernel cannot serve this model here (None if it can; builds it if need be, or, while
    a first start's builds compile (`native.deferred`), starts its build and says it can: the
    steps attend by torch's operations until it is loaded, `native.ready`). `kv_int8`: its build
    over int8 pools (8-bit KV pages)."""
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
    native.prebuild_attention(dtype, head_dim, kv_int8)  # with the GEMV and rows kernels the blocks need next
    if native.deferred():  # a first start: served once built, by torch's operations until then
        return None
    return native.load_attention(head_dim, dtype, kv_int8)

def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    chunks: torch.Tensor, page_size: int, scale: float, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' pages.

    q: [B, H, S, D] (its B * S tokens in the chunks' offsets; D contiguous); k_pool, v_pool:
    [1, Hkv, NP, D] contiguous, of q's dtype (fp32, bf16 or fp16); page_table: [seqs, max_pages]
    int32; chunks: [n, 4] int64 rows (seq, first position, tokens, offset of the first token), seq
    -1 for rows to leave at zero -> [B, S, H, D] contiguous, of q's dtype (computed in fp32). The
    step's own keys and values are in the pools already (ASSIGN: `fms_paged.kv._pool_ops.write_slots`).

    Scores are q k^T * scale. The layer's variants (module docstring), each off by default:
    window: keys seen per query (0: all); softcap: the logit soft-cap (0.0: none); sinks: [H] fp32,
    one sink logit per query head (None: none). int8 pools (8-bit KV pages) take their row scales
    k_scales, v_scales [1, Hkv, NP, 1] fp32: a row is its int8 values times its scale.
    """
    if isinstance(window, bool) or not isinstance(window, int):
        raise ValueError(f"paged_attention: window={window!r}; expected an int >= 0 (0: no window)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"paged_attention: softcap={softcap!r}; expected 0.0 (none) or a finite float32")
    if sinks is not None and not (isinstance(sinks, torch.Tensor) and sinks.device.type == "cpu"):
        got = f"on {sinks.device}" if isinstance(sinks, torch.Tensor) else f"got {type(sinks).__name__}"
        raise ValueError(f"paged_attention: sinks must be None or a contiguous torch.float32 CPU tensor, "
                         f"{got}")
    why = native.ops()
    if why is None and q.dtype in native.ELEM_TYPES and q.dim() == 4 and q.shape[-1] % HEAD_DIM_MULTIPLE == 0:
        why = native.load_attention(q.shape[-1], q.dtype, k_pool.dtype == torch.int8)
    if why is not None:
        raise RuntimeError(f"fms_paged CPU attention kernel unavailable: {why}")
    if k_scales is not None:  # 8-bit KV pages: the operator over int8 pools
        return torch.ops.fms_paged.paged_attention_i8(q, k_pool, v_pool, k_scales, v_scales, page_table,
                                                      chunks, page_size, scale, window, softcap, sinks)
    return torch.ops.fms_paged.paged_attention(q, k_pool, v_pool, page_table, chunks, page_size, scale,
                                               window, softcap, sinks)
