"""Optional Weights & Biases logging of a benchmark run: config, metrics, tables and plots.

wandb is imported lazily and never required. With no API key configured (no WANDB_API_KEY and no
~/.netrc entry) the run is offline (`WANDB_MODE=offline`) with its directory under the results folder.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from fms_paged.bench.report import scenario_rows


class WandbUnavailable(RuntimeError):
    pass


def require_wandb():
    try:
        import wandb
    except ImportError:
        raise WandbUnavailable(
            "--wandb was given but the `wandb` package is not installed; "
            "`pip install wandb` (or `pip install -e '.[bench]'`), or drop --wandb"
        ) from None
    return wandb


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics as "scenario/backend/metric" (+ compare, decode and perplexity figures)."""
    m: dict[str, float] = {}
    for r in scenario_rows(results):
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                m[f"{r['scenario']}/{r['attn_impl']}/{k}"] = float(v)
    for name, c in results.get("compare", {}).items():
        for k, v in c.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                m[f"{name}/paged_over_dense/{k}"] = float(v)
    for d in results.get("decode", []):
        key = f"decode/{d.get('mode', 'eager')}/{d['case']}/{d['context']}"
        for k in ("dense_ms", "paged_ms", "ratio_paged_dense", "paged_meta_share", "paged_mask_share"):
            if d.get(k) is not None:
                m[f"{key}/{k}"] = float(d[k])
    for impl, p in results.get("perplexity", {}).get("by_backend", {}).items():
        m[f"perplexity/{impl}/ppl"] = float(p["ppl"])
    if results.get("bandwidth_gbs"):
        m["bandwidth_gbs"] = float(results["bandwidth_gbs"])
    return m


def log_run(
    results: dict[str, Any], out: Path, project: str = "fms-paged-bench", name: str | None = None
) -> dict[str, Any]:
    """Log to wandb; -> {"mode", "dir", "run_dir", "metrics_logged"}."""
    wandb = require_wandb()
    mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
    wdir = Path(out) / "wandb_runs"
    wdir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        name=name,
        dir=str(wdir),
        mode=mode,
        config=results.get("config"),
        reinit="finish_previous",
    )
    metrics = flat_metrics(results)
    run.log(metrics)
    for k, v in metrics.items():
        run.summary[k] = v
    rows = scenario_rows(results)
    if rows:
        run.log({"scenarios": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])})
    images = {
        Path(p).stem: wandb.Image(str(p)) for k, p in results.get("files", {}).items() if k.startswith("plot")
    }
    if images:
        run.log(images)
    run_dir = getattr(run, "dir", None)
    run.finish()
    return {
        "mode": mode,
        "dir": str(wdir),
        "run_dir": str(Path(run_dir).parent) if run_dir else None,
        "metrics_logged": len(metrics),
    }


def read_offline_history(run_dir: str | Path) -> dict[str, Any]:
    """Logged history values {key: value} of an offline run, read back from its `*.wandb` file (a
    LevelDB-style log of protobuf records: 7-byte file header, 32 KiB blocks, records with a
    crc32/length/type header, FULL=1 or FIRST/MIDDLE/LAST=2/3/4 fragments)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("*.wandb")
    buf, block, pos = path.read_bytes(), 32768, 7
    records, cur = [], b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        data, pos = buf[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:
            break
        if kind == 1:
            records.append(data)
        elif kind == 2:
            cur = data
        elif kind == 3:
            cur += data
        elif kind == 4:
            records.append(cur + data)
    history: dict[str, Any] = {}
    for data in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                history[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history
