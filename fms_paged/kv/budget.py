"""How many KV pages fit on a device (`kv_cache_budget`, the engine's pool and `fms-paged info`),
sized the way vLLM does: a fraction of the device's free memory after the weights and a measured
activation peak (CUDA, MPS), or on the CPU a KV space of its own.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from fms_paged.kv.kernels import flex_max_pages
from fms_paged.kv.paged import model_groups
from fms_paged.kv.quant import bytes_per_value
from fms_paged.modules.linear import unpacked_bytes


def page_bytes(nlayers: int, kvheads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page: K and V of `nlayers` layers (a page holds one slice of layers:
    `fms_paged.kv.groups`; every layer when the model's layers keep one history), 8-bit pages'
    scales included."""
    per_value = bytes_per_value(kv_cache_dtype, dtype, head_dim)
    return round(2 * nlayers * kvheads * head_dim * page_size * per_value)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV pool would live (CUDA: mem_get_info; MPS: recommended working set
    minus driver-allocated; CPU: MemAvailable of the host)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot determine free host memory (install psutil)")


CPU_KV_SPACE_ENV = "FMS_PAGED_CPU_KV_SPACE"  # GiB of host memory for the CPU page pool
DEFAULT_CPU_KV_SPACE = 4 << 30  # as vLLM's CPU backend; at most half of the available RAM
DEFAULT_KV_MEMORY_FRACTION = 0.9  # CUDA / MPS: of the free memory after weights and activations
GiB = 1 << 30


class KVBudgetError(ValueError):
    """The KV budget cannot hold one sequence of the maximum length; the message says how much
    memory there is, how much is needed, and which setting would work."""


@dataclass
class KVCacheBudget:
    device: str
    source: str  # where the KV figure came from (setting, fraction of what)
    kv_bytes: int  # memory given to the page pool
    activation_bytes: int  # measured peak of a forward at max_num_batched_tokens (0 on the CPU)
    page_bytes: int
    num_pages: int  # pages of the pool, the null page included

    def as_dict(self) -> dict:
        return asdict(self)


def _gib(n: float) -> str:
    return f"{n / GiB:.3g} GiB"


@torch.inference_mode()
def activation_peak_bytes(model: torch.nn.Module, num_tokens: int) -> int:
    """Peak memory a forward over `num_tokens` tokens adds to the device (vLLM's profiling run):
    CUDA from the allocator's peak, MPS from the driver's allocation after the run; 0 elsewhere."""
    dev = model.device
    tokens = torch.zeros(1, num_tokens, dtype=torch.long, device=dev)
    last = torch.tensor([num_tokens - 1], device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        model(tokens, logits_at=last)
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - before)
    if dev.type == "mps":
        before = torch.mps.driver_allocated_memory()
        model(tokens, logits_at=last)
        torch.mps.synchronize()
        return max(0, int(torch.mps.driver_allocated_memory() - before))
    return 0


def kv_cache_budget(model: torch.nn.Module, max_num_batched_tokens: int, max_model_len: int,
                    kv_memory_fraction: float | None = None,
                    kv_cache_dtype: str | None = None) -> KVCacheBudget:
    """Pages for the engine's pool. CUDA / MPS: `kv_memory_fraction` (default 0.9) of the free
    memory (weights already loaded) minus the activation peak of a forward at
    `max_num_batched_tokens`, on CUDA at most `flex_max_pages` (a layer's pool under 2**31
    elements, which Triton's flex kernels need; reached by small models alone). CPU:
    `$FMS_PAGED_CPU_KV_SPACE` GiB if set, else `kv_memory_fraction` of the available RAM if given,
    else 4 GiB (at most half the available RAM), the available RAM counted less the packed weight
    copies still to be made; the pool is allocated untouched, so RAM is used only as pages are.
    Raises KVBudgetError if one sequence of `max_model_len` tokens does not fit (with every layer
    windowed: the pages it holds at once; `LayerGroups.min_pool_pages`). A page's bytes follow
    `kv_cache_dtype` (None: the model config's)."""
    if kv_memory_fraction is not None and not (
        isinstance(kv_memory_fraction, (int, float)) and 0 < kv_memory_fraction <= 1
    ):
        raise ValueError(f"kv_memory_fraction={kv_memory_fraction!r}; expected a float in (0, 1]")
    c, dev = model.config, model.device
    kv_cache_dtype = getattr(c, "kv_cache_dtype", "auto") if kv_cache_dtype is None else kv_cache_dtype
    groups = model_groups(model)
    per_page = page_bytes(groups.layers_per_slice, c.kvheads, c.head_dim, c.page_size, model.dtype,
                          kv_cache_dtype)
    activation = 0
    if dev.type == "cpu":
        # less the packed copies of the projection weights still to be made (`modules.linear`)
        free = free_memory_bytes(dev) - unpacked_bytes(model)
        env = os.environ.get(CPU_KV_SPACE_ENV)
        if env:
            try:
                kv = int(float(env) * GiB)
            except ValueError:
                raise ValueError(f"{CPU_KV_SPACE_ENV}={env!r}; expected a number of GiB") from None
            source = f"{CPU_KV_SPACE_ENV}={env}"
        elif kv_memory_fraction is not None:
            kv = int(free * kv_memory_fraction)
            source = f"kv_memory_fraction={kv_memory_fraction} of {_gib(free)} available RAM"
        else:
            kv = min(DEFAULT_CPU_KV_SPACE, free // 2)
            source = f"default CPU KV space (4 GiB, at most half of {_gib(free)} available RAM)"
    else:
        fraction = kv_memory_fraction or DEFAULT_KV_MEMORY_FRACTION
        activation = activation_peak_bytes(model, max_num_batched_tokens)
        free = free_memory_bytes(dev)
        kv = int(free * fraction) - activation
        source = (f"kv_memory_fraction={fraction} of {_gib(free)} free on {dev} after the weights, "
                  f"less a {_gib(activation)} activation peak")
    num_pages = max(0, kv // per_page)
    most = flex_max_pages(c.kvheads, c.head_dim, c.page_size)
    if dev.type == "cuda" and num_pages > most:
        num_pages = most  # Triton's flex kernels address a layer's pool in 32 bits
        source += f", capped at {most} pages (a layer's pool under 2**31 elements for Triton)"
    # one sequence at its most pages at once (in a sliding group: its step and window) + the null page
    need_pages = groups.min_pool_pages(max_model_len, c.page_size, max_num_batched_tokens)
    if num_pages < need_pages:
        need = need_pages * per_page
        fix = (f"set {CPU_KV_SPACE_ENV}={math.ceil(need / GiB * 100) / 100} (GiB)" if dev.type == "cpu"
               else f"raise kv_memory_fraction (now {kv_memory_fraction or DEFAULT_KV_MEMORY_FRACTION})")
        fits = groups.capacity(num_pages, c.page_size, max_num_batched_tokens, max_model_len)
        raise KVBudgetError(
            f"KV cache budget too small on {dev}: {_gib(max(kv, 0))} available for KV pages "
            f"({source}), but one sequence of max_model_len={max_model_len} tokens needs "
            f"{_gib(need)} ({need_pages} pages of {c.page_size} tokens x {per_page} bytes, the null "
            f"page included). To fix: {fix}, or pass num_pages>={need_pages}, or "
            f"max_model_len<={fits}."
        )
    return KVCacheBudget(str(dev), source, int(kv), activation, per_page, int(num_pages))
