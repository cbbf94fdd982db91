"""`make bench-native`'s report (`benchmarks.vs_native`): the targets against the peers, the
one-request rates per GB/s of each process's own bandwidth, the markdown and the figure."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.vs_native_cases import (
    COLD_START_S,
    ENGINE,
    ENGINE_DTYPES,
    ONE_REQUEST,
    PEER_RATIO,
    PEERS,
    ROOFLINE_SHARE,
    WARM_START_S,
)
from fms_paged.bench.report import table


def per_bandwidth(res: dict[str, Any]) -> dict[str, Any]:
    """The one-request rates over the read bandwidth of the process that ran each (GB/s, one
    method for all: `process_read_gbs`): on a VM whose processes land on memory of different
    speeds, how the systems' decodes compare with that placement taken out. A reading beside the
    target, not the target (which compares tok/s)."""
    w = res["workloads"].get(ONE_REQUEST, {})
    rates = {
        system: {dt: r["output_tok_s"] / r["process_read_gbs"] for dt, r in by_dtype.items()
                 if r.get("process_read_gbs")}
        for system, by_dtype in w.items()
    }
    out: dict[str, Any] = {"tok_s_per_gbs": rates}
    ours = rates.get(ENGINE, {})
    peers = {(p, dt): v for p, by_dtype in rates.items() if p != ENGINE for dt, v in by_dtype.items()}
    if ours and peers:
        dt = max(ours, key=ours.get)
        best = max(peers, key=peers.get)
        out.update(ours=(dt, ours[dt]), best_peer=(*best, peers[best]), ratio=ours[dt] / peers[best])
    return out


def roofline_share(res: dict[str, Any], dt: str, r: dict[str, Any]) -> float | None:
    """A one-request engine process's decode steps/s (its median run's) over its roofline: the
    bytes a step reads (weights and live KV) at the bandwidth read in that process beside that run
    (the mean of the readings just before and just after it); None without both."""
    step_bytes = res.get("roofline_bytes_per_step", {}).get(dt)
    if not (step_bytes and r.get("decode_steps_s") and r.get("read_bandwidth_gbs")):
        return None
    return r["decode_steps_s"] * step_bytes / (r["read_bandwidth_gbs"] * 1e9)


def roofline_shares(res: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """(share, GB/s) of each of the one-request engine's processes, per dtype (`roofline_share`).
    The target takes a dtype's median over its processes."""
    out = {}
    for dt, r in res["workloads"].get(ONE_REQUEST, {}).get(ENGINE, {}).items():
        got = [(roofline_share(res, dt, p), p["read_bandwidth_gbs"]) for p in r.get("processes", ())]
        if got := [(x, g) for x, g in got if x is not None]:
            out[dt] = got
    return out


def _best(by_dtype: dict[str, dict[str, Any]]) -> tuple[str | None, float]:
    ok = {dt: r["output_tok_s"] for dt, r in by_dtype.items() if "output_tok_s" in r}
    if not ok:
        return None, 0.0
    dt = max(ok, key=ok.get)
    return dt, ok[dt]


def targets(res: dict[str, Any]) -> list[dict[str, str]]:
    """Each target with what was measured and whether it was met (None: a system did not run)."""
    rows = []
    for name, w in res["workloads"].items():
        ours_dt, ours = _best(w.get(ENGINE, {}))
        peers = {p: _best(w.get(p, {})) for p in PEERS}
        peers = {p: b for p, b in peers.items() if b[0]}
        if not (ours_dt and peers):
            rows.append(
                {
                    "target": f">= {PEER_RATIO}x the best peer: {name}",
                    "measured": "a system did not run",
                    "met": "unknown",
                }
            )
            continue
        best = max(peers, key=lambda p: peers[p][1])
        ratio = ours / peers[best][1]
        rows.append(
            {
                "target": f">= {PEER_RATIO}x the best peer: {name}",
                "measured": f"{ratio:.2f}x ({ours_dt} {ours:.1f} tok/s vs {best} {peers[best][0]} "
                f"{peers[best][1]:.1f})",
                "met": "yes" if ratio >= PEER_RATIO else "no",
            }
        )
    one = res["workloads"].get(ONE_REQUEST, {}).get(ENGINE, {})
    shares = roofline_shares(res)
    if shares:
        median = {dt: statistics.median(s for s, _ in by) for dt, by in shares.items()}
        dt = max(median, key=median.get)
        rows.append(
            {
                "target": f"one-request decode >= {ROOFLINE_SHARE:.0%} of the read roofline",
                "measured": "; ".join(
                    f"{d} {median[d]:.0%}"
                    + (" (" + ", ".join(f"{x:.0%} at {g:.0f} GB/s" for x, g in by) + ")" if by[1:] else "")
                    for d, by in shares.items()
                ),
                "met": "yes" if median[dt] >= ROOFLINE_SHARE else "no",
            }
        )
    warm = {dt: r["engine_first_token_s"] for dt, r in one.items() if "engine_first_token_s" in r}
    cold = {
        dt: r["engine_first_token_s"]
        for dt, r in res.get("cold_start", {}).items()
        if "engine_first_token_s" in r
    }
    for what, got, limit in (("warm", warm, WARM_START_S), ("cold", cold, COLD_START_S)):
        if got:
            rows.append(
                {
                    "target": f"{what} start, Engine(...) to first token (SmolLM2) <= {limit:.0f} s",
                    "measured": ", ".join(f"{d} {s:.1f} s" for d, s in got.items()),
                    "met": "yes" if max(got.values()) <= limit else "no",
                }
            )
    return rows


def cold_line(dtype: str, r: dict[str, Any]) -> str:
    """One dtype's cold start: first token from Engine(...), builds done (from process start), rate."""
    if "engine_first_token_s" not in r:
        return f"{dtype} failed"
    nan = float("nan")
    return (f"{dtype} {r['engine_first_token_s']:.1f} s, builds done by {r.get('builds_done_s', nan):.1f} s, "
            f"{r.get('output_tok_s', nan):.1f} tok/s")


def markdown(res: dict[str, Any]) -> str:
    env, rounds = res["environment"], res.get("rounds", 1)
    rows = []
    for name, w in res["workloads"].items():
        for system, by_dtype in w.items():
            for dt, r in by_dtype.items():
                if "error" in r:
                    rows.append(
                        {
                            "workload": name,
                            "system": system,
                            "dtype": dt,
                            "tok_s": "did not run: " + r["error"].strip().splitlines()[-1][:100],
                        }
                    )
                    continue
                steps = r.get("decode_steps_s")
                share = roofline_share(res, dt, r) if system == ENGINE else None
                rows.append(
                    {
                        "workload": name,
                        "system": system,
                        "dtype": dt,
                        "tok_s": r["output_tok_s"],
                        "steps": steps and (f"{steps:.1f}" + (f" ({share:.0%})" if share else "")),
                        "start": r.get("start_s"),
                    }
                )
    cols = [
        ("workload", "workload", ""),
        ("system", "system", ""),
        ("dtype", "dtype", ""),
        ("output tok/s", "tok_s", ".1f"),
        ("decode steps/s (% of roofline)", "steps", ""),
        ("start s (process start to first token, warm)", "start", ".1f"),
    ]
    cold = {dt: r for dt, r in res.get("cold_start", {}).items()}
    lines = [
        f"# The engine beside llama.cpp and OpenVINO GenAI ({env['cpu_model']}, {env['cpu_count']} CPUs, "
        f"{env['time'][:10]})",
        "",
        (f"Each system and dtype in {rounds} processes of its own, one a round (the order reversed every "
         f"other round), each a warm-up and {res['repeats']} timed runs: the median of the "
         f"{rounds * res['repeats']} runs; " if rounds > 1 else
         f"Median of {res['repeats']} timed runs after a warm-up, each system in its own process; ")
        + f"the engine with decode_steps={res.get('decode_steps', 1)} (lookahead decode steps); read "
        + f"bandwidth {res['read_bandwidth_gbs']:.1f} GB/s in the benchmark's process"
        + "".join(f", {dt} {r['read_bandwidth_gbs']:.1f} in the one-request engine's (its roofline)"
                  for dt, r in res["workloads"].get(ONE_REQUEST, {}).get(ENGINE, {}).items()
                  if "read_bandwidth_gbs" in r) + ".",
        "",
        table(rows, cols),
        "",
    ]
    one = res["workloads"].get(ONE_REQUEST, {}).get(ENGINE, {})
    for dt, r in one.items():
        if "step_anatomy_ms" in r:
            a = r["step_anatomy_ms"]
            lines.append(
                f"Engine decode step, one request, one token a step, {dt} (ms): {a['step']:.2f} a step, "
                f"{a['kernels']:.2f} "
                f"in the C++ kernels, {a['host']:.2f} host work ({a['host_outside_forward']:.2f} of it "
                f"outside the model's forward: scheduling, sampling, bookkeeping)."
            )
    per = res.get("one_request_per_gbs", {})
    if "ratio" in per:
        (dt, v), (peer, pdt, pv) = per["ours"], per["best_peer"]
        lines.append(
            f"One request per GB/s read in each system's own process: {per['ratio']:.2f}x ({dt} {v:.2f} "
            f"tok/s per GB/s vs {peer} {pdt} {pv:.2f}; "
            + ", ".join(f"{system} {d} {x:.2f}" for system, by in per["tok_s_per_gbs"].items()
                        for d, x in by.items())
            + ")."
        )
    lines.append("")
    if cold:
        lines += [
            "Engine cold start (empty kernel and compile caches), Engine(...) to first token (the "
            "first steps by torch's operations while the operators and kernels build in the background), "
            "then the builds done, from process start, and the timed run's rate with the kernels: "
            + "; ".join(cold_line(dt, r) for dt, r in cold.items()),
            "",
        ]
    lines += [
        table(res["targets"], [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")])
    ]
    return "\n".join(lines) + "\n"


def figures(res: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """One panel per workload: output tok/s of each system (a series) across the dtypes."""
    panels = []
    for name, w in res["workloads"].items():
        series = []
        for system, by_dtype in w.items():
            ok = [(dt, by_dtype[dt]["output_tok_s"]) for dt in ENGINE_DTYPES  # one dtype order for all
                  if "output_tok_s" in by_dtype.get(dt, {})]
            if ok:
                series.append(
                    {"label": system, "x": [d for d, _ in ok], "y": [v for _, v in ok], "fmt": "o-"}
                )
        panels.append({"title": name, "xlabel": "dtype", "ylabel": "output tok/s", "series": series})
    return {"vs_native.png": panels}
