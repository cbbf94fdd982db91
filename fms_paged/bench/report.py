"""Writing a benchmark run: JSON (everything), CSV (one row per scenario x backend), markdown tables
(printed to the terminal and saved) and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

MiB = 2**20


def _num(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt) if isinstance(x, (int, float)) else str(x)


def _quartiles(q: list[float] | None) -> str:
    return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})" if q else "-"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def scenario_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat rows (CSV / wandb table): one per scenario x backend."""
    rows = []
    for name, by_impl in results.get("scenarios", {}).items():
        for impl, r in by_impl.items():
            mem = results.get("memory", {}).get(name, {}).get(impl, {})
            rows.append(
                {
                    "scenario": name,
                    "attn_impl": impl,
                    "kernel": r["kernel"],
                    "batch": r["batch"],
                    "tokens_stored": r["kv"]["tokens_stored"],
                    "ttft_ms": r["ttft_ms"],
                    "per_token_mean_ms": r["per_token"]["mean_ms"],
                    "per_token_p50_ms": r["per_token"]["p50_ms"],
                    "per_token_p90_ms": r["per_token"]["p90_ms"],
                    "tokens_generated": r["tokens_generated"],
                    "tokens_per_s": r["tokens_per_s"],
                    "decode_tokens_per_s": r["decode_tokens_per_s"],
                    "decode_vs_roofline": r.get("decode_vs_roofline"),
                    "kv_bytes_needed": r["kv"]["kv_bytes_needed"],
                    "kv_bytes_held": r["kv"]["kv_bytes_held"],
                    "kv_pool_bytes": r["kv"]["kv_pool_bytes"],
                    "kv_waste_pct": r["kv"]["kv_waste_pct"],
                    "peak_bytes": mem.get("peak_bytes"),
                    "run_peak_bytes": mem.get("run_peak_bytes"),
                }
            )
    return rows


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    parts = [
        f"## fms_paged benchmark `{cfg.get('name')}` — {env['device']} ({env['cpu_model']}, "
        f"{env['threads']} threads), torch {env['torch']}, scale {cfg['scale']} ({cfg['scale_reason']}), "
        f"model {results['model']['source']}, bandwidth {_num(results.get('bandwidth_gbs'), '.1f')} GB/s"
    ]
    rows = scenario_rows(results)
    if rows:
        parts.append(
            _table(
                [
                    "scenario",
                    "backend",
                    "kernel",
                    "B",
                    "tokens",
                    "TTFT ms",
                    "tok ms mean",
                    "p50",
                    "p90",
                    "tok/s",
                    "x roofline",
                    "KV held MiB",
                    "KV needed MiB",
                    "KV waste %",
                    "pool MiB",
                    "peak MiB",
                ],
                [
                    [
                        r["scenario"],
                        r["attn_impl"],
                        r["kernel"],
                        str(r["batch"]),
                        str(r["tokens_stored"]),
                        _num(r["ttft_ms"]),
                        _num(r["per_token_mean_ms"]),
                        _num(r["per_token_p50_ms"]),
                        _num(r["per_token_p90_ms"]),
                        _num(r["tokens_per_s"], ".1f"),
                        _num(r["decode_vs_roofline"], ".1f"),
                        _num(r["kv_bytes_held"] / MiB),
                        _num(r["kv_bytes_needed"] / MiB),
                        _num(r["kv_waste_pct"], ".1f"),
                        _num(r["kv_pool_bytes"] / MiB),
                        _num(r["peak_bytes"] / MiB if r["peak_bytes"] else None, ".0f"),
                    ]
                    for r in rows
                ],
            )
        )
    if results.get("compare"):
        parts.append("### paged / dense (same run)")
        parts.append(
            _table(
                [
                    "scenario",
                    "TTFT",
                    "per-token",
                    "tok/s",
                    "KV held",
                    "KV pool",
                    "peak mem",
                    "run peak",
                    "same tokens",
                ],
                [
                    [
                        n,
                        _num(c.get("ttft")),
                        _num(c.get("per_token")),
                        _num(c.get("tokens_per_s")),
                        _num(c.get("kv_held")),
                        _num(c.get("kv_pool")),
                        _num(c.get("peak_bytes")),
                        _num(c.get("run_peak_bytes")),
                        str(c.get("outputs_match")),
                    ]
                    for n, c in results["compare"].items()
                ],
            )
        )
    if results.get("decode"):
        parts.append("### decode ms/step, dense vs paged (median)")
        parts.append(
            _table(
                [
                    "mode",
                    "context",
                    "case",
                    "B",
                    "dense ms",
                    "paged ms",
                    "paged/dense",
                    "paired step ratio: median (p25-p75)",
                    "paged step meta %",
                    "BlockMask build % (eager)",
                    "kernel",
                ],
                [
                    [
                        d.get("mode", "eager"),
                        str(d["context"]),
                        d["case"],
                        str(d["batch"]),
                        _num(d["dense_ms"]),
                        _num(d["paged_ms"]),
                        _num(d["ratio_paged_dense"]),
                        _quartiles(d.get("ratio_quartiles")),
                        _num(100 * d["paged_meta_share"], ".1f"),
                        _num(
                            100 * d["paged_mask_share"] if d["paged_mask_share"] is not None else None, ".1f"
                        ),
                        d["kernel"],
                    ]
                    for d in results["decode"]
                ],
            )
        )
    if results.get("perplexity"):
        p = results["perplexity"]
        parts.append(f"### perplexity ({p['text']}, {p['tokens']} tokens, window {p['window']})")
        parts.append(
            _table(
                ["backend", "ppl", "nll", "rel. diff vs no-cache"],
                [
                    [
                        k,
                        _num(v["ppl"], ".4f"),
                        _num(v["nll"], ".6f"),
                        _num(v.get("rel_diff_vs_reference"), ".2e"),
                    ]
                    for k, v in p["by_backend"].items()
                ],
            )
        )
    if results.get("peers"):
        prow = []
        for peer, by in results["peers"].items():
            if not isinstance(by, dict):
                continue
            if peer == "torch_paged_attention" or "error" in by and len(by) == 1:
                prow.append([peer, "-", json.dumps({k: v for k, v in by.items() if k != "lengths"})[:160]])
                continue
            for sc, r in by.items():
                detail = (
                    r.get("error")
                    or r.get("status")
                    or (
                        f"TTFT {_num(r.get('ttft_ms'))} ms, tok {_num(r.get('per_token_mean_ms'))} ms, "
                        f"{_num(r.get('tokens_per_s'), '.1f')} tok/s, "
                        f"same tokens as ours: {r.get('same_as_ours')}"
                    )
                )
                prow.append([peer, sc, detail])
        parts.append("### peers (same weights, same run)")
        parts.append(_table(["peer", "scenario", "result"], prow))
    return "\n\n".join(parts) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """latency_vs_length.png, memory_vs_length.png, kv_held_vs_needed.png (those with data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    scen = results.get("scenarios", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for impl in ("sdpa", "paged"):
        chat = scen.get("chat", {}).get(impl)
        if chat and chat["turns"]:
            ax.plot(
                [t["context"] for t in chat["turns"]],
                [t["mean_ms"] for t in chat["turns"]],
                "o-",
                label=f"{impl}: chat turns (B=1)",
            )
            drew = True
        for mode in ("eager", "compiled"):
            for case in ("single", "mixed"):
                pts = [
                    (d["context"], d["dense_ms" if impl == "sdpa" else "paged_ms"])
                    for d in results.get("decode", [])
                    if d["case"] == case and d.get("mode", "eager") == mode
                ]
                if pts:
                    style = "s--" if mode == "eager" else "^:"
                    ax.plot(*zip(*pts), style, label=f"{impl}: decode bench, {case}, {mode}")
                    drew = True
    if drew:
        ax.set(
            xlabel="context length (tokens)", ylabel="decode ms / step", title="Latency vs sequence length"
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "latency_vs_length.png")
        fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    mem = results.get("memory", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for impl in ("sdpa", "paged"):
        chat = scen.get("chat", {}).get(impl)
        if chat and chat["turns"] and "kv_bytes_held" in chat["turns"][0]:
            ax.plot(
                [t["context"] for t in chat["turns"]],
                [t["kv_bytes_held"] / MiB for t in chat["turns"]],
                "o-",
                label=f"{impl}: KV held (chat)",
            )
            drew = True
        pts = sorted(
            (scen[n][impl]["kv"]["tokens_stored"], mem[n][impl]["run_peak_bytes"] / MiB)
            for n in mem
            if impl in mem[n] and "run_peak_bytes" in mem[n][impl] and impl in scen.get(n, {})
        )
        if pts:
            ax.plot(*zip(*pts), "s--", label=f"{impl}: peak memory of the run (per scenario)")
            drew = True
    if drew:
        ax.set(xlabel="tokens stored (sum over the batch)", ylabel="MiB", title="Memory vs sequence length")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "memory_vs_length.png")
        fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if scen:
        names = list(scen)
        fig, ax = plt.subplots(figsize=(6, 4))
        w = 0.25
        for i, (label, get) in enumerate(
            [
                ("needed (K/V of stored tokens)", lambda r: r["kv"]["kv_bytes_needed"]),
                ("dense held", lambda r: r["kv"]["kv_bytes_held"] if r["attn_impl"] == "sdpa" else None),
                ("paged held", lambda r: r["kv"]["kv_bytes_held"] if r["attn_impl"] == "paged" else None),
            ]
        ):
            vals = []
            for n in names:
                v = [get(r) for r in scen[n].values() if get(r) is not None]
                vals.append(v[0] / MiB if v else 0)
            ax.bar([j + (i - 1) * w for j in range(len(names))], vals, w, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel="MiB", title="KV held vs needed")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "kv_held_vs_needed.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write_all(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """-> paths written: json, csv (if scenarios), md, and the plots."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["md"].write_text(markdown(results))
    rows = scenario_rows(results)
    if rows:
        paths["csv"] = out / "results.csv"
        with paths["csv"].open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    for i, p in enumerate(plots(results, out)):
        paths[f"plot{i}"] = p
    results["files"] = {k: str(v) for k, v in paths.items()}
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    return paths
