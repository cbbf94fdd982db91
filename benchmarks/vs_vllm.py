"""`vs_vllm`: the engine and vLLM's CPU build side by side on the workloads vLLM was first measured
on, in bf16 (vLLM's CPU default) and in fp32, each in a process of its own, with the decode
roofline, each dtype's warm start, and the half-precision targets met or missed."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers import around_vllm, hf_checkpoint_dir, offline_engine, peer_command, peer_job, run_peer
from fms_paged.bench.environment import kv_bytes_per_token, measure_read_bandwidth, weight_bytes
from fms_paged.bench.report import table
from fms_paged.bench.tp import SMOLLM2_135M
from fms_paged.engine import Engine, SamplingParams
from fms_paged.models import get_model
from fms_paged.models.hf import save_hf_llama
from fms_paged.models.llama import LLaMA, LLaMAConfig

# engine vs vLLM: (model, prompt lengths, new tokens per request, max_num_seqs, max_num_batched_tokens).
# "smollm2": a seeded random model of SmolLM2-135M's shape (its weights are not shipped or downloaded;
# a step's speed does not depend on their values); "default": the benchmark's model.
VS_VLLM = {
    "SmolLM2-135M shape, 4 prompts 32..128, 64 new": ("smollm2", [32, 64, 96, 128], 64, 4, 512),
    "SmolLM2-135M shape, 1 prompt of 64, 64 new": ("smollm2", [64], 64, 4, 512),
    "default model, 16 prompts 62..1000, 16 new": (
        "default", [round(62 + i * (1000 - 62) / 15) for i in range(16)], 16, 16, 1024),
}


def offline_runs(eng: Engine, prompts: list[list[int]], new: int, repeats: int) -> list[dict[str, Any]]:
    """`repeats` offline runs of `prompts` (`new` tokens each) -> each run's seconds, output tok/s,
    decode steps/s (1 / mean TPOT) and tokens."""
    runs = []
    for _ in range(repeats):
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
        got: dict[int, list[int]] = {}
        stats: dict[int, dict] = {}  # each request's final statistics (`RequestOutput.stats`)
        t0 = time.perf_counter()
        for out in eng.stream():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                stats[out.request_id] = out.stats
        dt = time.perf_counter() - t0
        runs.append({"duration_s": dt, "output_tok_s": len(prompts) * new / dt,
                     "decode_steps_s": 1 / statistics.fmean(stats[i]["tpot"] for i in ids),
                     "tokens": [got[i] for i in ids]})
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with every run's throughput listed."""
    mid = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    return {**mid, "output_tok_s_runs": [r["output_tok_s"] for r in runs],
            "tokens_equal_runs": all(r["tokens"] == runs[0]["tokens"] for r in runs)}


# vLLM's CPU default first: an fp32 checkpoint runs in bf16 under its dtype="auto" on x86
VS_VLLM_DTYPES = ("bfloat16", "float32")
# the targets on the vs_vllm workloads, in bf16 against vLLM in bf16 (`vs_vllm_targets`)
VS_VLLM_RATIO, VS_VLLM_DECODE_RATIO, ROOFLINE_SHARE, WARM_START_RATIO = 1.0, 1.3, 0.8, 1.2


def vs_vllm(args, model, model_path: str | None, out, log=print, repeats: int = 3,
            dtypes: tuple[str, ...] = VS_VLLM_DTYPES) -> dict[str, Any]:
    """Each `VS_VLLM` workload in each of `dtypes` through the engine (`args.compile`, `around_vllm`)
    and vLLM (same settings and dtype, median of `repeats`), with the decode roofline: the read
    bandwidth measured here over the bytes a decode step reads (every weight once, and the live
    K/V, in that dtype). Then each dtype's warm start: a fresh process building the default model's
    engine and warming it up once this run has filled the compile caches (`warm_start`)."""
    bw = measure_read_bandwidth(model.device)
    res: dict[str, Any] = {"read_bandwidth_gbs": bw, "workloads": {}, "repeats": repeats,
                           "dtypes": list(dtypes), "warm_start_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpts = {"default": hf_checkpoint_dir(model, model_path, tmp)}
        spans: dict[str, int] = {}  # one max_model_len per model: the same step shapes, graphs reused
        for which, lens, new, *_ in VS_VLLM.values():
            spans[which] = max(spans.get(which, 0), max(lens) + new)
        for dtype in dtypes:
            models: dict[str, torch.nn.Module] = {}
            for name, (which, lens, new, seqs, budget) in VS_VLLM.items():
                if which not in ckpts:  # seeded, without touching the caller's RNG state
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(0)
                        smol = LLaMA(LLaMAConfig(**SMOLLM2_135M))
                        smol.reset_parameters()
                    ckpts[which] = tmp / which
                    save_hf_llama(smol, ckpts[which])
                if which not in models:
                    models[which] = get_model(model_path=ckpts[which], attn_impl="paged",
                                              device=model.device, dtype=dtype)
                m = models[which]
                g = torch.Generator().manual_seed(args.seed)
                vocab = m.config.src_vocab_size
                prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
                log(f"[bench-serve] {name}, {dtype}: engine compile={args.compile} ...")
                eng, warm = offline_engine(m, seqs, budget, args.compile, spans[which])
                job = peer_job(ckpts[which], m, prompts, [new] * len(lens), seqs, budget, kv_space_gib=1,
                               repeats=repeats)
                v, runs = around_vllm(job, tmp, out, f"vllm_{which}_{len(lens)}_{dtype}",
                                      lambda e=eng, p=prompts, n=new: offline_runs(e, p, n, 1)[0],
                                      repeats, log)
                del eng
                e = {"compile": args.compile, "warmup_s": warm, **median_run(runs)}
                if "tokens" in v:
                    v["tokens_equal_engine"] = v["tokens"] == e["tokens"]
                    v["token_agreement"] = token_agreement(v["tokens"], e["tokens"])
                    if len(lens) == 1 and v.get("ttft_s"):
                        v["decode_steps_s"] = (new - 1) / (v["duration_s"] - v["ttft_s"][0])
                read = weight_bytes(m) + (max(lens) + new) * kv_bytes_per_token(m.config, m.dtype)  # bytes
                res["workloads"].setdefault(name, {})[dtype] = {
                    "roofline_steps_s": bw * 1e9 / read, "engine": e, "vllm": v}
        for dtype in dtypes:
            which, lens, new, seqs, budget = VS_VLLM[DEFAULT_WORKLOAD]
            log(f"[bench-serve] warm start of the default model's engine, {dtype} ...")
            job = {"model_path": str(ckpts[which]), "dtype": dtype, "device": str(model.device),
                   "max_num_seqs": seqs, "max_num_batched_tokens": budget, "max_model_len": spans[which],
                   "compile": args.compile, "requests": []}
            res["warm_start_s"][dtype] = run_peer(peer_command("warm"), job, tmp, out, f"warm_{dtype}")
    return res


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of positions at which two systems' tokens for the same requests are equal (up
    to the shorter of each pair): in half precision, greedy tokens may part where two logits are
    within rounding of each other, so equality is reported as a share, not a flag."""
    pairs = [(x, y) for u, w in zip(a, b) for x, y in zip(u, w)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


DEFAULT_WORKLOAD = "default model, 16 prompts 62..1000, 16 new"
VS_COLUMNS = [("workload", "workload", ""), ("dtype", "dtype", ""), ("system", "system", ""),
              ("output tok/s", "output_tok_s", ".1f"), ("engine / vLLM, same dtype", "ratio", ".2f"),
              ("decode steps/s (% of roofline)", "steps", ""),
              ("start-up s (engine warm-up; vLLM init)", "startup_s", ".1f"),
              ("greedy tokens equal", "same", "")]


def _ratio(r: dict[str, Any]) -> float | None:
    e, v = r["engine"], r["vllm"]
    return e["output_tok_s"] / v["output_tok_s"] if "output_tok_s" in v and "output_tok_s" in e else None


def vs_vllm_markdown(vs: dict[str, Any]) -> list[str]:
    n, rows = vs.get("repeats", 3), []
    for name, by_dtype in vs["workloads"].items():
        for dtype, r in by_dtype.items():
            e, v = r["engine"], r["vllm"]
            for system, x in ((f"engine compile={e['compile']}", e), ("vLLM CPU", v)):
                if "error" in x:
                    why = x["error"].strip().splitlines()[-1][:120]
                    rows.append({"workload": name, "dtype": dtype, "system": system,
                                 "output_tok_s": f"did not run: {why}"})
                    continue
                steps = x.get("decode_steps_s") if len(x["tokens"]) == 1 else None
                same = None
                if x is e and "token_agreement" in v:
                    agree = v["token_agreement"]
                    same = "all" if v["tokens_equal_engine"] else f"{100 * agree:.0f}% of positions"
                roof = steps and f"{steps:.1f} ({100 * steps / r['roofline_steps_s']:.0f}%)"
                rows.append({"workload": name, "dtype": dtype, "system": system,
                             "output_tok_s": x["output_tok_s"], "ratio": _ratio(r) if x is e else None,
                             "steps": roof, "startup_s": x.get("warmup_s") if x is e else x.get("init_s"),
                             "same": same})
    lines = ["", f"### Engine vs vLLM (read bandwidth {vs['read_bandwidth_gbs']:.1f} GB/s; median of {n} "
             f"vLLM runs, engine median of {2 * n}: {n} before and {n} after vLLM's)", "",
             table(rows, VS_COLUMNS)]
    warm = {d: w for d, w in vs.get("warm_start_s", {}).items() if "start_s" in w}
    if warm:
        each = "; ".join(f"{d} {w['start_s']:.1f} s (warm-up {w['warmup_s']:.1f} s)" for d, w in warm.items())
        lines += ["", "Warm start of the default model's engine (a fresh process, compile caches filled): "
                  + each]
    targets = vs_vllm_targets(vs)
    if targets:
        columns = [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")]
        lines += ["", table(targets, columns)]
    return lines


def vs_vllm_targets(vs: dict[str, Any]) -> list[dict[str, str]]:
    """The half-precision targets, each with what was measured and whether it was met: the engine in
    bf16 against vLLM in bf16 (its default) on every workload and on the decode workloads, one
    request's bf16 decode against the roofline, and a bf16 engine's warm start against fp32's."""
    rows = []
    bf = {name: d["bfloat16"] for name, d in vs["workloads"].items() if "bfloat16" in d}
    ratios = {name: _ratio(r) for name, r in bf.items()}
    if ratios and None not in ratios.values():
        decode = {k: x for k, x in ratios.items() if k != DEFAULT_WORKLOAD}
        rows.append({"target": f"bf16 output tok/s >= {VS_VLLM_RATIO}x vLLM bf16 on every workload",
                     "measured": ", ".join(f"{x:.2f}x" for x in ratios.values()),
                     "met": "yes" if min(ratios.values()) >= VS_VLLM_RATIO else "no"})
        if decode:
            rows.append({"target": f"bf16 >= {VS_VLLM_DECODE_RATIO}x vLLM bf16 on the decode workloads",
                         "measured": ", ".join(f"{x:.2f}x" for x in decode.values()),
                         "met": "yes" if min(decode.values()) >= VS_VLLM_DECODE_RATIO else "no"})
    for name, r in bf.items():
        e = r["engine"]
        if len(e.get("tokens", [])) == 1:
            share = e["decode_steps_s"] / r["roofline_steps_s"]
            rows.append({"target": f"one-request bf16 decode >= {ROOFLINE_SHARE:.0%} of the read roofline "
                                   f"({name})",
                         "measured": f"{share:.0%}", "met": "yes" if share >= ROOFLINE_SHARE else "no"})
    warm = vs.get("warm_start_s", {})
    if all("start_s" in warm.get(d, {}) for d in ("bfloat16", "float32")):
        ratio = warm["bfloat16"]["start_s"] / warm["float32"]["start_s"]
        rows.append({"target": f"bf16 engine's warm start <= {WARM_START_RATIO}x fp32's",
                     "measured": f"{ratio:.2f}x", "met": "yes" if ratio <= WARM_START_RATIO else "no"})
    return rows
