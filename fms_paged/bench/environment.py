"""Where a benchmark ran: device, versions, git sha, CPU model, threads; memory bandwidth; timing sync.

Every figure a benchmark reports is tied to this record (written into its JSON), and the roofline
(`decode_roofline_ms`) uses the bandwidth measured in the same run, not a datasheet number.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    """Wait for queued device work so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        sha = out.stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "device_name": cpu_model(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_sha": git_sha(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def auto_scale(device: torch.device, scale: float | None) -> tuple[float, str]:
    """-> (scale, why). Full lengths on CUDA; small on CPU/MPS so `make bench-*` fits ~10 min."""
    if scale is not None:
        return float(scale), "given with --scale"
    if device.type == "cuda":
        return 1.0, "auto: CUDA device, full lengths"
    if device.type == "mps":
        return 0.25, "auto: MPS device"
    return 0.125, f"auto: CPU with {os.cpu_count()} cores"


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (device-synchronized), after one warm-up call."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Device memory bandwidth in GB/s from a large tensor copy (read + write = 2 * nbytes moved);
    the best of `repeats` after one warm-up copy."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device, repeats) / 1e9


def measure_read_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the best of `repeats` `sum`s over a tensor of `nbytes` (larger
    than the caches), after one warm-up."""
    x = torch.ones(nbytes // 4, device=device)
    return nbytes / _best_seconds(x.sum, device, repeats) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.nbytes
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers: 2 * nlayers * kvheads * head_dim * dtype_bytes."""
    return 2 * config.nlayers * config.kvheads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def decode_roofline_ms(model: torch.nn.Module, kv_tokens_read: int, bandwidth_gbs: float) -> float:
    """Lower bound of one decode step: read every weight once plus the K/V of `kv_tokens_read`
    cached tokens, at the measured bandwidth."""
    nbytes = weight_bytes(model) + kv_tokens_read * kv_bytes_per_token(model.config, model.dtype)
    return nbytes / (bandwidth_gbs * 1e9) * 1e3
