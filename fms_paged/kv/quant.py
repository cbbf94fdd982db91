"""8-bit KV pages: what `kv_cache_dtype` names, and how a page's 8-bit values and their scales are
written (quantized as ASSIGN writes them, never again) and read (dequantized by the reader).

`kv_cache_dtype` (vLLM's name): "auto" keeps K/V in the model's dtype; "int8" stores symmetric
int8 (absmax / 127); "fp8_e4m3" stores float8_e4m3fn (absmax / 448). Either 8-bit form keeps one
fp32 scale per token and kv head beside the values:

    # values: [1, Hkv, num_pages * P, D]  int8 or float8_e4m3fn, slot = page * P + offset
    # scales: [1, Hkv, num_pages * P, 1]  fp32, indexed by slot exactly as the values are

so every page operation (ASSIGN, GATHER, zeroing, copy-on-write) addresses both by slot along dim
2. One scale per row is the one format: docs/benchmarks.md ("Quantizers screened") measured
scales per 32 and 16 dims and affine u8 with a zero point against it, and none moved the top-1
agreement or the perplexity beyond the measurement's own error, while each would cost the kernels
arithmetic inside their dot products. A row is quantized once, from its own values alone, so a
page never needs re-quantizing when later tokens arrive (KIVI's per-channel keys would).
`quantize` / `dequantize` take a number of groups per row (the readers pass the scales' last
dim, 1; the screen of scripts/kv_cache_fidelity.py passes others).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
# what `--kv-cache-dtype` (generate, serve, bench) says of its choices
KV_CACHE_DTYPE_HELP = ("what the paged KV pages store: auto (the model's dtype), int8 or fp8_e4m3 (8-bit "
                       "values with an fp32 scale per token and kv head; docs/benchmarks.md)")
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


class KVCacheDtypeError(ValueError):
    """A `kv_cache_dtype` that is not one of `KV_CACHE_DTYPES`."""


def check_kv_cache_dtype(name: object) -> str:
    """`name` if it is one of `KV_CACHE_DTYPES`, else KVCacheDtypeError naming it and the choices."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise KVCacheDtypeError(f"kv_cache_dtype={name!r}; expected one of {KV_CACHE_DTYPES}")
    return name


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a page holds its values in: the model's for "auto", else the 8-bit one."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether pools of `dtype` hold 8-bit values with scales."""
    return dtype in _QMAX


def bytes_per_value(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes a page spends per K (or V) element, scales included."""
    dt = storage_dtype(kv_cache_dtype, model_dtype)
    size = torch.empty(0, dtype=dt).element_size()
    if not is_quantized(dt):
        return float(size)
    return size + torch.empty(0, dtype=SCALE_DTYPE).element_size() / head_dim


def scales_shape(pool_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[L, Hkv, N, D] -> the scales' [L, Hkv, N, 1]: one per token and kv head."""
    return (*pool_shape[:-1], 1)


def allocate(shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pool's storage, uninitialised: (values [L, Hkv, N, D] of `dtype`, scales
    [L, Hkv, N, 1] fp32, or None for a 16/32-bit pool). The one place a layer's page storage is
    made."""
    values = torch.empty(shape, dtype=dtype, device=device)
    if not is_quantized(dtype):
        return values, None
    return values, torch.empty(scales_shape(shape), dtype=SCALE_DTYPE, device=device)


def quantize(x: torch.Tensor, dtype: torch.dtype, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values [..., D] of `dtype`, scales [..., groups] fp32) with
    x ~= values * scale per group of D // groups dims: symmetric, scale = absmax / qmax (qmax 127
    for int8, 448 for fp8 e4m3); an all-zero group gets scale 0 and values 0."""
    *lead, D = x.shape
    xg = x.float().reshape(*lead, groups, D // groups)
    scale = xg.abs().amax(dim=-1, keepdim=True) / _QMAX[dtype]  # [..., groups, 1]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xg * inv
    q = y.round().clamp_(-127, 127).to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return q.reshape(*lead, D), scale.squeeze(-1)


def raw(pool: torch.Tensor) -> torch.Tensor:
    """`pool` as the index operations take it: an fp8 pool viewed as its bytes (torch's CPU
    index_fill_ / index_copy_ / index_select have no float8 kernels; the bytes are the values),
    any other as it is."""
    return pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] (8-bit), scales [..., groups] fp32 -> [..., D] of `dtype` (computed in fp32,
    then rounded once to `dtype`)."""
    *lead, D = values.shape
    G = scales.shape[-1]
    x = values.float().reshape(*lead, G, D // G) * scales.unsqueeze(-1)
    return x.reshape(*lead, D).to(dtype)
