"""The report writer of every benchmark target: results.json (everything), results.csv (one row per
run), results.md (markdown, also printed) and PNG plots (matplotlib, Agg); with `wandb_project` the
rows' numbers and the plots also go to Weights & Biases (offline without an API key, the run under
`<out>/wandb_runs`; wandb is imported only then). A plot: panels {"title", "xlabel", "ylabel",
"logy"?, "series": [{"label", "x", "y", "fmt"? (matplotlib's), "color"?}]}; a panel without series
is left out, a plot without panels not written."""

from __future__ import annotations

import csv
import json
import math
import netrc
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MiB = 2**20


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if not isinstance(x, (int, float)):
        return str(x)
    return format(x / MiB, spec[3:] or ".2f") if spec.startswith("MiB") else format(x, spec)


def table(rows: Iterable[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table, a line per row: `columns` = (header, key, format spec: "MiB..." for bytes)."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k), s) for _, k, s in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot(path: Path, panels: list[dict[str, Any]]) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in panels if p.get("series")]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for s in p["series"]:
            color = {"color": s["color"]} if s.get("color") else {}
            ax.plot(s["x"], s["y"], s.get("fmt", "o-"), label=s["label"], **color)
        ax.set(title=p["title"], xlabel=p["xlabel"], ylabel=p["ylabel"])
        ax.set_yscale("log" if p.get("logy") else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, results: dict[str, Any], *, markdown: str, rows: dict[str, dict[str, Any]],
                 figures: dict[str, list[dict[str, Any]]]) -> dict[str, Path]:
    """Write everything under `out` -> the paths written. `rows`: run name -> flat figures (the CSV,
    and the metrics logged to wandb as "<run>/<figure>" when `results["config"]["wandb"]`);
    `figures`: PNG name -> panels."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["md"].write_text(markdown)
    if rows:
        paths["csv"] = out / "results.csv"
        with paths["csv"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["run", *dict.fromkeys(k for r in rows.values() for k in r)])
            w.writeheader()
            w.writerows({"run": k, **r} for k, r in rows.items())
    for fname, panels in figures.items():
        if (p := plot(out / fname, panels)) is not None:
            paths[fname] = p
    results["files"] = {k: str(v) for k, v in paths.items()}
    if (cfg := results.get("config", {})).get("wandb"):
        pngs = [p for k, p in paths.items() if k.endswith(".png")]
        results["wandb"] = log_wandb(rows, pngs, cfg, out, cfg["wandb_project"], cfg["name"])
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    return paths


def log_wandb(rows, pngs: list[Path], config: dict[str, Any], out: Path, project: str,
              name: str | None) -> dict[str, Any]:
    """Every number of the rows as "<run>/<figure>" (history and summary), and the plots ->
    {"mode", "dir", "run_dir", "metrics_logged"}. Online only with an API key (env or ~/.netrc)."""
    import wandb

    try:
        key = os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        key = None
    mode = os.environ.get("WANDB_MODE") or ("online" if key else "offline")
    wdir = out / "wandb_runs"
    wdir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project, name=name, dir=str(wdir), mode=mode, config=config,
                     reinit="finish_previous")
    metrics = {f"{run_name}/{k}": float(v) for run_name, r in rows.items() for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    run.log({**metrics, **{p.stem: wandb.Image(str(p)) for p in pngs}})
    run.summary.update(metrics)
    run_dir = getattr(run, "dir", None)
    run.finish()
    return {"mode": mode, "dir": str(wdir), "run_dir": str(Path(run_dir).parent) if run_dir else None,
            "metrics_logged": len(metrics)}
