"""`make bench-tp`: what tensor parallelism costs a step on this machine. The same batch through
`Engine(..., tensor_parallel_size=N)` for N = 1 and more, on the default model and on a seeded
random model of SmolLM2-135M's shape; runs alternate one rank / N ranks (A B A B) and the medians
are kept.

Per run: the prefill phase (every prompt prefilled, in chunks of the step budget) and the decode
steps after it (every request decoding), the median decode step, and the time rank 0 spends
inside the split model's collectives (`fms_paged.parallel.clock`: the all-reduces after the
attention output and MLP down projections and the logits gather, waiting for the other ranks
included), per decode step. Eager steps: the collectives are timed one by one there. The ranks are
spawned on this host and share its cores (each `cores // N` threads), so on a small CPU the point
is the collectives' cost, not a speed-up. A size that does not divide the model's heads is
recorded with the refusal's message.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.bench import environment as bench_env
from fms_paged.bench.report import table
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.parallel import TensorParallelError, clock, layout

MODELS = ("default", "smollm2")
# SmolLM2-135M's shape (its weights are not shipped or downloaded: a seeded random model stands in; a
# step's speed does not depend on the values); the peer drivers' vs_vllm workloads use it too
SMOLLM2_135M = dict(src_vocab_size=49152, emb_dim=576, nheads=9, kvheads=3, nlayers=30,
                    hidden_grow_factor=1536 / 576, multiple_of=1, rope_theta=100000.0,
                    max_expected_seq_len=8192, tie_heads=True)
# SmolLM2-135M has 9 query heads and 3 kv heads: 2 ranks do not divide them, 3 do
SIZES = {"default": (2,), "smollm2": (2, 3)}


def build(which: str) -> torch.nn.Module:
    if which == "default":
        return get_model(attn_impl="paged", device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaMA(LLaMAConfig(**SMOLLM2_135M, attn_impl="paged", page_size=16))
        model.reset_parameters()
    return model.eval()


def one_run(which: str, size: int, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """The batch through a fresh engine of `size` ranks -> its phases' times."""
    model = build(which)
    budget = 256
    eng = Engine(model, max_num_seqs=len(prompts), max_num_batched_tokens=budget, compile=False,
                 num_pages=len(prompts) * (max(map(len, prompts)) + new) // model.config.page_size + 8,
                 max_model_len=max(map(len, prompts)) + new, tensor_parallel_size=size)
    try:
        for p in prompts:
            eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
        started: set[int] = set()
        prefill_s, decode, coll, calls = 0.0, [], [], []
        clock.on, clock.calls, clock.seconds = True, 0, 0.0
        t_start = time.perf_counter()
        while eng.has_unfinished():
            c0, n0, t0 = clock.seconds, clock.calls, time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            if len(started) < len(prompts):  # still prefilling
                started |= {o.request_id for o in outs if o.new_token_ids}
                prefill_s = time.perf_counter() - t_start
            elif outs:
                decode.append(dt)
                coll.append(clock.seconds - c0)
                calls.append(clock.calls - n0)
    finally:
        clock.on = False
        eng.shutdown()
    med = statistics.median(decode)
    return {"prefill_s": prefill_s, "decode_step_ms": 1e3 * med, "decode_steps": len(decode),
            "collective_ms_per_step": 1e3 * statistics.median(coll),
            "collectives_per_step": statistics.median(calls) if calls else 0,
            "threads_per_rank": max(1, torch.get_num_threads() // size)}


def bench(which: str, sizes: tuple[int, ...], batch: int, prompt_len: int, new: int, pairs: int,
          log) -> dict[str, Any]:
    model = build(which)
    c = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, c.src_vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    res: dict[str, Any] = {"model": which, "layers": c.nlayers, "heads": c.nheads, "kv_heads": c.kvheads,
                           "emb_dim": c.emb_dim, "sizes": {}}
    for size in sizes:
        try:
            layout(c.nheads, c.kvheads, model.layers[0].ff_sub_module.wg.out_features, size)
        except TensorParallelError as e:
            res["sizes"][size] = {"refused": str(e)}
            log(f"[bench-tp] {which}, {size} ranks: refused: {e}")
            continue
        runs: dict[int, list[dict]] = {1: [], size: []}
        for _ in range(pairs):  # A B A B
            for n in (1, size):
                runs[n].append(one_run(which, n, prompts, new))
        for n in (1, size):
            keys = runs[n][0].keys()
            row = {k: statistics.median(r[k] for r in runs[n]) for k in keys}
            res["sizes"][n] = row
            log(f"[bench-tp] {which}, {n} rank(s): decode step {row['decode_step_ms']:.2f} ms, "
                f"collectives {row['collective_ms_per_step']:.2f} ms/step, prefill {row['prefill_s']:.2f} s")
    return res


def markdown(results: dict[str, Any]) -> str:
    env, w = results["environment"], results["workload"]
    lines = [f"# bench-tp: {env.get('cpu_model')}, {env.get('cpu_count')} cores, torch {env.get('torch')}",
             "", f"{w['batch']} prompts of {w['prompt_len']} tokens, {w['new']} new each, fp32, eager "
             f"steps, medians of {w['pairs']} alternated runs per size.", ""]
    rows = []
    for m in results["models"]:
        base = m["sizes"].get(1) or m["sizes"].get("1") or {}
        for n, r in sorted(m["sizes"].items(), key=lambda kv: int(kv[0])):
            row = {"model": m["model"], "ranks": int(n), **r}
            if "refused" not in r and base:
                row["ratio"] = r["decode_step_ms"] / base["decode_step_ms"]
            rows.append(row)
    lines.append(table(rows, [("model", "model", ""), ("ranks", "ranks", "d"),
                              ("threads / rank", "threads_per_rank", "d"),
                              ("decode step ms", "decode_step_ms", ".2f"), ("vs 1 rank", "ratio", ".2f"),
                              ("collectives ms / step", "collective_ms_per_step", ".2f"),
                              ("collectives / step", "collectives_per_step", ".0f"),
                              ("prefill s", "prefill_s", ".2f"), ("refused", "refused", "")]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/bench-tp"))
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--pairs", type=int, default=2, help="A B pairs (one rank, N ranks) per size")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"environment": bench_env.environment_info(torch.device("cpu")),
               "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "new": args.new,
                            "pairs": args.pairs}, "models": []}
    for which in args.models.split(","):
        results["models"].append(bench(which, SIZES[which], args.batch, args.prompt_len, args.new,
                                       args.pairs, lambda s: print(s, flush=True)))
    (args.out / "bench_tp.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (args.out / "bench_tp.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
