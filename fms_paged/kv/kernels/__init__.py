"""Which paged-attention kernel runs where: one `Kernel` object per kernel, with its capabilities.

One production kernel per device and one reference path:
- "cpp" (`CppKernel`): the project's C++ CPU kernel (`fms_paged.kv.cpu_kernel`): prefill chunks and
  decode rows in one call per layer, K/V read in place through the page table. The CPU's kernel
  wherever it serves the model (see `cpu_kernel.unavailable_reason`) and no user `score_mod` is
  asked for.
- "flex" (`FlexKernel`): compiled FlexAttention through the block table (`fms_paged.flex.masks`):
  Triton on CUDA; on the CPU (inductor's C++ template) only where cpp cannot serve the model.
- "gather" (`GatherKernel`): GATHER each sequence's pages into logical order, then SDPA. It needs
  no compiler, so it is the fallback where neither compiles (MPS, a CPU without a C++ compiler)
  and, being the plainest, the tests' oracle for the other two.
"auto" picks the first of cpp, flex, gather that works here and announces a fallback to gather
once. Every kernel applies each layer's `AttentionSpec` (scale, window, soft-cap, sinks).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from fms_paged.kv import cpu_kernel
from fms_paged.kv.kernels.base import Kernel, MixedStep, PoolStep
from fms_paged.kv.kernels.cpp import CppKernel, CppStep
from fms_paged.kv.kernels.flex import (
    TRITON_MIN_HEAD_DIM,
    TRITON_MIN_PAGE,
    FlexKernel,
    compile_shape_variants,
    compiled_flex,
    flex_kernel_options,
    flex_max_pages,
    flex_unavailable_reason,
    prefill_bucket,
    probe_compiled_flex,
)
from fms_paged.kv.kernels.gather import GatherKernel
from fms_paged.kv.quant import is_quantized

KERNELS = ("auto", "cpp", "flex", "gather")

__all__ = [
    "KERNELS", "TRITON_MIN_HEAD_DIM", "TRITON_MIN_PAGE", "CppKernel", "CppStep", "FlexKernel",
    "GatherKernel", "Kernel",
    "MixedStep", "PoolStep", "choose_kernel", "compile_shape_variants", "compiled_flex",
    "flex_kernel_options", "flex_max_pages",
    "flex_unavailable_reason", "prefill_bucket", "probe_compiled_flex",
]


def choose_kernel(kernel: str, device: torch.device, page_size: int | None = None, *,
                  head_dim: int | None = None, dtype: torch.dtype | None = None,
                  score_mod: Callable | None = None, sinks: bool = False,
                  kv_dtype: torch.dtype | None = None) -> Kernel:
    """The kernel to run: `kernel` itself (checked), or for "auto" the first that serves the model
    here: cpp (needs `head_dim` and `dtype`; no score_mod), flex, gather (announced).
    `kv_dtype`: what the pages store (default `dtype`); 8-bit pages (`fms_paged.kv.quant`) are
    read by the kernels that dequantize them: gather (and cpp for int8; flex is refused: torch's
    flex_attention reads K and V as stored, and a `score_mod` could fold a key's scale into its
    score, but a value's scale multiplies after the softmax, which flex cannot express, so it
    would need a dequantized copy of the whole pool). ValueError for a kernel that cannot serve the
    model (cpp without its requirements, gather with a score_mod: only flex applies one; flex on
    the CPU for a model with attention `sinks`: inductor's CPU flex_attention returns no
    log-sum-exp, which they need)."""
    eight_bit = kv_dtype is not None and is_quantized(kv_dtype)
    name = _choose(kernel, device, page_size, head_dim, dtype, score_mod, kv_dtype if eight_bit else None)
    if name == "flex" and sinks and device.type == "cpu":
        raise ValueError("kernel='flex' cannot apply attention sinks on the CPU: inductor's CPU "
                         "flex_attention does not return the log-sum-exp they need (cpp and gather do)")
    return _make(name, device, page_size or 16, score_mod)


def _make(name: str, device: torch.device, page_size: int, score_mod: Callable | None) -> Kernel:
    if name == "cpp":
        return CppKernel()
    if name == "flex":
        return FlexKernel(device, page_size, score_mod)
    return GatherKernel()


def _choose(kernel: str, device: torch.device, page_size: int | None, head_dim: int | None,
            dtype: torch.dtype | None, score_mod: Callable | None, kv_8bit: torch.dtype | None = None) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}")
    if kv_8bit is not None:
        return _choose_8bit(kernel, device, page_size, head_dim, dtype, score_mod, kv_8bit)
    cpp_reason = None
    if kernel in ("auto", "cpp"):
        cpp_reason = "it cannot apply a score_mod" if score_mod is not None else (
            cpu_kernel.unavailable_reason(device, dtype, head_dim, page_size or 16)
            if head_dim is not None and dtype is not None else "no head_dim / dtype given")
    if kernel == "cpp" and cpp_reason is not None:
        raise ValueError(f"kernel='cpp' cannot serve this model: {cpp_reason}")
    if kernel == "flex" and device.type == "cuda" and head_dim is not None and head_dim < TRITON_MIN_HEAD_DIM:
        raise ValueError(f"kernel='flex' cannot serve this model on CUDA: "
                         f"{flex_unavailable_reason(device, page_size, head_dim)}")
    if kernel == "auto":
        if cpp_reason is None:
            return "cpp"
        reason = flex_unavailable_reason(device, page_size, head_dim)
        if reason is None:
            return "flex"
        if score_mod is None:
            warnings.warn(f"fms_paged: paged attention falls back to GATHER + SDPA: {reason}", stacklevel=4)
        kernel = "gather"
    if kernel == "gather" and score_mod is not None:
        why = flex_unavailable_reason(device, page_size)
        raise ValueError("a score_mod needs the flex kernel: GATHER + SDPA cannot apply it"
                         + (f" (flex is unavailable here: {why})" if why else ""))
    return kernel


def _choose_8bit(kernel: str, device: torch.device, page_size: int | None, head_dim: int | None,
                 dtype: torch.dtype | None, score_mod: Callable | None, kv_dtype: torch.dtype) -> str:
    """`_choose` for 8-bit pages: flex is refused (flex_attention takes K/V in the query's dtype),
    cpp reads int8 pages where it serves the model, gather reads both 8-bit forms."""
    what = f"8-bit KV pages ({kv_dtype})"
    if score_mod is not None:
        raise ValueError(f"a score_mod needs the flex kernel, which cannot read {what}: flex_attention "
                         "cannot apply a value's scale (after the softmax)")
    if kernel == "flex":
        raise ValueError(f"kernel='flex' cannot read {what}: flex_attention reads K and V as stored and "
                         "cannot apply a value's scale (after the softmax); use kernel='gather' (or "
                         "kv_cache_dtype='auto')")
    cpp_reason = cpp_8bit_reason(device, dtype, head_dim, page_size, kv_dtype)
    if kernel == "cpp" and cpp_reason is not None:
        raise ValueError(f"kernel='cpp' cannot serve this model with {what}: {cpp_reason}")
    if kernel == "auto":
        if cpp_reason is None:
            return "cpp"
        warnings.warn(f"fms_paged: {what} are read by GATHER + SDPA (dequantized as gathered): "
                      f"{cpp_reason}", stacklevel=4)
        return "gather"
    return kernel


def cpp_8bit_reason(device: torch.device, dtype: torch.dtype | None, head_dim: int | None,
                    page_size: int | None, kv_dtype: torch.dtype) -> str | None:
    """Why the cpp kernel cannot read `kv_dtype` pages for this model, or None: it reads int8 pages
    (its "attention_i8" build), where it serves the model at all."""
    if kv_dtype != torch.int8:
        return f"the C++ kernel reads int8 pages, not {kv_dtype}"
    if head_dim is None or dtype is None:
        return "no head_dim / dtype given"
    return cpu_kernel.unavailable_reason(device, dtype, head_dim, page_size or 16, kv_int8=True)
