"""`make bench-serve` (`fms-paged bench --scenario serve`): the engine under serving traffic, measured
the way vLLM's `bench serve` measures a server: requests all at once (offline) or Poisson arrivals
(online); each request's TTFT / TPOT / ITL / E2EL, the throughput, the KV pages in use over time.
Workloads (`--workloads`):
- `mix`: prompts of 500..8000 tokens and 16..256 new tokens (the paper's spread, times the scale),
  offline, at fractions of the offline request rate, and each of 8 requests alone;
- `shared_prefix`: every request starts with the same ~1k-token system prompt, prefix cache on / off;
- `multi_turn`: conversations whose every turn resends the history, prefix cache on / off;
- `parallel`: one request with n=8 completions (FORK) against 8 separate requests;
- `capacity`: how many mix requests run at once in the KV bytes of a dense cache;
- `vs_vllm`: the engine beside vLLM's CPU build on the workloads vLLM was first measured on.
- `vs_native`: the engine beside llama.cpp and OpenVINO GenAI on those workloads, and each one's start.
Then the peers on the offline mix (`--peers`), each in its own process. Greedy tokens are compared
between the runs of a workload and with every peer. The peer workloads and `--peers` run the peer
drivers of the checkout's `benchmarks/` folder (`benchmarks.vs_vllm`, `benchmarks.vs_native`,
`benchmarks.peers`), which the wheel does not ship: from a checkout (`make bench-serve`) they are the
defaults; from an installed wheel they are left out of the defaults, and asking for them says where
they live.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fms_paged.bench.environment import kv_bytes_per_token
from fms_paged.bench.latency import with_rope_len
from fms_paged.bench.report import fmt, table
from fms_paged.device import keep_freed_cpu_memory
from fms_paged.engine import Engine, SamplingParams


@dataclass
class Spec:
    """One request; a conversation's next turns (user tokens) go when the previous turn finishes."""

    prompt: list[int]
    max_new_tokens: int
    n: int = 1
    next_turns: list[list[int]] = field(default_factory=list)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(max(1, n))]


def workload(name: str, scale: float, vocab: int, seed: int = 0, num: int | None = None) -> list[Spec]:
    rng = random.Random(seed)
    s = lambda x: max(1, round(x * scale))
    if name == "mix":  # the paper's 500..8000-token prompts, log-uniform
        return [Spec(_tokens(rng, s(round(math.exp(rng.uniform(math.log(500), math.log(8000))))), vocab),
                     rng.randint(s(16), s(256))) for _ in range(num or 64)]
    if name == "shared_prefix":
        system = _tokens(rng, s(1024), vocab)
        return [Spec(system + _tokens(rng, rng.randint(s(16), s(64)), vocab), s(64))
                for _ in range(num or 64)]
    if name == "multi_turn":  # 8 conversations of 6 turns
        return [Spec(_tokens(rng, rng.randint(s(128), s(512)), vocab), s(64),
                     next_turns=[_tokens(rng, rng.randint(s(32), s(128)), vocab) for _ in range(5)])
                for _ in range(num or 8)]
    raise ValueError(f"workload {name!r}; expected mix, shared_prefix or multi_turn")


def _pct(xs: list[float]) -> dict[str, float | None]:
    pcts = np.percentile(xs, (50, 99)).tolist() if xs else [None, None]
    return {"mean": statistics.fmean(xs) if xs else None, "p50": pcts[0], "p99": pcts[1]}


def serve(model, specs: list[Spec], engine_kw: dict[str, Any], rate: float | None = None, seed: int = 0,
          prefix_pages: int = 0) -> dict[str, Any]:
    """`specs` through a fresh Engine, all at t=0 (rate None) or Poisson arrivals at `rate` req/s ->
    the figures, each request's tokens (completion 0) in submission order, and with `prefix_pages`
    the distinct pages holding that many first pages of the running sequences (a shared prefix)."""
    eng, rng = Engine(model, **engine_kw), random.Random(seed)
    arrivals = list(accumulate((rng.expovariate(rate) if rate else 0.0 for _ in specs[1:]), initial=0.0))
    t0 = time.perf_counter()
    tokens, timeline, reqs = _drive(eng, specs, arrivals, t0, prefix_pages)
    duration = time.perf_counter() - t0
    m = eng.metrics()
    m.pop("finished_by_reason")  # (the figures below are scalars)
    out_tokens, in_tokens = sum(r["output_tokens"] for r in reqs), sum(r["prompt_tokens"] for r in reqs)
    return {
        "rate": rate, "completed": len(reqs), "failed": 0, "duration_s": duration,
        "request_throughput": len(reqs) / duration, "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration, "total_tok_s": (out_tokens + in_tokens) / duration,
        **{f"{name}_s": _pct([x for r in reqs for x in (r[k] if k == "itl" else [r[k]]) if x is not None])
           for k, name in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el"))},
        "peak_kv_pages": max((x[1] for x in timeline), default=0),
        "peak_prefix_pages": max((x[4] for x in timeline), default=0),
        "timeline": timeline, "tokens": [tokens[k] for k in sorted(tokens)],
        **{k: v for k, v in m.items() if not k.startswith("mean_")},
    }


def _drive(eng: Engine, specs: list[Spec], arrivals: list[float], t0: float, prefix_pages: int):
    """Submit each request at its arrival, each next turn when its previous one finishes, and step
    the engine until all are done -> (tokens of completion 0 by (request, turn), timeline, the
    final statistics of each completion in the order they finished)."""
    pending = sorted(zip(arrivals, range(len(specs))), reverse=True)
    owner, tokens, history, timeline, stats = {}, {}, {}, [], []

    def submit(i: int, turn: int, prompt: list[int], arrival: float | None = None) -> None:
        sp = SamplingParams(max_new_tokens=specs[i].max_new_tokens, ignore_eos=True, n=specs[i].n)
        # latencies count from the scheduled arrival, even if a step was running at that moment
        rid = eng.add_request(prompt, sp, arrival_time=None if arrival is None else t0 + arrival)
        owner[rid], history[i] = (i, turn), prompt

    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[-1][0] <= now:
            at, i = pending.pop()
            submit(i, 0, specs[i].prompt, at)
        if not eng.has_unfinished():
            time.sleep(max(0.0, pending[-1][0] - now))
            continue
        for out in eng.step():
            i, turn = owner[out.request_id]
            if out.finished:
                stats.append(out.stats)
            if out.index == 0:
                tokens.setdefault((i, turn), []).extend(out.new_token_ids)
            if out.finished and out.index == 0 and turn < len(specs[i].next_turns):
                submit(i, turn + 1, history[i] + tokens[(i, turn)] + specs[i].next_turns[turn])
        sched, pm = eng.scheduler, eng.pm
        shared = len({p for s in pm.live_seqs for p in pm.pages_of(s)[:prefix_pages]}) if prefix_pages else 0
        # timeline: (s, pages used, running, waiting, pages holding the shared prefix) after each step
        timeline.append((time.perf_counter() - t0, pm.num_pages - 1 - sched.available_pages(),
                         len(sched.running), len(sched.waiting), shared))
    return tokens, timeline, stats


def engine_kw(args, **over) -> dict[str, Any]:
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_pages": args.num_pages, "compile": args.compile, "max_model_len": args.max_model_len, **over}


def _mix(args, model, res) -> dict[str, Any]:
    specs = workload("mix", args.scale, model.config.src_vocab_size, args.seed, args.num_requests)
    runs = {"offline": serve(model, specs, engine_kw(args))}
    for f in args.rate_fractions:  # online: Poisson arrivals at fractions of the offline rate
        rate = f * runs["offline"]["request_throughput"]
        runs[f"{f:g}x offline rate"] = serve(model, specs, engine_kw(args), rate=rate, seed=args.seed)
    alone = [serve(model, [sp], engine_kw(args))["ttft_s"]["mean"] for sp in specs[:8]]  # an idle engine
    return {**runs, "alone": {"ttft_s": _pct(alone), "count": len(alone)}}


def _shared_prefix(args, model, res) -> dict[str, Any]:  # all requests at once, one system prompt
    specs = workload("shared_prefix", args.prefix_scale, model.config.src_vocab_size, args.seed,
                     args.prefix_requests)
    kw = engine_kw(args, max_num_seqs=len(specs))
    res["warmup_s"] += Engine(model, **kw).warmup(progress=False)  # compile what the runs use
    k = max(1, round(1024 * args.prefix_scale)) // model.config.page_size
    return {f"cache {c}": serve(model, specs, dict(kw, enable_prefix_caching=c == "on"), prefix_pages=k)
            for c in ("off", "on")}


def _multi_turn(args, model, res) -> dict[str, Any]:
    specs = workload("multi_turn", args.scale, model.config.src_vocab_size, args.seed)
    runs = {f"cache {c}": serve(model, specs, engine_kw(args, enable_prefix_caching=c == "on"))
            for c in ("off", "on")}
    return {**runs, "new_prompt_tokens": sum(len(s.prompt) + sum(map(len, s.next_turns)) for s in specs)}


def _parallel(args, model, res) -> dict[str, Any]:
    n, new = 8, max(1, round(128 * args.scale))
    prompt = _tokens(random.Random(args.seed), round(512 * args.scale), model.config.src_vocab_size)
    kw = engine_kw(args, enable_prefix_caching=False)  # sharing by FORK alone
    return {"n=8": serve(model, [Spec(prompt, new, n=n)], kw),
            "8 separate": serve(model, [Spec(prompt, new) for _ in range(n)], kw)}


def capacity(model, args, max_len: int) -> dict[str, Any]:
    """The most mix requests (outputs long enough to overlap; sent at once, eager steps) running at
    once in the KV bytes of a dense cache of max(1, 8192 // max_len) rows of `max_len` tokens. Past
    the trained length a twin with a longer RoPE table stands in (this measures memory)."""
    twin, dense_rows = with_rope_len(model, max_len), max(1, 8192 // max_len)
    P, per_token = twin.config.page_size, kv_bytes_per_token(twin.config, twin.dtype)
    budget, mean = dense_rows * max_len * per_token, 0.5 * (500 + 8000) * args.scale
    n = max(16, round(1.5 * dense_rows * max_len / mean))  # enough requests to fill the budget
    specs = [Spec(sp.prompt, max(64, sp.max_new_tokens))
             for sp in workload("mix", args.scale, twin.config.src_vocab_size, args.seed, n)]
    r = serve(twin, specs, dict(max_num_seqs=n, max_num_batched_tokens=max(n, args.max_num_batched_tokens),
                                compile=False, num_pages=budget // (P * per_token) + 1, max_model_len=max_len,
                                enable_prefix_caching=False))
    peak = max(x[2] for x in r["timeline"])
    return {"max_len": max_len, "kv_budget_bytes": budget, "dense_concurrency": dense_rows,
            "engine_peak_running": peak, "ratio": peak / dense_rows, "requests": n,
            "preemptions": r["preemptions"], "completed": r["completed"]}


WORKLOADS = {"mix": _mix, "shared_prefix": _shared_prefix, "multi_turn": _multi_turn, "parallel": _parallel}
PEER_WORKLOADS = ("vs_vllm", "vs_native")  # the peer drivers' (`benchmarks/`, in the checkout only)
OTHERS = ("capacity", *PEER_WORKLOADS)
PEERS = ("dense", "hf", "vllm")  # `--peers` on the offline mix (`benchmarks.peers`)
PEER_DRIVERS = "benchmarks"  # the checkout's top-level package of peer drivers; not in the wheel


def peer_drivers_present() -> bool:
    """Whether the checkout's peer drivers are importable (run from the repository root, or with it
    on PYTHONPATH); an installed wheel has none."""
    return importlib.util.find_spec(PEER_DRIVERS) is not None


def default_workloads() -> str:
    """`--workloads`' default: every workload, the peer ones only where their drivers are present."""
    return ",".join([*WORKLOADS, "capacity", *(PEER_WORKLOADS if peer_drivers_present() else ())])


def default_peers() -> list[str]:
    """`--peers`' default: all of `PEERS` where their drivers are present, else none."""
    return list(PEERS) if peer_drivers_present() else []


def peer_driver(name: str) -> ModuleType:
    """The checkout's `benchmarks.<name>` (an optional dependency: the wheel does not ship it), or
    SystemExit saying where it lives and how to run it."""
    try:
        return importlib.import_module(f"{PEER_DRIVERS}.{name}")
    except ModuleNotFoundError as e:
        if e.name not in (PEER_DRIVERS, f"{PEER_DRIVERS}.{name}"):
            raise
        raise SystemExit(
            f"fms-paged bench --scenario serve: {name} runs the peer drivers of the repository's "
            f"`{PEER_DRIVERS}/` folder ({PEER_DRIVERS}.{name}), which an installed wheel does not ship; "
            "run it from a checkout's root (`make bench-serve`, or `python -m fms_paged.bench.cli "
            "--scenario serve ...`), or leave it out of --workloads / --peers") from e


def run(args, model, spec: dict[str, Any], res: dict[str, Any], log=print) -> dict[str, Any]:
    """Every workload of `args.workloads`, then the peers on the offline mix, added to `res`."""
    todo = [w for w in args.workloads.split(",") if w]
    if set(todo) - {*WORKLOADS, *OTHERS}:
        raise SystemExit(f"--workloads {args.workloads}: expected some of {', '.join([*WORKLOADS, *OTHERS])}")
    for name in [*(w for w in PEER_WORKLOADS if w in todo), *(["peers"] if args.peers else [])]:
        peer_driver(name)  # before any run: a wheel without the drivers says so at once
    keep_freed_cpu_memory()  # this process serves: glibc keeps freed buffers (vLLM's peer: tcmalloc)
    t0 = time.perf_counter()
    res.update(workloads={}, warmup_s=Engine(model, **engine_kw(args)).warmup(progress=False))
    phase = res["phase_s"] = {"warm-up": time.perf_counter() - t0}
    for name in todo:
        log(f"[bench-serve] {name} ...")
        t = time.perf_counter()
        if name in WORKLOADS:
            res["workloads"][name] = WORKLOADS[name](args, model, res)
        elif name == "capacity":
            res["capacity"] = [capacity(model, args, n) for n in args.capacity_lens]
        elif name == "vs_vllm":
            res["vs_vllm"] = peer_driver("vs_vllm").vs_vllm(args, model, spec.get("model_path"), args.out,
                                                            log=log)
        else:
            res["vs_native"] = peer_driver("vs_native").vs_native(Path(args.out) / "vs_native", log=log)
        phase[name] = time.perf_counter() - t
    for name, runs in res["workloads"].items():  # greedy tokens across the runs of a workload
        toks = [r["tokens"] if name != "parallel" else [r["tokens"][0]]  # greedy: completions equal
                for n, _, r in _runs(res) if n == name]
        runs["tokens_equal"] = all(t == toks[0] for t in toks)
    if args.peers and "mix" in res["workloads"]:
        t = time.perf_counter()
        specs = workload("mix", args.scale, model.config.src_vocab_size, args.seed, args.num_requests)
        engine_run = lambda: serve(model, specs, engine_kw(args))["output_tok_s"]
        res["peers"] = peer_driver("peers").run_peers(model, spec.get("model_path"), specs, args, args.out,
                                                      engine_run, log)
        ours = res["workloads"]["mix"]["offline"]
        for r in res["peers"].values():
            if "tokens" in r:
                r["tokens_equal_engine"] = r["tokens"] == ours["tokens"]
                r["engine_speedup"] = r.get("engine_output_tok_s", ours["output_tok_s"]) / r["output_tok_s"]
        phase["peers"] = time.perf_counter() - t
    return res


def _runs(res: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(workload, run name, figures) of every `serve` run."""
    return [(name, case, r) for name, runs in res["workloads"].items() for case, r in runs.items()
            if isinstance(r, dict) and "completed" in r]


def rows(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{name}/{case}": {
        "workload": name, "case": case, **{k: r.get(k) for k in (
            "completed", "request_throughput", "output_tok_s", "total_tok_s", "peak_kv_pages", "preemptions",
            "prompt_tokens_computed", "prefix_cache_hit_rate")},
        "ttft_mean_s": r["ttft_s"]["mean"], "ttft_p99_s": r["ttft_s"]["p99"],
        "tpot_mean_ms": r["tpot_s"]["mean"] and 1e3 * r["tpot_s"]["mean"], "e2el_p50_s": r["e2el_s"]["p50"],
    } for name, case, r in _runs(res)} | {f"peer/{peer}": {"workload": "mix", "case": f"peer {peer}", **{
        k: r.get(k) for k in ("output_tok_s", "engine_speedup")}} for peer, r in res.get("peers", {}).items()}


COLUMNS = [("workload", "workload", ""), ("run", "case", ""), ("done", "completed", "d"),
           ("req/s", "request_throughput", ".3g"), ("out tok/s", "output_tok_s", ".1f"),
           ("TTFT mean s", "ttft_mean_s", ".3g"), ("TTFT p99 s", "ttft_p99_s", ".3g"),
           ("TPOT mean ms", "tpot_mean_ms", ".3g"), ("E2EL p50 s", "e2el_p50_s", ".3g"),
           ("peak KV pages", "peak_kv_pages", "d"), ("preempt", "preemptions", "d"),
           ("prompt tokens computed", "prompt_tokens_computed", "d"),
           ("cache hit rate", "prefix_cache_hit_rate", ".0%")]


def _notes(res: dict[str, Any]) -> list[str]:
    """What the table does not show (the rest of its comparisons are rows of it)."""
    w, lines = res["workloads"], []
    if "mix" in w:
        lines.append(f"- mix, each of {w['mix']['alone']['count']} requests alone: TTFT mean "
                     f"{fmt(w['mix']['alone']['ttft_s']['mean'], '.3g')} s")
    if "shared_prefix" in w:
        off, on = w["shared_prefix"]["cache off"], w["shared_prefix"]["cache on"]
        lines.append(f"- shared prefix: TTFT mean {off['ttft_s']['mean'] / on['ttft_s']['mean']:.3g}x lower "
                     f"with the cache; peak pages holding the shared prompt {off['peak_prefix_pages']} -> "
                     f"{on['peak_prefix_pages']}")
    if "multi_turn" in w:
        lines.append(f"- multi-turn: new prompt tokens {w['multi_turn']['new_prompt_tokens']} (the rest of "
                     "those computed without the cache are resent history)")
    for peer, r in res.get("peers", {}).items():
        if "error" in r:
            lines.append(f"- peer {peer}: did not run ({r['error'].strip().splitlines()[-1][:200]})")
            continue
        runs = ", ".join(f"{x:.0f}" for x in r.get("engine_output_tok_s_runs", []))  # on both sides of it
        around = f" (engine {r['engine_output_tok_s']:.1f}: median of {runs} just around it)" if runs else ""
        lines.append(f"- peer {peer}, offline mix: {r['output_tok_s']:.1f} output tok/s; engine / {peer} = "
                     f"{fmt(r.get('engine_speedup'), '.3g')}x{around}; greedy tokens "
                     f"{'equal' if r.get('tokens_equal_engine') else 'DIFFER'}")
    for c in res.get("capacity", []):
        lines.append(f"- capacity, KV budget of a dense cache of {c['dense_concurrency']} x {c['max_len']} "
                     f"tokens ({c['kv_budget_bytes'] / 2**20:.0f} MiB): the engine ran up to "
                     f"{c['engine_peak_running']} mix requests at once ({c['ratio']:.3g}x dense)")
    lines.append("- greedy tokens equal across the runs of each workload: " + ", ".join(
        f"{k} {fmt(v.get('tokens_equal'))}" for k, v in w.items()))
    return lines


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    runs = [r for k, r in rows(res).items() if not k.startswith("peer/")]
    lines = [f"## fms_paged `bench-serve` — {env['device_name']}, torch {env['torch']}, scale "
             f"{res['config']['scale']}, model {res['model']['source']}", "", table(runs, COLUMNS), "",
             *_notes(res)]
    if "vs_vllm" in res:
        lines += peer_driver("vs_vllm").vs_vllm_markdown(res["vs_vllm"])
    if "vs_native" in res:
        lines += ["", "#" + peer_driver("vs_native_report").markdown(res["vs_native"])]
    parts = ", ".join(f"{k} {v:.0f}" for k, v in res["phase_s"].items())
    return "\n".join([*lines, "", f"Wall time of each part (s): {parts}"]) + "\n"


def figures(res: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    line = lambda i: [{"label": f"{name}: {case}", "x": [x[0] for x in r["timeline"]], "fmt": "-",
                       "y": [x[i] for x in r["timeline"]]} for name, case, r in _runs(res) if r["timeline"]]
    online = [r for name, _, r in _runs(res) if name == "mix" and r["rate"]]
    rates, tok_s = [r["rate"] for r in online], [r["output_tok_s"] for r in online]
    return {
        "serve_timeline.png": [
            {"title": "KV pages in use over time", "xlabel": "s", "ylabel": "pages", "series": line(1)},
            {"title": "running requests over time", "xlabel": "s", "ylabel": "requests", "series": line(2)}],
        "serve_rate.png": [
            {"title": "throughput", "xlabel": "request rate (req/s)", "ylabel": "output tokens/s",
             "series": [{"label": "mix", "x": rates, "y": tok_s}][:len(online)]},
            {"title": "TTFT", "xlabel": "request rate (req/s)", "ylabel": "s", "series": [
                {"label": q, "x": rates, "y": [r["ttft_s"][q] for r in online], "fmt": f}
                for q, f in (("mean", "o-"), ("p99", "s--"))] if online else []}],
    }
