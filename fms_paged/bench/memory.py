"""Memory figures: KV bytes held vs the theoretical minimum ("KV waste"), and peak memory per backend.

    python -m fms_paged.bench.memory '<json config>'   # one configuration in a fresh process (CPU)

Peak memory: CUDA `torch.cuda.max_memory_allocated` (in process, stats reset first); MPS
`torch.mps.driver_allocated_memory` after the run; CPU peak RSS (`ru_maxrss`) of a fresh subprocess
per configuration, read before loading, after loading and after running, so one configuration's
allocations never hide another's. On CPU the peak also holds whatever compiling the paged kernel took.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fms_paged.bench.environment import kv_bytes_per_token


def min_pages(lengths: Sequence[int], page_size: int) -> int:
    """Pages needed to hold sequences of `lengths` tokens without sharing."""
    return int(sum(-(-int(n) // page_size) for n in lengths))


def kv_accounting(cache, lengths: Sequence[int], config, dtype: torch.dtype) -> dict[str, Any]:
    """KV bytes held for the live sequences vs the bytes of K and V of the tokens actually stored
    (2 * nlayers * kvheads * head_dim * dtype_bytes * sum(lengths)).

    Paged: held = distinct pages referenced by the device page table (entry 0 is the null page) *
    page_size slots. Dense: held = the preallocated rows of the batch (B * max_seq_len slots).
    `kv_pool_bytes` is the whole preallocated buffer (pool or rows) whatever is in use.
    """
    per_token = kv_bytes_per_token(config, dtype)
    stored = int(sum(int(n) for n in lengths))
    out: dict[str, Any] = {
        "bytes_per_token": per_token,
        "tokens_stored": stored,
        "kv_bytes_needed": per_token * stored,
        "kv_pool_bytes": int(cache.kv_bytes),
    }
    if hasattr(cache, "pm"):
        table = cache.pm.page_table  # [max_seqs, max_pages] int32, 0 = unused (null page)
        pages = int(torch.unique(table[table > 0]).numel())
        out.update(
            pages_held=pages,
            page_size=cache.pm.page_size,
            slots_held=pages * cache.pm.page_size,
            pool_pages=cache.pm.num_pages,
        )
    else:
        rows, max_len = len(lengths), cache.cache.max_seq_len
        out.update(rows_held=rows, slots_held=rows * max_len)
    out["kv_bytes_held"] = out["slots_held"] * per_token
    held = out["kv_bytes_held"]
    out["kv_waste_pct"] = 100.0 * (held - out["kv_bytes_needed"]) / held if held else 0.0
    return out


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def measure_in_process(config: dict[str, Any]) -> dict[str, Any]:
    """Load the model, run the configuration's scenario, report memory (the body of the subprocess)."""
    from fms_paged.bench.latency import load_model, run_scenario

    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    before = _maxrss_bytes()
    model = load_model(config["model"], config["attn_impl"])
    device = model.device
    after_load = _maxrss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    res = run_scenario(
        model, config["attn_impl"], config["plan"], kernel=config.get("kernel", "auto"), warmup=0
    )
    out: dict[str, Any] = {
        "backend": device.type,
        "rss_before_load_bytes": before,
        "rss_after_load_bytes": after_load,
        "rss_after_run_bytes": _maxrss_bytes(),
        "kv": res["kv"],
        "kernel": res["kernel"],
    }
    if device.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["run_peak_bytes"] = out["peak_bytes"] - base
    elif device.type == "mps":
        out["peak_bytes"] = torch.mps.driver_allocated_memory()
        out["run_peak_bytes"] = out["peak_bytes"]
    else:
        out["peak_bytes"] = out["rss_after_run_bytes"]
        out["run_peak_bytes"] = out["rss_after_run_bytes"] - after_load
    return out


def measure_peak(config: dict[str, Any], device: torch.device, timeout: float = 900) -> dict[str, Any]:
    """Peak memory of one configuration: a fresh subprocess on CPU, in this process elsewhere.
    Failures are returned as {"error": ...} rather than raised."""
    if device.type != "cpu":
        try:
            return measure_in_process(config)
        except Exception as e:  # report, don't abort the whole benchmark
            return {"error": f"{type(e).__name__}: {e}"}
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TQDM_DISABLE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "fms_paged.bench.memory", json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"subprocess exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fms_paged.bench.memory '<json config>'", file=sys.stderr)
        return 2
    print(json.dumps(measure_in_process(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
