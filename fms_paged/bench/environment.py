"""Where a benchmark ran (device, versions, git sha, CPU model, threads) and what it measures with:
timing sync, read bandwidth, the bytes of weights and K/V, and memory: the KV bytes a backend holds
against those its tokens need, and a run's peak over what was in use when it started (`peak_meter`):
on CUDA `max_memory_allocated` after `reset_peak_memory_stats`; on a Linux CPU the peak resident set
(VmHWM) after resetting it through `/proc/self/clear_refs` (`ru_maxrss` cannot serve: a child of
fork + exec inherits its parent's peak, and a process keeps its own from loading the model).
Elsewhere (MPS, other OSes) the peak is not measured.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fms_paged.kv.geometry import pages_for
from fms_paged.kv.quant import bytes_per_value
from fms_paged.modules.quantized import QuantizedLinear

REPO_ROOT = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    """Wait for queued device work so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def environment_info(device: torch.device) -> dict[str, Any]:
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip()
        sha = git("rev-parse", "HEAD")
        dirty = sha and git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        sha = dirty = ""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    cpu, cuda = names[0] if names else platform.processor() or platform.machine(), device.type == "cuda"
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else cpu,
            "cpu_model": cpu, "torch": torch.__version__, "python": sys.version.split()[0],
            "cuda": torch.version.cuda if cuda else None, "platform": platform.platform(),
            "git_sha": (sha + ("-dirty" if dirty else "")) or None, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def measure_read_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: the fastest of `repeats` `sum`s over `nbytes` (larger than the
    caches), after one warm-up."""
    x, times = torch.ones(nbytes // 4, device=device), []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times[1:]) / 1e9


def time_calls(fn: Callable[[], Any], device: torch.device, calls: int = 20, repeats: int = 5) -> float:
    """Seconds one call of `fn` takes on `device`: the fastest of `repeats` runs of `calls` calls
    after a warm-up call; on CUDA the calls are replayed from one CUDA graph, so the host's launch
    cost is not counted."""
    fn()
    sync(device)

    def run():
        for _ in range(calls):
            fn()

    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best / calls


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied weights counted once) and of quantized weights (the
    buffers of `fms_paged.modules.quantized.QuantizedLinear`: packed weights, scales, zero points)."""
    tensors = [*model.parameters()]
    tensors += [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()]
    return sum({t.data_ptr(): t.nbytes for t in tensors}.values())


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token over all layers: 2 * nlayers * kvheads * head_dim * dtype bytes."""
    return 2 * config.nlayers * config.kvheads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def min_pages(lengths: Sequence[int], page_size: int) -> int:
    """Pages needed to hold sequences of `lengths` tokens without sharing."""
    return int(sum(pages_for(int(n), page_size) for n in lengths))


def kv_accounting(cache, lengths: Sequence[int], config, dtype: torch.dtype,
                  windows: Sequence[int | None] | None = None) -> dict[str, Any]:
    """KV bytes held for the live sequences against the bytes of K and V the next token needs:
    every token's on each layer, or on a layer with a sliding window (`windows`: each layer's,
    None for a full one) the last `window` tokens'. Held: paged, the distinct pages of the page
    table; dense, the preallocated rows (B * max_seq_len); no cache, nothing. `kv_pool_bytes`: the
    whole preallocated buffer, whatever is in use. 8-bit pages count their values and scales.
    """
    per_token, stored = kv_bytes_per_token(config, dtype), int(sum(int(n) for n in lengths))
    backend = getattr(cache, "backend", cache)
    if getattr(backend, "kv_cache_dtype", "auto") != "auto":  # 8-bit pages: values and their scales
        value = bytes_per_value(backend.kv_cache_dtype, dtype, config.head_dim)
        per_token = round(2 * config.nlayers * config.kvheads * config.head_dim * value)
    windows = list(windows) if windows is not None else [None] * config.nlayers
    per_layer = per_token // len(windows)
    needed = sum(per_layer * sum(int(n) if w is None else min(int(n), w) for n in lengths) for w in windows)
    out: dict[str, Any] = {"bytes_per_token": per_token, "tokens_stored": stored,
                           "kv_bytes_needed": needed, "kv_pool_bytes": int(cache.kv_bytes)}
    if hasattr(cache, "pm"):
        # [slices * max_seqs, max_pages] int32, 0 = unused (null page): a page holds one slice of
        # layers (`fms_paged.kv.groups`; every layer when the model's layers keep one history)
        table, groups = cache.pm.page_table, backend.groups
        pages = int(torch.unique(table[table > 0]).numel())
        P, u = cache.pm.page_size, groups.layers_per_slice
        out.update(pages_held=pages, page_size=P, slots_held=pages * P, pool_pages=cache.pm.num_pages)
        held = out["kv_bytes_held"] = pages * P * per_layer * u
        out["by_group"] = kv_by_group(table, groups, cache.pm.max_seqs, lengths, P, per_layer)
    else:  # dense rows, or none (no cache)
        rows = len(lengths) if hasattr(cache, "cache") else 0
        out.update(rows_held=rows, slots_held=rows and rows * cache.cache.max_seq_len)
        held = out["kv_bytes_held"] = out["slots_held"] * per_token
    out["kv_waste_pct"] = 100.0 * (held - out["kv_bytes_needed"]) / held if held else 0.0
    return out


def kv_by_group(table: torch.Tensor, groups, max_seqs: int, lengths: Sequence[int], page_size: int,
                per_layer: int) -> list[dict[str, Any]]:
    """Per layer group (full, or one window): its layers, the KV bytes its pages hold (the distinct
    pages of its slices' page-table rows) and the bytes the next token needs (every token's, or the
    window's)."""
    rows = []
    for w in dict.fromkeys(groups.windows):
        slices = [g for g, gw in enumerate(groups.windows) if gw == w]
        part = (torch.cat([table[g * max_seqs : (g + 1) * max_seqs] for g in slices]) if groups.grouped
                else table)
        layers = len(slices) * groups.layers_per_slice
        held = int(torch.unique(part[part > 0]).numel()) * page_size * per_layer * groups.layers_per_slice
        need = per_layer * layers * sum(int(n) if w is None else min(int(n), w) for n in lengths)
        rows.append({"window": w, "layers": layers, "kv_bytes_held": held, "kv_bytes_needed": need,
                     "held_over_needed": held / need if need else None})
    return rows


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def peak_meter(device: torch.device):
    """-> (start, peak): `start()` resets the peak and returns the bytes in use, `peak()` the peak
    since; or None where this device has no such counter."""
    if device.type == "cuda":
        return (lambda: torch.cuda.reset_peak_memory_stats(device) or torch.cuda.memory_allocated(device),
                lambda: torch.cuda.max_memory_allocated(device))

    def start() -> int:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set (VmHWM)
        return _status_bytes("VmRSS")

    try:
        return (start, lambda: _status_bytes("VmHWM")) if device.type == "cpu" and start() else None
    except (OSError, KeyError):
        return None
