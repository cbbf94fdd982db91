"""The report of `make bench-http` (`benchmarks.http`): its four targets evaluated from one run,
the markdown table, the CSV rows and the plot, all from the results dict the driver builds:
{"config", "environment", "rates", "servers": {"vllm" | "ours": {"runs": {load: figures}, "error"?,
"startup_s"?}}, "inprocess", "targets"}; a load's figures: `http.measure`'s."""

from __future__ import annotations

from typing import Any

from fms_paged.bench.report import fmt, table

SERVERS = ("vllm", "ours")
NAMES = {"vllm": "vLLM", "ours": "fms-paged"}


def evaluate_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The four targets, ratios from this one run -> [{target, value, goal, met (None: not
    measured), unit}]; the first-byte delay is fms-paged's worst load (each load's kept)."""
    runs = {k: res["servers"].get(k, {}).get("runs", {}) for k in SERVERS}
    sat_tok_s = {k: runs[k].get("saturation", {}).get("output_tok_s") for k in SERVERS}
    half_ttft = {k: runs[k].get("0.5x saturation", {}).get("ttft_ms", {}).get("p50") for k in SERVERS}
    ratio = lambda a, b: a / b if a is not None and b else None
    delays = {k: r["first_byte_delay_ms"] for k, r in runs["ours"].items()
              if r.get("first_byte_delay_ms") is not None}
    checks = [
        ("fms-paged / vLLM output tok/s at saturation", ">=", 1.0,
         ratio(sat_tok_s["ours"], sat_tok_s["vllm"]), "x"),
        ("fms-paged / vLLM TTFT p50 at 0.5x vLLM's saturation rate", "<=", 1.0,
         ratio(half_ttft["ours"], half_ttft["vllm"]), "x"),
        ("HTTP / in-process output tok/s at saturation (fms-paged)", ">=", 0.90,
         ratio(sat_tok_s["ours"], (res.get("inprocess") or {}).get("output_tok_s")), "x"),
        ("first-byte delay (the server's first chunk sent after the engine's first token, mean), "
         "fms-paged's worst load", "<=", 5.0,
         max(delays.values()) if delays else None, "ms"),
    ]
    out = []
    for name, op, goal, value, unit in checks:
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        out.append({"target": name, "value": value, "goal": f"{op} {goal:g}{' ms' if unit == 'ms' else 'x'}",
                    "met": met, "unit": unit})
    if delays:
        out[-1]["per_load_ms"] = delays
    return out


def _triple(x: dict[str, float]) -> str:
    return " / ".join(fmt(x[k], ".1f") for k in ("mean", "p50", "p99"))


COLUMNS = [("server", "server", ""), ("load", "load", ""), ("offered req/s", "rate", ".2f"),
           ("done / failed", "done", ""), ("req/s", "request_throughput", ".2f"),
           ("out tok/s", "output_tok_s", ".0f"), ("prompt tokens", "total_input_tokens", ""),
           ("TTFT ms mean / p50 / p99", "ttft", ""), ("TPOT ms", "tpot", ""), ("ITL ms", "itl", ""),
           ("E2EL ms", "e2el", ""), ("engine TTFT / E2EL mean ms", "engine", ""),
           ("client - engine TTFT ms", "client_minus_engine_ttft_ms", ".2f"),
           ("first-byte delay ms", "first_byte_delay_ms", ".2f")]


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for kind, s in res["servers"].items():
        if "error" in s and not s["runs"]:
            why = s["error"].strip().splitlines()[0][:150]
            rows.append({"server": NAMES[kind], "load": f"did not run: {why}"})
        for load, r in s["runs"].items():
            e = r["engine"]
            rows.append({"server": NAMES[kind], "load": load, "rate": r["rate"], **r,
                         "done": f"{r['completed']} / {r['failed']}",
                         **{m: _triple(r[f"{m}_ms"]) for m in ("ttft", "tpot", "itl", "e2el")},
                         "engine": f"{fmt(e['ttft_mean_ms'], '.1f')} / {fmt(e['e2el_mean_ms'], '.1f')}"})
    return rows


def markdown(res: dict[str, Any]) -> str:
    env, cfg = res["environment"], res["config"]
    lines = [f"## fms_paged `bench-http` — {env['cpu_model']} ({env['cpu_count']} cores), {env['time']}",
             "", f"torch {env['torch']}, vLLM {env['vllm'] or '(not installed)'}, fastapi {env['fastapi']}, "
             f"uvicorn {env['uvicorn']}; model {cfg['model_dir']} ({cfg['dtype']}); {cfg['num_prompts']} "
             f"requests per load, prompts {cfg['input_len']} and outputs {cfg['output_len']} tokens +- "
             f"{cfg['range_ratio']:g}; max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens "
             f"{cfg['max_num_batched_tokens']}, max_model_len {cfg['max_model_len']}, prefix caching off. "
             f"Rates: {res['rates']['basis']}", "", table(table_rows(res), COLUMNS), ""]
    ip = res.get("inprocess")
    if ip and "error" not in ip:
        runs = ", ".join(f"{x:.0f}" for x in ip["output_tok_s_runs"])
        lines.append(f"- in-process engine, same workload at saturation: {ip['output_tok_s']:.0f} output "
                     f"tok/s (median of {runs}; warm-up {ip['warmup_s']:.1f} s)")
    elif ip:
        lines.append(f"- in-process engine did not run: {ip['error'].strip().splitlines()[0][:200]}")
    for kind, s in res["servers"].items():
        if "startup_s" in s:
            lines.append(f"- {NAMES[kind]} server ready in {s['startup_s']:.1f} s")
        if "error" in s:
            lines.append(f"- {NAMES[kind]}: {s['error'].strip().splitlines()[0][:300]}")
    for kind, s in res["servers"].items():
        bursts = [load for load, r in s["runs"].items() if r["itl_ms"]["p50"] < 0.05]
        if bursts:
            lines.append(f"- {NAMES[kind]}, {', '.join(bursts)}: ITL p50 ~0 ms, the tokens reached the "
                         "client in bursts (the server's processes short of CPU to stream them as made)")
    if "vllm_missing" in res:
        lines.append(f"- vLLM did not run: {res['vllm_missing']}")
    lines += structured_table(res)
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for t in res["targets"]:
        value = "-" if t["value"] is None else fmt(t["value"], ".3g") + (" ms" if t["unit"] == "ms" else "x")
        if "per_load_ms" in t:
            value += " (" + ", ".join(f"{k} {v:.1f}" for k, v in t["per_load_ms"].items()) + ")"
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {value} | {t['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def structured_table(res: dict[str, Any]) -> list[str]:
    """The structured-output loads (`http_structured`): free vs mixed per server, medians."""
    done = {k: s["structured"] for k, s in res["servers"].items() if "structured" in s}
    if not done:
        return []
    any_ = next(iter(done.values()))
    lines = ["", f"Structured outputs: {any_['requests']} requests at once, all free-form vs "
             f"{any_['structured_requests']} ({any_['ratio']:.0%}) held to a JSON schema; medians of "
             f"{len(any_['runs']['free'])} runs each, alternated", "",
             "| server | load | out tok/s | TTFT p50 ms | TPOT free ms | TPOT JSON ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for kind, st in done.items():
        for load in ("free", "mixed"):
            m = st[load]
            lines.append(f"| {NAMES[kind]} | {load} | {fmt(m['output_tok_s'], '.0f')} | "
                         f"{fmt(m['ttft_p50_ms'], '.1f')} | {fmt(m['tpot_free_ms'], '.1f')} | "
                         f"{fmt(m['tpot_json_ms'], '.1f')} | "
                         f"{sum(r['all']['failed'] for r in st['runs'][load])} |")
        lines.append(f"| {NAMES[kind]} | mixed / free | {fmt(st['tok_s_ratio'], '.3f')} | | "
                     f"{fmt(st['tpot_ratio'], '.3f')} | | |")
    return lines


def rows(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """CSV rows: server/load -> flat numbers."""
    out = {}
    for kind, s in res["servers"].items():
        for load, r in s["runs"].items():
            flat = {k: v for k, v in r.items() if isinstance(v, (int, float)) or v is None}
            for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
                flat.update({f"{m}_{q}": v for q, v in r[m].items()})
            flat.update({f"engine_{k}": v for k, v in r["engine"].items()})
            out[f"{kind}/{load}"] = flat
    return out


def figures(res: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Output tok/s, TTFT p50 and E2EL p50 against the achieved request rate, per server (the
    in-process engine as one point); the machine, date and versions in the titles."""
    def series(key) -> list[dict[str, Any]]:
        out = []
        for kind, s in res["servers"].items():
            pts = sorted((r["request_throughput"], key(r)) for r in s["runs"].values())
            if pts:
                out.append({"label": NAMES[kind], "x": [x for x, _ in pts], "y": [y for _, y in pts]})
        return out

    env, ip, x = res["environment"], res.get("inprocess") or {}, "achieved request rate (req/s)"
    tok = series(lambda r: r["output_tok_s"])
    if "output_tok_s" in ip:
        tok.append({"label": "engine in-process", "x": [ip["request_throughput"]], "y": [ip["output_tok_s"]],
                    "fmt": "*"})
    return {"http.png": [
        {"title": f"output throughput\n{env['cpu_model']} ({env['cpu_count']} cores)", "xlabel": x,
         "ylabel": "output tokens/s", "series": tok},
        {"title": f"TTFT p50 (client)\n{env['time'][:10]}, torch {env['torch']}", "xlabel": x,
         "ylabel": "ms", "logy": True, "series": series(lambda r: r["ttft_ms"]["p50"])},
        {"title": f"E2EL p50 (client)\nvLLM {env['vllm'] or '-'}, fastapi {env['fastapi'] or '-'}",
         "xlabel": x, "ylabel": "ms", "series": series(lambda r: r["e2el_ms"]["p50"])}]}
