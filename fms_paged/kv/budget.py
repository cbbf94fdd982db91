"""How many KV pages fit on a device: free memory minus weights and headroom, per page bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class MemoryBudget:
    device: str
    available_bytes: int  # free memory the budget starts from
    weight_bytes: int
    reserve_bytes: int  # headroom for activations, workspace, allocator slack
    page_bytes: int  # K + V of one page across all layers
    num_pages: int  # pages that fit (>= 0)
    tokens: int  # num_pages * page_size

    def as_dict(self) -> dict:
        return asdict(self)


def page_bytes(nlayers: int, kvheads: int, head_dim: int, page_size: int,
               dtype: torch.dtype) -> int:
    """Bytes of one page: K and V, every layer."""
    return 2 * nlayers * kvheads * head_dim * page_size * torch.empty(0, dtype=dtype).element_size()


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


def memory_budget(model: torch.nn.Module, fraction: float = 0.9, reserve_bytes: int | None = None,
                  weights_loaded: bool = True) -> MemoryBudget:
    """Pages of `model.config.page_size` that fit in `fraction` of free memory after a reserve.

    `weights_loaded=True` means the model already sits on the device (its bytes are already out
    of the free figure); otherwise they are subtracted too.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    c = model.config
    device = model.device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if reserve_bytes is None:  # activations of a large prefill: ~ a few hundred MB at most here
        reserve_bytes = max(256 << 20, weights // 10)
    free = free_memory_bytes(device)
    usable = int(free * fraction) - reserve_bytes - (0 if weights_loaded else weights)
    per_page = page_bytes(c.nlayers, c.kvheads, c.head_dim, c.page_size, model.dtype)
    n = max(0, usable // per_page)
    return MemoryBudget(str(device), free, weights, reserve_bytes, per_page, n, n * c.page_size)
