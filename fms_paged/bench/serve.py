"""`make bench-serve`: the engine under serving traffic, measured the way vLLM's `bench serve`
measures a server: requests arrive all at once (offline) or by a Poisson process (online, a rate
sweep), and each request's TTFT / TPOT / ITL / E2EL, the throughput and the KV pages in use over
time are recorded. Workloads:

- `mix`: prompts of 500..8000 tokens and 16..256 new tokens (the paper's spread, times `scale`),
  offline and at each request rate of the sweep;
- `shared_prefix`: every request starts with the same system prompt (~1k tokens, times `scale`),
  prefix cache on vs off: TTFT, tokens/s and the KV pages that hold the shared part;
- `multi_turn`: conversations whose every turn resends the history: prompt tokens computed, cache
  on vs off, against the tokens that are new;
- `parallel`: one request with `n` completions (FORK) vs `n` separate requests;
- `page_sizes`: the sweep behind the default page size (throughput, KV fill, prefix-cache hits,
  long-context decode per page size);
- `capacity`, `vs_vllm`: concurrency under one KV budget, and the engine beside vLLM's CPU build;
- `split_kv` (not in the default list): CPU flex decoding's `PARTITION_SIZE` at 2k and 8k.

Greedy tokens are compared between the runs of a workload (cache on vs off, n vs separate).
Results: JSON, a markdown table and PNG plots in `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fms_paged.bench.peers import hf_checkpoint_dir
from fms_paged.engine import Engine, SamplingParams

PERCENTILES = (50, 99)


@dataclass
class Spec:
    """One request to send: its prompt, when (seconds after the start), and for a conversation
    the user tokens of its next turns (each sent when the previous turn finishes)."""

    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    n: int = 1
    next_turns: list[list[int]] = field(default_factory=list)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(max(1, n))]


def workload(name: str, scale: float, vocab: int, seed: int = 0, num: int | None = None) -> list[Spec]:
    rng = random.Random(seed)

    def s(x: int) -> int:
        return max(1, round(x * scale))

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
    if not xs:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": statistics.fmean(xs), **{f"p{p}": float(np.percentile(xs, p)) for p in PERCENTILES}}


def serve(model: torch.nn.Module, specs: list[Spec], engine_kw: dict[str, Any],
          rate: float | None = None, seed: int = 0, prefix_pages: int = 0,
          desc: str | None = None, track_fill: bool = False) -> dict[str, Any]:
    """Run `specs` through a fresh Engine: all at t=0 (rate None) or Poisson arrivals at `rate`
    requests/s. `prefix_pages`: also track the distinct pages held in the first that many logical
    pages of the running sequences (the KV of a shared prefix). -> the figures and each request's
    tokens (completion 0), in submission order of the first turns. `desc`: show a progress bar
    (finished requests) on stderr. `track_fill`: also the mean fill of the pages in use after each
    step (tokens held / their slots; 1 - fill is the KV lost to partly filled last pages)."""
    eng = Engine(model, **engine_kw)
    total = sum((1 + len(s.next_turns)) * s.n for s in specs)
    bar = _progress(total, desc)
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in specs:
        arrivals.append(t)
        if rate:
            t += rng.expovariate(rate)
    pending = sorted(zip(arrivals, range(len(specs))), reverse=True)
    owner: dict[int, tuple[int, int]] = {}  # engine request id -> (spec index, turn)
    tokens: dict[tuple[int, int], list[int]] = {}
    history: dict[int, list[int]] = {}
    timeline: list[tuple[float, int, int, int, int]] = []
    fill: list[float] = []
    t0 = time.perf_counter()

    def submit(i: int, turn: int, prompt: list[int], arrival: float | None = None) -> None:
        sp = SamplingParams(max_new_tokens=specs[i].max_new_tokens, ignore_eos=True, n=specs[i].n)
        # latencies count from the scheduled arrival, even if a step was running at that moment
        rid = eng.add_request(prompt, sp, arrival_time=None if arrival is None else t0 + arrival)
        owner[rid] = (i, turn)
        history[i] = prompt

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
            bar.update(out.finished)
            if out.index == 0:
                tokens.setdefault((i, turn), []).extend(out.new_token_ids)
            if out.finished and out.index == 0 and turn < len(specs[i].next_turns):
                submit(i, turn + 1, history[i] + tokens[(i, turn)] + specs[i].next_turns[turn])
        sched = eng.scheduler
        shared = 0
        if prefix_pages:  # distinct pages holding the first `prefix_pages` pages of live sequences
            shared = len({p for s in eng.pm.live_seqs for p in eng.pm.pages_of(s)[:prefix_pages]})
        used = eng.pm.num_pages - 1 - sched.available_pages()
        if track_fill and eng.pm.live_seqs:
            fill.append(eng.pm.utilization)
        timeline.append((time.perf_counter() - t0, used, len(sched.running), len(sched.waiting), shared))
    duration = time.perf_counter() - t0
    bar.close()
    m = eng.metrics()
    reqs = list(m.pop("requests").values())
    out_tokens = sum(r["output_tokens"] for r in reqs)
    in_tokens = sum(r["prompt_tokens"] for r in reqs)
    res = {
        "rate": rate, "completed": len(reqs), "failed": 0, "duration_s": duration,
        "request_throughput": len(reqs) / duration,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + in_tokens) / duration,
        "ttft_s": _pct([r["ttft"] for r in reqs if r["ttft"] is not None]),
        "tpot_s": _pct([r["tpot"] for r in reqs if r["tpot"] is not None]),
        "itl_s": _pct([x for r in reqs for x in r["itl"]]),
        "e2el_s": _pct([r["e2e"] for r in reqs if r["e2e"] is not None]),
        "peak_kv_pages": max((x[1] for x in timeline), default=0),
        "peak_prefix_pages": max((x[4] for x in timeline), default=0),
        "timeline": timeline,
        "kv_fill_mean": statistics.fmean(fill) if fill else None,
        "tokens": [tokens[k] for k in sorted(tokens)],
        **{k: v for k, v in m.items() if not k.startswith("mean_")},
    }
    return res


def _progress(total: int, desc: str | None):
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: no bar
        desc = None
    if desc is None:
        return type("NoBar", (), {"update": lambda self, n=1: None, "close": lambda self: None})()
    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)


def _engine_kw(args, model, **over) -> dict[str, Any]:
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_pages=args.num_pages, compile=args.compile, max_model_len=args.max_model_len)
    kw.update(over)
    return kw


def run_all(args, model) -> dict[str, Any]:
    vocab = model.config.src_vocab_size
    P = model.config.page_size
    t0 = time.perf_counter()
    res: dict[str, Any] = {"workloads": {}, "warmup_s": warmup(model, _engine_kw(args, model))}
    phase = res["phase_s"] = {"warm-up": time.perf_counter() - t0}

    def done(name: str) -> None:  # the wall time of each part of the run, for the README's budget
        phase[name] = time.perf_counter() - t0 - sum(phase.values())

    todo = args.workloads.split(",")
    if "mix" in todo:
        specs = workload("mix", args.scale, vocab, args.seed, args.num_requests)
        runs = {"offline": serve(model, specs, _engine_kw(args, model), desc="mix offline")}
        # online: Poisson arrivals at fractions of the offline request throughput
        for f in args.rate_fractions:
            rate = f * runs["offline"]["request_throughput"]
            runs[f"{f:g}x offline rate"] = serve(model, specs, _engine_kw(args, model), rate=rate,
                                                 seed=args.seed, desc=f"mix at {rate:.2f} req/s")
        # each of a few requests alone: the TTFT an idle engine gives it
        alone = [serve(model, [sp], _engine_kw(args, model))["ttft_s"]["mean"] for sp in specs[:8]]
        runs["alone"] = {"ttft_s": _pct(alone), "count": len(alone)}
        res["workloads"]["mix"] = runs
        done("mix")
    if "shared_prefix" in todo:  # 64 requests (default), all running at once, ~1k shared tokens
        specs = workload("shared_prefix", args.prefix_scale, vocab, args.seed, args.prefix_requests)
        k = max(1, round(1024 * args.prefix_scale)) // P
        kw = _engine_kw(args, model, max_num_seqs=len(specs))
        res["warmup_s"] += warmup(model, kw)
        res["workloads"]["shared_prefix"] = {
            f"cache {c}": serve(model, specs, dict(kw, enable_prefix_caching=c == "on"), prefix_pages=k,
                                desc=f"shared prefix, cache {c}")
            for c in ("off", "on")}
        done("shared_prefix")
    if "multi_turn" in todo:
        specs = workload("multi_turn", args.scale, vocab, args.seed)
        new = sum(len(s.prompt) + sum(len(t) for t in s.next_turns) for s in specs)
        res["workloads"]["multi_turn"] = {
            f"cache {c}": serve(model, specs, _engine_kw(args, model, enable_prefix_caching=c == "on"),
                                desc=f"multi-turn, cache {c}")
            for c in ("off", "on")}
        res["workloads"]["multi_turn"]["new_prompt_tokens"] = new
        done("multi_turn")
    if "parallel" in todo:
        rng = random.Random(args.seed)
        prompt, n = _tokens(rng, max(1, round(512 * args.scale)), vocab), 8
        new = max(1, round(128 * args.scale))
        kw = _engine_kw(args, model, enable_prefix_caching=False)  # sharing by FORK alone
        res["workloads"]["parallel"] = {
            "n=8": serve(model, [Spec(prompt, new, n=n)], kw),
            "8 separate": serve(model, [Spec(prompt, new) for _ in range(n)], kw),
        }
        done("parallel")
    if "page_sizes" in todo:
        res["page_sweep"] = page_sweep(args, model)
        done("page_sizes")
    if "split_kv" in todo:
        res["split_kv"] = split_kv(args, model)
        done("split_kv")
    if "capacity" in todo:
        res["capacity"] = [capacity(model, args, n) for n in args.capacity_lens]
        done("capacity")
    if "vs_vllm" in todo:
        res["vs_vllm"] = vs_vllm(args, model, Path(args.out))
        done("vs_vllm")
    for name, runs in res["workloads"].items():  # greedy tokens across the runs of a workload
        toks = [r["tokens"] for r in runs.values() if isinstance(r, dict) and "tokens" in r]
        if name == "parallel":
            toks = [[t[0]] for t in toks]  # greedy: every completion equals the first
        res["workloads"][name]["tokens_equal"] = all(t == toks[0] for t in toks)
    return res


def page_sweep(args, model, repeats: int = 3) -> list[dict[str, Any]]:
    """The evidence for the default page size. For each of `args.page_sizes`, a twin of the model
    sharing its weights (`with_config`), warmed up: the offline mix with the prefix cache off
    (throughput, TTFT, TPOT, the fill of the pages in use; `repeats` runs, the page sizes in turn
    and in a rotated order each round so that the machine's drift falls on all alike; the median
    run's figures), the multi-turn conversations with the cache on (hit rate, prompt tokens
    computed), and the compiled decode step of 8 sequences of `args.sweep_context` / 8 ..
    `args.sweep_context` tokens (the mix at full scale is longer than the scaled one), timed
    step by step in turn (`time_decode`). Greedy tokens must not depend on the page size."""
    from fms_paged.bench.latency import (
        make_backend,
        pool_pages,
        random_prompts,
        time_decode,
        with_config,
        with_rope_len,
    )

    vocab, sizes = model.config.src_vocab_size, args.page_sizes
    mix = workload("mix", args.scale, vocab, args.seed, args.num_requests)
    turns = workload("multi_turn", args.scale, vocab, args.seed)
    twins = {P: with_config(model, page_size=P) for P in sizes}
    kws = {P: _engine_kw(args, twins[P]) for P in sizes}
    rows = {P: {"page_size": P, "warmup_s": warmup(twins[P], kws[P])} for P in sizes}
    runs: dict[int, list[dict[str, Any]]] = {P: [] for P in sizes}
    for i in range(repeats):
        for P in sizes[i % len(sizes):] + sizes[: i % len(sizes)]:
            runs[P].append(serve(twins[P], mix, dict(kws[P], enable_prefix_caching=False), track_fill=True,
                                 desc=f"mix, page {P}"))
    ctx = args.sweep_context
    span = ctx + 32  # room for time_decode's warm-up, timed and BlockMask-timing steps
    long = with_rope_len(model, span)  # the forward does not read the page size; the backends do
    pools = {P: make_backend(with_config(long, page_size=P), "paged", 8, span,
                             num_pages=pool_pages([span] * 8, P)) for P in sizes}
    prompts = random_prompts(np.linspace(ctx / 8, ctx, 8).round().astype(int).tolist(), vocab, args.seed)
    decode = time_decode(long, pools, prompts, steps=8, warmup=2, compile=True)
    for P, r in rows.items():
        off = sorted(runs[P], key=lambda x: x["output_tok_s"])[len(runs[P]) // 2]
        on = serve(twins[P], turns, dict(kws[P], enable_prefix_caching=True), desc=f"multi-turn, page {P}")
        r.update({"output_tok_s": off["output_tok_s"],
                  "output_tok_s_runs": [x["output_tok_s"] for x in runs[P]],
                  "long_decode_ms": decode[P]["ms_per_step"],
                  "ttft_mean_s": off["ttft_s"]["mean"], "tpot_mean_s": off["tpot_s"]["mean"],
                  "kv_fill_mean": off["kv_fill_mean"], "peak_kv_pages": off["peak_kv_pages"],
                  "peak_kv_tokens": off["peak_kv_pages"] * P,
                  "multi_turn_hit_rate": on.get("prefix_cache_hit_rate"),
                  "multi_turn_prompt_tokens_computed": on["prompt_tokens_computed"],
                  "tokens": off["tokens"], "multi_turn_tokens": on["tokens"]})
    first = rows[sizes[0]]
    for r in rows.values():
        r["tokens_equal_first"] = (r["tokens"], r["multi_turn_tokens"]) == (
            first["tokens"], first["multi_turn_tokens"])
    return list(rows.values())


def split_kv(args, model) -> list[dict[str, Any]]:
    """CPU flex decoding's split-KV path (kernel option `PARTITION_SIZE`, KV tokens per partition):
    inductor takes it only when each kv head has one query row, that is for MHA. The engine's GQA
    decode packs the G query heads of a kv head into G rows and runs the flash kernel, where the
    option does nothing. So: a random MHA model of the model's shape on the flex kernel (the CPU's
    default cpp kernel has no such option); the compiled decode step at
    each of `args.split_kv_contexts`, for one sequence and for 8 (lengths spread up to the context),
    per partition size, the partition sizes timed step by step in turn (`time_decode`)."""
    from fms_paged.bench.latency import make_backend, pool_pages, random_prompts, time_decode
    from fms_paged.models.llama import LLaMA

    c = model.config
    span = max(args.split_kv_contexts) + 32  # room for time_decode's extra steps
    mha = LLaMA(c.updated(kvheads=c.nheads, max_expected_seq_len=span)).to(model.device, model.dtype)
    mha.reset_parameters()
    rows = []
    for ctx in args.split_kv_contexts:
        for B in (1, 8):
            lens = [ctx] if B == 1 else np.linspace(ctx / B, ctx, B).round().astype(int).tolist()
            pools = {}
            for part in args.partition_sizes:
                b = make_backend(mha, "paged", B, span, kernel="flex",  # the option is flex's
                                 num_pages=pool_pages([span] * B, c.page_size))
                b.kernel_options = dict(b.kernel_options or {}, PARTITION_SIZE=part)
                pools[part] = b
            t = time_decode(mha, pools, random_prompts(lens, c.src_vocab_size, args.seed), steps=8, warmup=2,
                            compile=True)
            rows.append({"context": ctx, "batch": B, "page_size": c.page_size,
                         "ms_per_step": {part: t[part]["ms_per_step"] for part in args.partition_sizes}})
    return rows


def capacity(model, args, max_len: int) -> dict[str, Any]:
    """Concurrency under one KV byte budget: the budget of a dense cache with max(1, 8192 //
    max_len) rows of `max_len` tokens, given to the engine as its pool; mix requests (their
    outputs made long enough to overlap) are sent at once, and the most that run at the same time
    is counted.
    Past the model's trained length a twin with a longer RoPE table stands in (memory only: the
    tokens are not meaningful there). Eager steps: this measures memory, not speed, and compiles
    nothing for the hundreds of decode rows."""
    from fms_paged.bench.environment import kv_bytes_per_token
    from fms_paged.bench.latency import with_rope_len

    twin = with_rope_len(model, max_len)
    P, per_token = twin.config.page_size, kv_bytes_per_token(twin.config, twin.dtype)
    dense_rows = max(1, 8192 // max_len)
    budget = dense_rows * max_len * per_token
    mean = 0.5 * (500 + 8000) * args.scale  # rough tokens per request, to send enough of them
    n = max(16, round(1.5 * dense_rows * max_len / mean))
    specs = [Spec(sp.prompt, max(64, sp.max_new_tokens)) for sp in
             workload("mix", args.scale, twin.config.src_vocab_size, args.seed, n)]
    kw = dict(max_num_seqs=n, max_num_batched_tokens=max(n, args.max_num_batched_tokens), compile=False,
              num_pages=budget // (P * per_token) + 1, max_model_len=max_len, enable_prefix_caching=False)
    r = serve(twin, specs, kw, desc=f"capacity at {max_len}")
    peak = max(x[2] for x in r["timeline"])
    return {"max_len": max_len, "kv_budget_bytes": budget, "dense_concurrency": dense_rows,
            "engine_peak_running": peak, "ratio": peak / dense_rows, "requests": n,
            "preemptions": r["preemptions"], "completed": r["completed"]}


def warmup(model, engine_kw: dict[str, Any]) -> float:
    """Compile what the runs will use, untimed (`Engine.warmup`) -> seconds."""
    return Engine(model, **engine_kw).warmup()


# ---------------------------------------------------------------------------- engine vs vLLM
# The three workloads vLLM's CPU build was first measured on, side by side: (model, prompt
# lengths, new tokens per request, max_num_seqs, max_num_batched_tokens). "smollm2" is a random
# model of SmolLM2-135M's shape (its weights are not shipped or downloaded; the speed of a step
# does not depend on their values), "default" the embedded default model.
VS_VLLM = {
    "SmolLM2-135M shape, 4 prompts 32..128, 64 new": ("smollm2", [32, 64, 96, 128], 64, 4, 512),
    "SmolLM2-135M shape, 1 prompt of 64, 64 new": ("smollm2", [64], 64, 4, 512),
    "default model, 16 prompts 62..1000, 16 new": (
        "default", [round(62 + i * (1000 - 62) / 15) for i in range(16)], 16, 16, 1024),
}
SMOLLM2_135M = dict(src_vocab_size=49152, emb_dim=576, nheads=9, kvheads=3, nlayers=30,
                    hidden_grow_factor=1536 / 576, multiple_of=1, rope_theta=100000.0,
                    max_expected_seq_len=8192, tie_heads=True)


def smollm2_shaped(out: Path) -> Path:
    """A seeded random LLaMA of SmolLM2-135M's shape written as a Hugging Face checkpoint."""
    from fms_paged.models.hf import save_hf_llama
    from fms_paged.models.llama import LLaMA, LLaMAConfig

    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG state
        torch.manual_seed(0)
        model = LLaMA(LLaMAConfig(**SMOLLM2_135M))
        model.reset_parameters()
    save_hf_llama(model, out)
    return out


def offline_engine(model, seqs: int, budget: int, compile, max_model_len: int) -> tuple[Engine, float]:
    """A warmed-up engine for `offline_runs` (prefix cache off, as for vLLM) -> (engine, warm-up s)."""
    eng = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=budget, compile=compile,
                 max_model_len=max_model_len, enable_prefix_caching=False)
    return eng, eng.warmup(progress=True)


def offline_runs(eng: Engine, prompts: list[list[int]], new: int, repeats: int) -> list[dict[str, Any]]:
    """`repeats` offline runs of `prompts` (each `new` tokens) -> each run's seconds, output tok/s,
    decode steps/s (one request: 1 / mean TPOT) and tokens."""
    runs = []
    for _ in range(repeats):
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
        got: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        for out in eng.stream():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        dt = time.perf_counter() - t0
        stats = eng.metrics()["requests"]
        runs.append({"duration_s": dt, "output_tok_s": len(prompts) * new / dt,
                     "decode_steps_s": 1 / statistics.fmean(stats[i]["tpot"] for i in ids),
                     "tokens": [got[i] for i in ids]})
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with every run's throughput listed."""
    mid = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    return {**mid, "output_tok_s_runs": [r["output_tok_s"] for r in runs],
            "tokens_equal_runs": all(r["tokens"] == runs[0]["tokens"] for r in runs)}


def vs_vllm(args, model, out: Path, repeats: int = 3) -> dict[str, Any]:
    """Each `VS_VLLM` workload through the engine (each compile mode of `args.vs_vllm_compile`)
    and through vLLM (its own process, same settings, median of `repeats`), with the decode
    roofline: read bandwidth measured here / bytes a decode step reads (weights + live K/V). The
    engines run `repeats` times before vLLM and `repeats` times after it (in reverse order), the
    median of all reported: this machine's speed drifts within minutes, and the runs on both sides
    of vLLM's cancel a steady drift."""
    from fms_paged.bench.environment import decode_roofline_ms, measure_read_bandwidth
    from fms_paged.models import get_model

    res: dict[str, Any] = {"read_bandwidth_gbs": measure_read_bandwidth(model.device), "workloads": {},
                           "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        smol = None
        for name, (which, lens, new, seqs, budget) in VS_VLLM.items():
            if which == "smollm2":
                smol = smol or get_model(model_path=smollm2_shaped(Path(tmp) / "smollm2"),
                                         attn_impl="paged", device=model.device)
            m = smol if which == "smollm2" else model
            rng = torch.Generator().manual_seed(args.seed)
            prompts = [torch.randint(3, m.config.src_vocab_size, (n,), generator=rng).tolist() for n in lens]
            kv_read = max(lens) + new  # the last step of the one-request workload
            roof = 1e3 / decode_roofline_ms(m, kv_read, res["read_bandwidth_gbs"])
            r: dict[str, Any] = {"roofline_steps_s": roof, "engine": {}}
            # one max_model_len for all workloads of a model: the same step shapes, so a later
            # workload's engine reuses the compiled (and the tuned) decode graphs of an earlier one
            span = max(max(w[1]) + w[2] for w in VS_VLLM.values() if w[0] == which)
            # "tuned" pays off where decode GEMMs dominate; on the tiny default model it did not
            modes = args.vs_vllm_compile if which == "smollm2" else [args.compile]
            engines, runs = {}, {}
            for mode in modes:
                print(f"bench-serve: {name}, engine compile={mode} ...", file=sys.stderr, flush=True)
                engines[mode] = offline_engine(m, seqs, budget, mode, span)
                runs[mode] = offline_runs(engines[mode][0], prompts, new, repeats)
            ckpt = Path(tmp) / "smollm2" if which == "smollm2" else hf_checkpoint_dir(m, args.model_path, tmp)
            job = {"model_path": str(ckpt), "dtype": str(m.dtype).removeprefix("torch."), "repeats": repeats,
                   "requests": [{"prompt": p, "max_new_tokens": new} for p in prompts],
                   "max_num_seqs": seqs, "max_num_batched_tokens": budget, "block_size": 128,
                   "kv_space_gib": 1}
            v = _run_vllm(job, Path(tmp), out, f"vllm_{which}_{len(lens)}")
            for mode in reversed(modes):
                runs[mode] += offline_runs(engines[mode][0], prompts, new, repeats)
                r["engine"][str(mode)] = {"compile": mode, "warmup_s": engines[mode][1],
                                          **median_run(runs[mode])}
            del engines
            if "tokens" in v:
                v["tokens_equal_engine"] = all(e["tokens"] == v["tokens"] for e in r["engine"].values())
                if len(lens) == 1 and v.get("ttft_s"):
                    v["decode_steps_s"] = (new - 1) / (v["duration_s"] - v["ttft_s"][0])
            r["vllm"] = v
            res["workloads"][name] = r
    return res


def _run_vllm(job: dict[str, Any], tmp: Path, out: Path, tag: str) -> dict[str, Any]:
    """scripts/peer_vllm.py in `.venv-vllm` on `job` -> its JSON, or why it did not run."""
    if not VLLM_PYTHON.exists():
        return {"error": f"{VLLM_PYTHON} not found: `make peer-vllm` creates it"}
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    print(f"bench-serve: vLLM peer ({tag}) ...", file=sys.stderr, flush=True)
    run = subprocess.run([str(VLLM_PYTHON), str(VLLM_SCRIPT), str(src), str(dst)],
                         capture_output=True, text=True)
    (out / f"peer_{tag}.log").write_text(run.stdout[-20000:] + run.stderr[-20000:])
    if run.returncode or not dst.exists():
        return {"error": (run.stderr or run.stdout)[-1500:]}
    return json.loads(dst.read_text())


# ---------------------------------------------------------------------------- peers (own processes)
PEERS = ("dense", "hf", "vllm")
VLLM_PYTHON = Path(".venv-vllm/bin/python")
VLLM_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "peer_vllm.py"


def run_peers(model, model_path: str | None, specs: list[Spec], args, out: Path,
              engine_run: Callable[[], float] | None = None, repeats: int = 3) -> dict[str, Any]:
    """The mix, offline, through each peer in a process of its own (a peer's threads in ours
    slowed our decode tenfold once): dense `generate` in static waves of max_num_seqs, Hugging Face
    `generate_batch` (its paged continuous batching), vLLM's CPU build (when `make peer-vllm` made
    its venv; median of `repeats`, with `engine_run`, one offline mix run of our engine -> its
    output tok/s, run `repeats` times just before and just after it). -> each peer's output
    tokens/s and tokens, or why it did not run."""
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = hf_checkpoint_dir(model, model_path, tmp)
        job = {"model_path": str(ckpt), "dtype": str(model.dtype).removeprefix("torch."),
               "requests": [{"prompt": s.prompt, "max_new_tokens": s.max_new_tokens} for s in specs],
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "block_size": 128, "kv_space_gib": 4, "compile": args.compile, "repeats": repeats}
        src = Path(tmp) / "job.json"
        src.write_text(json.dumps(job))
        for peer in args.peers:
            dst = Path(tmp) / f"{peer}.json"
            if peer == "vllm":
                around = [engine_run() for _ in range(repeats)] if engine_run else []
                res[peer] = _run_vllm(job, Path(tmp), out, "vllm")
                around += [engine_run() for _ in range(repeats)] if engine_run else []
                if around:
                    res[peer]["engine_output_tok_s_runs"] = around
                    res[peer]["engine_output_tok_s"] = statistics.median(around)
                continue
            cmd = [sys.executable, "-m", "fms_paged.bench.serve", "--peer", peer, str(src), str(dst)]
            print(f"bench-serve: peer {peer} ...", file=sys.stderr, flush=True)
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode or not dst.exists():
                res[peer] = {"error": (run.stderr or run.stdout)[-1500:]}
                continue
            res[peer] = json.loads(dst.read_text())
            (out / f"peer_{peer}.log").write_text(run.stdout[-20000:] + run.stderr[-20000:])
    return res


def peer_main(peer: str, src: str, dst: str) -> int:
    """One peer of `run_peers`, in this (fresh) process."""
    job = json.loads(Path(src).read_text())
    prompts = [r["prompt"] for r in job["requests"]]
    news = [r["max_new_tokens"] for r in job["requests"]]
    if peer == "dense":  # static waves: a wave runs until its longest request is done
        from fms_paged.generation import generate
        from fms_paged.models import get_model

        model = get_model(model_path=job["model_path"], attn_impl="sdpa", device="cpu",
                          dtype=job["dtype"])
        B, compile = job["max_num_seqs"], job["compile"] in ("auto", True)
        waves = [range(i, min(i + B, len(prompts))) for i in range(0, len(prompts), B)]

        def run() -> list[list[int]]:
            toks = []
            for w in waves:
                out = generate(model, [prompts[i] for i in w], max(news[i] for i in w), eos_id=None,
                               compile=compile)
                toks += [o[: news[i]] for o, i in zip(out, w)]
            return toks

        run()  # warm-up: each wave's cache length is a shape of its own to compile
    elif peer == "hf":
        from transformers import GenerationConfig, LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(job["model_path"], dtype=getattr(torch, job["dtype"])).eval()
        cfg = GenerationConfig(max_new_tokens=max(news), min_new_tokens=max(news), do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            hf.generate_batch(inputs=prompts[:2], generation_config=cfg, progress_bar=False)  # warm-up

        @torch.no_grad()
        def run() -> list[list[int]]:  # one max_new_tokens for all: each is cut to its own
            res = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
            outs = [list(r.generated_tokens) for r in res.values()]
            return [o[:n] for o, n in zip(outs, news)]
    else:
        raise ValueError(f"peer {peer!r}; expected dense or hf (vllm runs scripts/peer_vllm.py)")
    t0 = time.perf_counter()
    tokens = run()
    duration = time.perf_counter() - t0
    out_tokens = sum(map(len, tokens))
    Path(dst).write_text(json.dumps({"tokens": tokens, "duration_s": duration, "output_tokens": out_tokens,
                                     "output_tok_s": out_tokens / duration}))
    return 0


def _f(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [f"## fms_paged `bench-serve` — {env.get('device_name', env.get('device'))}, "
             f"torch {env.get('torch')}, scale {res['scale']}", "",
             "| workload | run | done | req/s | out tok/s | TTFT mean / p99 s | TPOT mean ms | "
             "E2EL p50 s | peak KV pages | preempt | prompt tokens computed | cache hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in res["workloads"].items():
        for run, r in runs.items():
            if not isinstance(r, dict) or "completed" not in r:
                continue
            hit = r.get("prefix_cache_hit_rate")
            lines.append(
                f"| {name} | {run} | {r['completed']} | {_f(r['request_throughput'])} | "
                f"{_f(r['output_tok_s'], '.1f')} | {_f(r['ttft_s']['mean'])} / {_f(r['ttft_s']['p99'])} | "
                f"{_f(r['tpot_s']['mean'] and r['tpot_s']['mean'] * 1e3)} | {_f(r['e2el_s']['p50'])} | "
                f"{r['peak_kv_pages']} | {r['preemptions']} | {r['prompt_tokens_computed']} | "
                f"{'-' if hit is None else f'{100 * hit:.0f}%'} |")
    w = res["workloads"]
    lines.append("")
    if "mix" in w:
        lines.append(f"- mix, each of {w['mix']['alone']['count']} requests alone: TTFT mean "
                     f"{_f(w['mix']['alone']['ttft_s']['mean'])} s")
    if "shared_prefix" in w:
        off, on = w["shared_prefix"]["cache off"], w["shared_prefix"]["cache on"]
        ratio = off["ttft_s"]["mean"] / on["ttft_s"]["mean"]
        lines.append(f"- shared prefix: TTFT mean {_f(off['ttft_s']['mean'])} s off -> "
                     f"{_f(on['ttft_s']['mean'])} s on ({_f(ratio)}x lower); "
                     f"peak pages holding the shared prompt {off['peak_prefix_pages']} -> "
                     f"{on['peak_prefix_pages']}; output tok/s {_f(off['output_tok_s'], '.1f')} -> "
                     f"{_f(on['output_tok_s'], '.1f')}")
    if "multi_turn" in w:
        mt = w["multi_turn"]
        lines.append(f"- multi-turn: prompt tokens computed {mt['cache off']['prompt_tokens_computed']} off, "
                     f"{mt['cache on']['prompt_tokens_computed']} on; new prompt tokens "
                     f"{mt['new_prompt_tokens']} (+ the last output token of each turn)")
    if "parallel" in w:
        a, b = w["parallel"]["n=8"], w["parallel"]["8 separate"]
        lines.append(f"- n=8 vs 8 separate requests: peak KV pages {a['peak_kv_pages']} vs "
                     f"{b['peak_kv_pages']}; output tok/s {_f(a['output_tok_s'], '.1f')} vs "
                     f"{_f(b['output_tok_s'], '.1f')}")
    for peer, r in res.get("peers", {}).items():
        if "error" in r:
            lines.append(f"- peer {peer}: did not run ({r['error'].strip().splitlines()[-1][:200]})")
        else:
            around = ""
            if "engine_output_tok_s" in r:  # the engine's runs on both sides of the peer's
                runs = ", ".join(f"{x:.0f}" for x in r["engine_output_tok_s_runs"])
                around = f" (engine {_f(r['engine_output_tok_s'], '.1f')}: median of {runs} just around it)"
            lines.append(f"- peer {peer}, offline mix: {_f(r['output_tok_s'], '.1f')} output tok/s; "
                         f"engine / {peer} = {_f(r['engine_speedup'])}x{around}; greedy tokens "
                         f"{'equal' if r['tokens_equal_engine'] else 'DIFFER'}")
    for c in res.get("capacity", []):
        lines.append(f"- capacity, KV budget of a dense cache of {c['dense_concurrency']} x {c['max_len']} "
                     f"tokens ({c['kv_budget_bytes'] / 2**20:.0f} MiB): the engine ran up to "
                     f"{c['engine_peak_running']} mix requests at once ({_f(c['ratio'])}x dense)")
    lines.append("- greedy tokens equal across the runs of each workload: " + ", ".join(
        f"{k} {'yes' if v.get('tokens_equal') else 'NO'}" for k, v in w.items()))
    if res.get("page_sweep"):
        first = res["page_sweep"][0]["page_size"]
        lines += ["", "### Page size sweep (offline mix, prefix cache off; multi-turn, cache on)", "",
                  f"| page size | out tok/s | TTFT mean s | TPOT mean ms | decode ms/step, 8 rows up to "
                  f"{res['args']['sweep_context']} | KV fill of pages in use | "
                  "peak KV tokens | multi-turn hit rate | multi-turn prompt tokens computed | "
                  f"tokens = page {first}'s | warm-up s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["page_sweep"]:
            hit = r["multi_turn_hit_rate"]
            lines.append(
                f"| {r['page_size']} | {_f(r['output_tok_s'], '.1f')} | {_f(r['ttft_mean_s'])} | "
                f"{_f(r['tpot_mean_s'] and r['tpot_mean_s'] * 1e3)} | {_f(r['long_decode_ms'])} | "
                f"{_f(r['kv_fill_mean'] and 100 * r['kv_fill_mean'], '.1f')}% | {r['peak_kv_tokens']} | "
                f"{'-' if hit is None else f'{100 * hit:.0f}%'} | {r['multi_turn_prompt_tokens_computed']} | "
                f"{'yes' if r['tokens_equal_first'] else 'NO'} | {_f(r['warmup_s'], '.0f')} |")
    if res.get("split_kv"):
        parts = list(res["split_kv"][0]["ms_per_step"])
        lines += ["", "### Split-KV decoding (`PARTITION_SIZE`), MHA twin, compiled decode step ms", "",
                  "| context | sequences | " + " | ".join(f"PARTITION_SIZE {p}" for p in parts) + " |",
                  "|---|---|" + "---|" * len(parts)]
        for r in res["split_kv"]:
            lines.append(f"| {r['context']} | {r['batch']} | "
                         + " | ".join(_f(r["ms_per_step"][p]) for p in parts) + " |")
    if "vs_vllm" in res:
        lines += vs_vllm_markdown(res["vs_vllm"])
    if res.get("phase_s"):
        parts = ", ".join(f"{k} {v:.0f}" for k, v in res["phase_s"].items())
        lines += ["", f"Wall time of each part (s): {parts}"]
    return "\n".join(lines) + "\n"


def vs_vllm_markdown(vs: dict[str, Any]) -> list[str]:
    n = vs.get("repeats", 3)
    lines = ["", f"### Engine vs vLLM (read bandwidth {vs['read_bandwidth_gbs']:.1f} GB/s; median of {n} "
             f"vLLM runs, engine median of {2 * n}: {n} before and {n} after vLLM's)", "",
             "| workload | system | output tok/s | engine / vLLM | decode steps/s (% of roofline) | "
             "start-up s (engine warm-up; vLLM init) | greedy tokens |", "|---|---|---|---|---|---|---|"]
    for name, r in vs["workloads"].items():
        v = r["vllm"]
        rows = [(f"engine compile={mode}", e) for mode, e in r["engine"].items()] + [("vLLM CPU", v)]
        for system, x in rows:
            if "error" in x:
                why = x["error"].strip().splitlines()[-1][:120]
                lines.append(f"| {name} | {system} | did not run: {why} | | | | |")
                continue
            ratio = x["output_tok_s"] / v["output_tok_s"] if x is not v and "output_tok_s" in v else None
            steps = x.get("decode_steps_s") if len(x["tokens"]) == 1 else None
            roof = "-" if steps is None else f"{steps:.1f} ({100 * steps / r['roofline_steps_s']:.0f}%)"
            same = "-" if x is v else ("equal" if v.get("tokens") == x["tokens"] else
                                       "DIFFER" if "tokens" in v else "-")
            lines.append(f"| {name} | {system} | {x['output_tok_s']:.1f} | {_f(ratio, '.2f')} | {roof} | "
                         f"{_f(x['warmup_s'] if x is not v else x.get('init_s'), '.1f')} | {same} |")
    return lines


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    w = res["workloads"]
    timed = [(f"{name}: {run}", r) for name, runs in w.items() for run, r in runs.items()
             if isinstance(r, dict) and r.get("timeline")]
    if timed:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4))
        for label, r in timed:
            t = [x[0] for x in r["timeline"]]
            ax[0].plot(t, [x[1] for x in r["timeline"]], label=label)
            ax[1].plot(t, [x[2] for x in r["timeline"]], label=label)
        ax[0].set(xlabel="s", ylabel="KV pages in use", title="KV pages in use over time")
        ax[1].set(xlabel="s", ylabel="running requests", title="running requests over time")
        ax[0].legend(fontsize=6)
        fig.tight_layout()
        paths.append(out / "serve_timeline.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if "mix" in w:
        runs = [r for r in w["mix"].values() if isinstance(r, dict) and r.get("rate")]
        if runs:
            fig, ax = plt.subplots(1, 2, figsize=(10, 4))
            rates = [r["rate"] for r in runs]
            ax[0].plot(rates, [r["output_tok_s"] for r in runs], "o-")
            ax[0].set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="throughput")
            ax[1].plot(rates, [r["ttft_s"]["mean"] for r in runs], "o-", label="mean")
            ax[1].plot(rates, [r["ttft_s"]["p99"] for r in runs], "s--", label="p99")
            ax[1].set(xlabel="request rate (req/s)", ylabel="TTFT (s)", title="TTFT")
            ax[1].legend()
            fig.tight_layout()
            paths.append(out / "serve_rate.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    if res.get("page_sweep"):
        rows = res["page_sweep"]
        sizes = [r["page_size"] for r in rows]
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        for a, key, label in ((ax[0], "output_tok_s", "mix output tokens/s"),
                              (ax[1], "kv_fill_mean", "KV fill of the pages in use"),
                              (ax[2], "multi_turn_hit_rate", "multi-turn prefix cache hit rate")):
            a.plot(sizes, [r[key] for r in rows], "o-")
            a.set(xscale="log", xlabel="page size (tokens)", title=label, ylim=(0, None))
            a.minorticks_off()
            a.set_xticks(sizes, [str(x) for x in sizes])
        fig.tight_layout()
        paths.append(out / "serve_page_sizes.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fms-paged bench --scenario serve",
                                description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group()
    m.add_argument("--variant", help="a registered variant (random weights)")
    m.add_argument("--model-path", help="a Hugging Face LLaMA checkpoint (default: the embedded model)")
    p.add_argument("--workloads",
                   default="mix,shared_prefix,multi_turn,parallel,page_sizes,capacity,vs_vllm")
    p.add_argument("--page-sizes", type=_ints, default=[16, 32, 64, 128],
                   help="page sizes of the page_sizes sweep")
    p.add_argument("--split-kv-contexts", type=_ints, default=[2048, 8192],
                   help="contexts of the split_kv workload (not in the default --workloads)")
    p.add_argument("--partition-sizes", type=_ints, default=[128, 512, 2048],
                   help="PARTITION_SIZE values of the split_kv workload (inductor's default: 128)")
    p.add_argument("--sweep-context", type=int, default=8192,
                   help="the page sweep's decode batch: 8 sequences of this / 8 .. this many tokens")
    p.add_argument("--vs-vllm-compile", type=lambda x: [{"true": True, "false": False}.get(v, v)
                                                         for v in x.split(",")],
                   default=["auto"],
                   help="engine compile modes of the SmolLM2-shaped vs_vllm runs, e.g. auto,tuned "
                   "(the default-model one uses --compile). \"tuned\" compiles its frozen graphs in "
                   "every process: 2-3 more minutes on a 2-core CPU")
    p.add_argument("--capacity-lens", type=_ints,
                   default=[2048, 32768], help="max_seq_len of the capacity comparison")
    p.add_argument("--num-requests", type=int, default=None, help="requests of the mix (default 64)")
    p.add_argument("--rate-fractions", type=lambda x: [float(v) for v in x.split(",")],
                   default=[0.25, 0.5, 1.0], help="online request rates, as fractions of the offline "
                   "request throughput")
    p.add_argument("--scale", type=float, default=None, help="multiply every length (default auto)")
    p.add_argument("--prefix-requests", type=int, default=64, help="requests of the shared-prefix workload")
    p.add_argument("--prefix-scale", type=float, default=1.0,
                   help="multiply the shared-prefix workload's lengths (default 1: a 1024-token prompt)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-pages", type=int, default=None, help="default: sized by memory")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: the device's, fms_paged.device.DEFAULT_PAGE_SIZE)")
    p.add_argument("--compile", default="auto", type=lambda x: {"true": True, "false": False}.get(x, x),
                   help="the engine's compile mode: auto | true | false")
    p.add_argument("--peers", type=lambda x: [v for v in x.split(",") if v], default=list(PEERS),
                   help="peers run on the offline mix, each in its own process: dense, hf, vllm "
                   "(vllm needs `make peer-vllm`); '' for none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench-serve")
    return p


def main(argv: list[str] | None = None) -> int:
    from fms_paged.bench.environment import auto_scale, environment_info
    from fms_paged.device import keep_freed_cpu_memory, resolve_device
    from fms_paged.models import get_model

    argv = sys.argv[1:] if argv is None else list(argv)
    keep_freed_cpu_memory()  # this process serves: glibc keeps freed buffers (vLLM's peer: tcmalloc)
    if argv[:1] == ["--peer"]:  # a peer's own process (see run_peers)
        return peer_main(*argv[1:4])
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    args.scale, why = auto_scale(device, args.scale)
    kw = dict(variant=args.variant) if args.variant else dict(model_path=args.model_path)
    if args.page_size is not None:
        kw["page_size"] = args.page_size
    model = get_model(**kw, attn_impl="paged", device=device).eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"environment": environment_info(device), "scale": args.scale,
                           "scale_why": why, "args": {k: v for k, v in vars(args).items()}}
    res.update(run_all(args, model))
    if args.peers and "mix" in res["workloads"]:
        t0 = time.perf_counter()
        specs = workload("mix", args.scale, model.config.src_vocab_size, args.seed, args.num_requests)
        kw = _engine_kw(args, model)
        res["peers"] = run_peers(model, args.model_path, specs, args, out,
                                 lambda: serve(model, specs, kw)["output_tok_s"])
        ours = res["workloads"]["mix"]["offline"]
        for r in res["peers"].values():
            if "tokens" in r:
                r["tokens_equal_engine"] = r["tokens"] == ours["tokens"]
                r["engine_speedup"] = r.get("engine_output_tok_s", ours["output_tok_s"]) / r["output_tok_s"]
        res["phase_s"]["peers"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (out / "results.md").write_text(md)
    plots(res, out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
