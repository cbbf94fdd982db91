"""`make bench-llama` / `make bench-llama-paged`: latency (the scenarios of `latency`), memory and
perplexity (through each cache and without one) against the sequence length, for no cache, the
dense cache and the paged cache on one model's weights, in one run. Memory: the KV bytes each
backend holds against those its tokens need, and each sweep run again in a fresh process (`python
-m fms_paged.bench.inference < config.json`) for its peak over the loaded model. That process's
glibc hands freed tensors back to the OS at once (`MALLOC_MMAP_THRESHOLD_`), so what one run freed
never hides the next one's peak, and nothing of the timed runs (compiled code, allocator caches)
is counted.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

from fms_paged.bench import latency, perplexity
from fms_paged.bench.environment import REPO_ROOT, peak_meter
from fms_paged.bench.report import MiB, table
from fms_paged.data import DatasetSource

COLORS = {"no-cache": "tab:gray", "sdpa": "tab:blue", "paged": "tab:orange"}
LABELS = {"no-cache": "no cache", "sdpa": "dense cache", "paged": "paged cache"}
PEAK = {"cpu": "peak RSS over the loaded model,\nin a fresh process",
        "cuda": "torch.cuda.max_memory_allocated\nover the loaded model"}


def run(args, model, spec: dict[str, Any], results: dict[str, Any], log=print) -> dict[str, Any]:
    """The whole benchmark as `args` asks, added to `results` (JSON-ready)."""
    t0 = time.perf_counter()
    plans, runs = latency.run_scenarios(model, args, log)
    results.update(plans=plans, runs=runs)
    sweeps = [p for p in plans if "turns" not in p]
    if args.memory and sweeps:
        log(f"[bench] peak memory of {len(sweeps) * len(args.impls)} runs, in a fresh process ...")
        mem = measure_memory({"model": spec, "plans": sweeps, "impls": args.impls, "kernel": args.kernel})
        if isinstance(mem, dict):
            results["memory_error"] = mem["error"]
            log(f"[bench] {mem['error']}")
        else:
            by = {(m["scenario"], m["length"], m["attn_impl"]): m for m in mem}
            for r in runs:
                m = by.get((r["scenario"], r["length"], r["attn_impl"]), {})
                r.update({k: m.get(k) for k in ("run_peak_bytes", "process_peak_bytes")})
    results["compare"] = compare(runs)
    if args.ppl:
        ids, what = perplexity.eval_tokens(model, spec.get("model_path"), args.text_file, args.ppl_chars,
                                           DatasetSource.from_args(args))
        log(f"[bench] perplexity over {len(ids)} tokens ...")
        ppl = perplexity.by_backend(model, args.impls, ids, args.ppl_window, args.kernel)
        results["perplexity"] = {**ppl, "text": what}
    results["elapsed_s"] = time.perf_counter() - t0
    return results


def measure_runs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each plan once on each backend, in this process -> the peak each run adds over the loaded
    model. No cache runs 2 new tokens (its peak: one forward over the whole history)."""
    model = latency.load_model(config["model"], "sdpa")
    meter, kernel, out = peak_meter(model.device), config.get("kernel", "auto"), []
    for impl in config["impls"]:  # first-use costs (kernels loaded, thread pools) stay out
        latency.run_plan(model, impl, latency.shortened(config["plans"][0], 2), warmup=0, kernel=kernel)
    for plan in config["plans"]:
        for impl in config["impls"]:
            gc.collect()
            base = meter[0]() if meter else None
            latency.run_plan(model, impl, dict(plan, new_tokens=2) if impl == "no-cache" else plan,
                             warmup=0, kernel=kernel)
            peak = meter[1]() if meter else None
            out.append({"scenario": plan["name"], "length": plan["length"], "attn_impl": impl,
                        "run_peak_bytes": None if peak is None else max(0, peak - base),
                        "process_peak_bytes": peak})
    return out


def measure_memory(config: dict[str, Any], timeout: float = 1800) -> list[dict[str, Any]] | dict[str, str]:
    """`measure_runs(config)` in a fresh process -> its rows, or {"error": ...} (reported, not
    raised: the rest of the benchmark stands)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "fms_paged.bench.inference"], input=json.dumps(config),
                          capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    if proc.returncode != 0 or not lines:
        return {"error": f"memory subprocess exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each backend against the dense cache on the same plan, measured in the same run; greedy
    tokens compared over what both generated (no cache makes fewer outside chat)."""
    dense = {(r["scenario"], r["length"]): r for r in runs if r["attn_impl"] == "sdpa"}
    _ratio, out = lambda a, b: a / b if a is not None and b else None, []
    for r in sorted(runs, key=_order):
        if (d := dense.get((r["scenario"], r["length"]))) is None or r is d:
            continue
        k = min(len(r["outputs"][0]), len(d["outputs"][0]))
        out.append({
            "scenario": r["scenario"], "length": r["length"], "attn_impl": r["attn_impl"],
            "ttft": _ratio(r["ttft_ms"], d["ttft_ms"]),
            "per_token": _ratio(r["per_token"]["p50_ms"], d["per_token"]["p50_ms"]),
            "kv_held": _ratio(r["kv"]["kv_bytes_held"], d["kv"]["kv_bytes_held"]),
            "run_peak": _ratio(r.get("run_peak_bytes"), d.get("run_peak_bytes")),
            "outputs_match": [o[:k] for o in r["outputs"]] == [o[:k] for o in d["outputs"]],
        })
    return out


def _order(r: dict[str, Any]) -> tuple:
    return latency.SCENARIOS.index(r["scenario"]), r["length"], latency.IMPLS.index(r["attn_impl"])


def rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One flat row per run (CSV, wandb, the markdown table)."""
    return {f"{r['scenario']}@{r['length']}/{r['attn_impl']}": {
        "scenario": r["scenario"], "length": r["length"], "attn_impl": r["attn_impl"], "kernel": r["kernel"],
        "batch": r["batch"], "tokens_stored": r["kv"]["tokens_stored"], "ttft_ms": r["ttft_ms"],
        **{f"per_token_{k}": r["per_token"][k] for k in ("mean_ms", "p50_ms", "p90_ms")},
        "tokens_generated": r["tokens_generated"], "tokens_per_s": r["tokens_per_s"],
        **{k: r["kv"][k] for k in ("kv_bytes_needed", "kv_bytes_held", "kv_pool_bytes", "kv_waste_pct")},
        "run_peak_bytes": r.get("run_peak_bytes"),
    } for r in sorted(results["runs"], key=_order)}


S, L, B = ("scenario", "scenario", ""), ("length", "length", "d"), ("backend", "attn_impl", "")
COLUMNS = [S, L, B, ("kernel", "kernel", ""), ("B", "batch", "d"), ("tokens", "tokens_stored", "d"),
           ("TTFT ms", "ttft_ms", ".1f"), ("ms/token p50", "per_token_p50_ms", ".2f"),
           ("p90", "per_token_p90_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
           ("KV held MiB", "kv_bytes_held", "MiB"), ("KV needed MiB", "kv_bytes_needed", "MiB"),
           ("KV waste %", "kv_waste_pct", ".1f"), ("run peak MiB", "run_peak_bytes", "MiB.1f")]
COMPARE = [S, L, B, *((h, k, ".2f") for h, k in (("TTFT", "ttft"), ("ms/token", "per_token"),
           ("KV held", "kv_held"), ("run peak", "run_peak"))), ("same tokens", "outputs_match", "")]
PPL = [("backend", "backend", ""), ("ppl", "ppl", ".4f"), ("nll", "nll", ".6f"),
       ("rel. diff vs no cache", "rel_diff_vs_reference", ".2e")]


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    parts = [f"## fms_paged benchmark `{cfg['name']}` — {env['device']} ({env['device_name']}, "
             f"{env['threads']} threads), torch {env['torch']}, scale {cfg['scale']} "
             f"({cfg['scale_reason']}), model {results['model']['source']}"]
    if results["runs"]:
        note = PEAK.get(env["device"].split(":")[0], "not measured on this device").replace("\n", " ")
        error = f" Not measured: {results['memory_error'][-300:]}" if results.get("memory_error") else ""
        parts += [table(rows(results).values(), COLUMNS), f"Run peak: {note}.{error}"]
    if results.get("compare"):
        parts += ["### against the dense cache (same run; ms/token at p50)",
                  table(results["compare"], COMPARE)]
    if p := results.get("perplexity"):
        parts += [f"### perplexity ({p['text']}, {p['tokens']} tokens, window {p['window']})",
                  table([dict(v, backend=k) for k, v in p["by_backend"].items()], PPL)]
    return "\n\n".join(parts) + "\n"


def _series(runs, scenario: str, y, impls=None) -> list[dict[str, Any]]:
    """One series per backend: y(run) against the length, over the runs of `scenario`."""
    out = []
    for impl in impls or COLORS:
        pts = sorted((r["length"], v) for r in runs
                     if (r["scenario"], r["attn_impl"]) == (scenario, impl) and (v := y(r)) is not None)
        if pts:
            out.append({"label": LABELS[impl], "x": [p[0] for p in pts], "y": [p[1] for p in pts],
                        "color": COLORS[impl]})
    return out


def _group_series(runs) -> list[dict[str, Any]]:
    """Per layer group of the paged runs of `mixed` (full, or one window): the KV its pages hold
    and the KV the next token needs, against the length."""
    paged = sorted((r for r in runs if (r["scenario"], r["attn_impl"]) == ("mixed", "paged")),
                   key=lambda r: r["length"])
    out = []
    for i, g in enumerate(paged[0]["kv"].get("by_group", []) if paged else []):
        name = "full layers" if g["window"] is None else f"window {g['window']}"
        for key, what, fmt in (("kv_bytes_held", "held", "o-"), ("kv_bytes_needed", "needed", "s--")):
            out.append({"label": f"{name} ({g['layers']}): {what}", "x": [r["length"] for r in paged],
                        "y": [r["kv"]["by_group"][i][key] / MiB for r in paged], "fmt": fmt})
    return out


def figures(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    runs, n, x = results["runs"], latency.MIXED_N, "sequence length (longest prompt, tokens)"
    device = results["environment"]["device"].split(":")[0]
    peak = lambda r: r.get("run_peak_bytes") and r["run_peak_bytes"] / MiB
    needed = [dict(s, label="needed (K/V of the tokens stored)", fmt="k--", color=None)
              for s in _series(runs, "mixed", lambda r: r["kv"]["kv_bytes_needed"] / MiB, ["sdpa"])]
    return {
        "latency_vs_length.png": [
            {"title": "one sequence: decode", "xlabel": x, "ylabel": "ms per token (p50)", "logy": True,
             "series": _series(runs, "single", lambda r: r["per_token"]["p50_ms"])},
            {"title": f"{n} sequences up to the length: decode", "xlabel": x, "ylabel": "ms per step (p50)",
             "logy": True, "series": _series(runs, "mixed", lambda r: r["per_token"]["p50_ms"])},
            {"title": f"{n} sequences: time to first token", "xlabel": x, "ylabel": "ms", "logy": True,
             "series": _series(runs, "mixed", lambda r: r["ttft_ms"])},
        ],
        "memory_vs_length.png": [
            {"title": f"KV cache held, {n} sequences up to the length", "xlabel": x, "ylabel": "MiB",
             "series": _series(runs, "mixed", lambda r: r["kv"]["kv_bytes_held"] / MiB, ["sdpa", "paged"])
             + needed},
            {"title": f"peak memory of the run, {n} sequences\n({PEAK.get(device, 'not measured')})",
             "xlabel": x, "ylabel": "MiB over the loaded model",
             "series": _series(runs, "mixed", peak)},
            {"title": f"paged KV per layer group, {n} sequences", "xlabel": x, "ylabel": "MiB",
             "series": _group_series(runs)},
        ],
    }


if __name__ == "__main__":
    print(json.dumps(measure_runs(json.load(sys.stdin))), flush=True)
