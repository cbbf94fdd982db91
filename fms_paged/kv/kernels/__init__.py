"""Which paged-attention kernel runs where.

One production kernel per device and one reference path:
- "cpp": the project's C++ CPU kernel (`fms_paged.kv.cpu_kernel`): prefill chunks and decode rows in
  one call per layer, K/V read in place through the page table. The CPU's kernel wherever it serves
  the model (see `cpu_kernel.unavailable_reason`) and no `score_mod` is asked for.
- "flex": compiled FlexAttention through the block table (`fms_paged.flex.masks`): Triton on CUDA;
  on the CPU (inductor's C++ template) only where cpp cannot serve the model.
- "gather": GATHER each sequence's pages into logical order, then SDPA. It needs no compiler, so it
  is the fallback where neither compiles (MPS, a CPU without a C++ compiler) and, being the
  plainest, the tests' oracle for the other two.
"auto" picks the first of cpp, flex, gather that works here and announces a fallback to gather once.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fms_paged import native
from fms_paged.kv import cpu_kernel

KERNELS = ("auto", "cpp", "flex", "gather")

# Triton's flex kernels tile the KV axis in BLOCK_N columns and need each KV block (one page) to be
# a whole number of tiles; inductor's default BLOCK_N is 16..128 by GPU, dtype and head_dim, and
# tl.dot needs tiles of at least 16 columns.
TRITON_MIN_PAGE = 16


def allow_shape_variants() -> None:
    """Raise Dynamo's recompile limits (per code object 8 -> 64, in all 256 -> 512) for the
    static-shape steps compiled here: each (pool size, rows, decode or prefill bucket) is a
    specialization of the same code object, and a process that serves several pools or page sizes
    meets more than 8 (within a pool, decode shapes never change: see the recompile test).
    Process-wide, like Dynamo's own config; called where such a step is made."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 512
    )


@functools.cache
def compiled_flex(dynamic: bool) -> Callable:
    """One compiled flex_attention per shape policy, shared by every backend in the process."""
    # Inductor's CPU kernels and ATen share the OpenMP runtime; re-applying the thread count aligns
    # their team sizes (without it, decode steps that alternate ATen matmuls with the compiled flex
    # kernel ran an order of magnitude slower on a 2-core CPU).
    torch.set_num_threads(torch.get_num_threads())
    allow_shape_variants()
    return torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)


def flex_kernel_options(device: torch.device, page_size: int) -> dict | None:
    """`kernel_options` for flex_attention over pages of `page_size` tokens.

    CUDA: unless the page is a multiple of 128 (every default tile divides it), BLOCK_N is set to
    the largest power of two dividing the page, at most 64, so that compiling does not fail on a
    default tile wider than the page. CPU: the inductor C++ kernel takes the KV block as its tile,
    so nothing is set."""
    if device.type != "cuda" or page_size % 128 == 0:
        return None
    return {"BLOCK_N": min(64, page_size & -page_size)}


def flex_unavailable_reason(device: torch.device, page_size: int | None = None) -> str | None:
    """Why compiled flex_attention cannot run on `device` (with pages of `page_size`) here (None if
    it can)."""
    if os.environ.get("FMS_PAGED_FORCE_GATHER"):
        return "FMS_PAGED_FORCE_GATHER is set"
    if device.type == "cuda":
        if page_size is not None and page_size % TRITON_MIN_PAGE:
            return f"page_size={page_size} is not a multiple of {TRITON_MIN_PAGE} (Triton's smallest KV tile)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    if device.type == "cpu":
        if native.compiler() is None:
            return "no C++ compiler found for inductor's CPU flex_attention ($CXX, g++ or c++)"
        headers = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(headers, "Python.h")):
            return (f"no Python.h in {headers}: inductor's CPU kernels need this Python's headers "
                    "(Debian/Ubuntu: apt-get install python3-dev)")
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            if not pick_vec_isa():
                return "this CPU has no AVX2/AVX512/NEON vector ISA for inductor"
        except Exception as e:  # pragma: no cover - depends on the torch build
            return f"inductor CPU support unavailable ({e})"
        return None
    return f"compiled flex_attention is not supported on {device.type} by this torch build"


def probe_compiled_flex(device: torch.device, page_size: int = 16) -> str | None:
    """Compile and run a tiny flex_attention call on `device` (seconds on a CPU): None if it
    works, else why not. The static checks of `flex_unavailable_reason` first."""
    reason = flex_unavailable_reason(device, page_size)
    if reason is not None:
        return reason
    try:
        # three buffers: inductor's CPU flex lowering of torch 2.11 refuses q, k, v in one
        q, k, v = (torch.randn(1, 1, 16, 16, device=device) for _ in range(3))
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        out = compiled(q, k, v, kernel_options=flex_kernel_options(device, page_size))
        if not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5):
            return "compiled flex_attention gave wrong numbers"
    except Exception as e:  # noqa: BLE001 - the reason is the report
        return f"compiling flex_attention failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def choose_kernel(kernel: str, device: torch.device, page_size: int | None = None, *,
                  head_dim: int | None = None, dtype: torch.dtype | None = None,
                  score_mod: Callable | None = None) -> str:
    """The kernel to run: `kernel` itself (checked), or for "auto" the first that serves the model
    here: cpp (needs `head_dim` and `dtype`; no score_mod), flex, gather (announced). ValueError
    for a kernel that cannot serve the model (cpp without its requirements, gather with a
    score_mod: only flex applies one)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}")
    cpp_reason = None
    if kernel in ("auto", "cpp"):
        cpp_reason = "it cannot apply a score_mod" if score_mod is not None else (
            cpu_kernel.unavailable_reason(device, dtype, head_dim, page_size or 16)
            if head_dim is not None and dtype is not None else "no head_dim / dtype given")
    if kernel == "cpp" and cpp_reason is not None:
        raise ValueError(f"kernel='cpp' cannot serve this model: {cpp_reason}")
    if kernel == "auto":
        if cpp_reason is None:
            return "cpp"
        reason = flex_unavailable_reason(device, page_size)
        if reason is None:
            return "flex"
        if score_mod is None:
            warnings.warn(f"fms_paged: paged attention falls back to GATHER + SDPA: {reason}", stacklevel=3)
        kernel = "gather"
    if kernel == "gather" and score_mod is not None:
        why = flex_unavailable_reason(device, page_size)
        raise ValueError("a score_mod needs the flex kernel: GATHER + SDPA cannot apply it"
                         + (f" (flex is unavailable here: {why})" if why else ""))
    return kernel
