"""`fms-paged bench` / `scripts/benchmark_inference.py`: latency, memory, perplexity and peers of the
dense (sdpa) and paged backends, on the same weights, in one run.

    python scripts/benchmark_inference.py --attn-impl both --scenario all --out results/compare
    python scripts/benchmark_inference.py --variant micro --scale 0.01 --no-compile --no-memory

Writes <out>/results.json (raw figures + environment), results.csv, results.md (also printed) and
PNG plots; `--wandb` also logs them (offline when no API key is configured).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fms_paged.bench import environment as envmod
from fms_paged.bench import latency
from fms_paged.bench.memory import measure_peak
from fms_paged.bench.report import markdown, write_all

IMPLS = {"sdpa": ["sdpa"], "paged": ["paged"], "both": ["sdpa", "paged"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fms-paged bench", description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group()
    m.add_argument("--variant", help="a registered variant (random weights), e.g. micro, 7b, 3-8b")
    m.add_argument("--model-path", help="a Hugging Face LLaMA checkpoint directory")
    p.add_argument("--attn-impl", choices=sorted(IMPLS), default="both")
    p.add_argument(
        "--scenario",
        default="all",
        help="single | mixed | chat | decode | all (= single,mixed,chat) | none, comma-separated; "
        "serve alone runs the serving benchmark (fms_paged.bench.serve, its own options)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the model's)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="paged kernel: compiled flex (--compile) or GATHER+SDPA (--no-compile); default auto",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every length (default auto: 1.0 on CUDA, smaller on CPU/MPS)",
    )
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per sequence/turn")
    p.add_argument("--warmup", type=int, default=2, help="decode steps left out of the statistics")
    p.add_argument("--decode-steps", type=int, default=20, help="timed steps per decode-benchmark case")
    p.add_argument("--compile-step", action="store_true",
                   help="scenarios: run each decode step as one compiled graph (both backends)")
    p.add_argument(
        "--decode-modes",
        default=",".join(latency.DECODE_MODES),
        help="decode benchmark: eager (model op by op) and/or compiled (whole step compiled, both "
        "backends), comma-separated",
    )
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peak memory per configuration (CPU: a fresh subprocess each)",
    )
    p.add_argument("--ppl", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ppl-chars", type=int, default=20_000, help="characters of evaluation text")
    p.add_argument("--ppl-window", type=int, default=256)
    p.add_argument(
        "--dataset",
        choices=["stdlib", "wikitext"],
        default="stdlib",
        help="perplexity text: the stdlib held-out split, or WikiText-103 test (downloads)",
    )
    p.add_argument("--text-file", help="perplexity text from this file instead")
    p.add_argument("--peers", action="store_true",
                   help="also run HF transformers and torch peers (in a process of their own)")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline without a key)")
    p.add_argument("--wandb-project", default="fms-paged-bench")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page of the paged backend (default: the model config's, 16)")
    p.add_argument("--nlayers", type=int, default=None,
                   help="with --variant: only the first N layers (the variant's layer shapes at a "
                   "fraction of the cost)")
    p.add_argument("--name", default=None, help="run name (default: the --out folder's name)")
    p.add_argument("--out", default="results/bench")
    return p


def model_spec(args, device: torch.device) -> tuple[dict[str, Any], str]:
    """-> (spec for `latency.load_model`, a description). Falls back to `micro` (announced) when no
    model is named and the embedded default model is missing."""
    from fms_paged.models.registry import default_model_path

    spec: dict[str, Any] = {"device": str(device), "dtype": args.dtype, "seed": args.seed,
                            "page_size": args.page_size}
    if args.variant:
        if args.nlayers:
            return ({**spec, "variant": args.variant, "nlayers": args.nlayers},
                    f"variant {args.variant}, first {args.nlayers} layers (random weights)")
        return {**spec, "variant": args.variant}, f"variant {args.variant} (random weights)"
    if args.model_path:
        return {**spec, "model_path": str(args.model_path)}, f"checkpoint {args.model_path}"
    path = default_model_path()
    if (path / "config.json").is_file():
        return {**spec, "model_path": str(path)}, f"default model {path}"
    print(f"[bench] the default model is missing at {path}; using --variant micro", file=sys.stderr)
    return {**spec, "variant": "micro"}, "variant micro (default model missing)"


def eval_tokens(args, model, model_path: str | None) -> tuple[list[int], str]:
    """Token ids of the perplexity text; a model without a tokenizer reads bytes (mod vocab)."""
    if args.text_file:
        text, what = Path(args.text_file).read_text(encoding="utf-8", errors="replace"), args.text_file
    elif args.dataset == "wikitext":
        try:
            from datasets import load_dataset
        except ImportError:
            raise SystemExit(
                "--dataset wikitext needs the `datasets` package (pip install datasets)"
            ) from None
        ds = load_dataset("wikitext", "wikitext-103-raw-v1", split="test")
        text, what = "".join(ds["text"]), "WikiText-103 test"
    else:
        from fms_paged.data.stdlib_corpus import heldout_text

        text, what = heldout_text(args.ppl_chars), "stdlib held-out split"
    text = text[: args.ppl_chars]
    if model_path and any((Path(model_path) / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
        from fms_paged.tokenizers import load_tokenizer

        return load_tokenizer(model_path).encode(text, bos=False), f"{what}, {len(text)} chars"
    vocab = model.config.src_vocab_size
    return [b % vocab for b in text.encode("utf-8")], f"{what}, {len(text)} chars as bytes"


@contextlib.contextmanager
def _force_gather(on: bool):
    """`make_cache` picks the paged kernel itself; FMS_PAGED_FORCE_GATHER makes it GATHER+SDPA."""
    old = os.environ.get("FMS_PAGED_FORCE_GATHER")
    if on:
        os.environ["FMS_PAGED_FORCE_GATHER"] = "1"
    try:
        yield
    finally:
        if on and old is None:
            os.environ.pop("FMS_PAGED_FORCE_GATHER", None)


def perplexity_all(model, impls, ids, window: int, kernel: str) -> dict[str, Any]:
    """Perplexity with the KV cache through each backend, and without any cache (the reference)."""
    from fms_paged.bench.perplexity import perplexity

    window = min(window, model.config.max_expected_seq_len)
    ref = perplexity(model, ids, window=window, use_cache=False)
    by = {"no-cache": dict(ref)}
    for impl in tqdm(impls, desc="perplexity", disable=None):
        with _force_gather(impl == "paged" and kernel == "gather"):
            r = perplexity(latency.with_config(model, attn_impl=impl), ids, window=window, use_cache=True)
        r["rel_diff_vs_reference"] = abs(r["ppl"] - ref["ppl"]) / ref["ppl"]
        by[impl] = r
    out: dict[str, Any] = {"by_backend": by, "tokens": ref["tokens"], "window": window}
    if "sdpa" in by and "paged" in by:
        out["ratio_paged_dense"] = by["paged"]["ppl"] / by["sdpa"]["ppl"]
        out["rel_diff_paged_dense"] = abs(by["paged"]["ppl"] - by["sdpa"]["ppl"]) / by["sdpa"]["ppl"]
    return out


def compare(res: dict[str, Any], mem: dict[str, Any]) -> dict[str, Any]:
    """paged / dense ratios of one scenario measured in the same run."""
    d, p = res["sdpa"], res["paged"]
    ratio = lambda a, b: a / b if a is not None and b else None
    out = {
        "ttft": ratio(p["ttft_ms"], d["ttft_ms"]),
        "per_token": ratio(p["per_token"]["mean_ms"], d["per_token"]["mean_ms"]),
        "tokens_per_s": ratio(p["tokens_per_s"], d["tokens_per_s"]),
        "kv_held": ratio(p["kv"]["kv_bytes_held"], d["kv"]["kv_bytes_held"]),
        "kv_pool": ratio(p["kv"]["kv_pool_bytes"], d["kv"]["kv_pool_bytes"]),
        "outputs_match": p["outputs"] == d["outputs"],
    }
    for k in ("peak_bytes", "run_peak_bytes"):
        out[k] = ratio(mem.get("paged", {}).get(k), mem.get("sdpa", {}).get(k))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--scenario=serve" in argv or any(a == "--scenario" and b == "serve" for a, b in zip(argv, argv[1:])):
        from fms_paged.bench import serve  # the serving benchmark has options of its own

        i = argv.index("--scenario=serve") if "--scenario=serve" in argv else argv.index("--scenario")
        return serve.main(argv[:i] + argv[i + (1 if argv[i] == "--scenario=serve" else 2) :])
    args = build_parser().parse_args(argv)
    if args.nlayers is not None and (not args.variant or args.nlayers < 1):
        print(f"fms-paged bench: error: --nlayers {args.nlayers}: expected a positive int, with "
              f"--variant", file=sys.stderr)
        return 2
    if args.wandb:
        from fms_paged.bench.wandb_log import WandbUnavailable, require_wandb

        try:
            require_wandb()
        except WandbUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from fms_paged.device import resolve_device

    device = resolve_device(args.device)
    scale, why = envmod.auto_scale(device, args.scale)
    new_tokens = args.new_tokens or max(8, round(128 * scale))
    kernel = {None: "auto", True: "flex", False: "gather"}[args.compile]
    names = [s.strip() for s in args.scenario.split(",") if s.strip()]
    if "all" in names:
        names = [*latency.SCENARIOS, *[n for n in names if n == "decode"]]
    names = [n for n in names if n != "none"]
    bad = set(names) - {*latency.SCENARIOS, "decode"}
    if bad:
        raise SystemExit(f"--scenario {sorted(bad)}: expected single|mixed|chat|decode|all|none")
    impls = IMPLS[args.attn_impl]
    out = Path(args.out)
    print(f"[bench] device {device}, scale {scale} ({why}), {new_tokens} new tokens, paged kernel {kernel}")

    spec, source = model_spec(args, device)
    model = latency.load_model(spec, "sdpa")
    cfg = model.config
    kernel_used = latency.make_backend(model, "paged", 1, cfg.page_size, kernel=kernel).kernel
    results: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(args).items()},
            "scale": scale,
            "scale_reason": why,
            "new_tokens": new_tokens,
            "kernel": kernel,
            "kernel_used": kernel_used,
            "scenarios": names,
            "impls": impls,
            "name": args.name or out.name,
        },
        "environment": envmod.environment_info(device),
        "model": {
            "source": source,
            "spec": spec,
            "dtype": str(model.dtype),
            "params": sum(p.numel() for p in model.parameters()),
            "weight_bytes": envmod.weight_bytes(model),
            "config": {
                k: getattr(cfg, k)
                for k in (
                    "src_vocab_size",
                    "emb_dim",
                    "nheads",
                    "kvheads",
                    "nlayers",
                    "head_dim",
                    "page_size",
                    "max_expected_seq_len",
                )
            },
        },
    }
    results["bandwidth_gbs"] = envmod.measure_bandwidth(device)
    print(f"[bench] model: {source}; memory bandwidth {results['bandwidth_gbs']:.1f} GB/s")
    t_start = time.perf_counter()

    scen, mem, plans = {}, {}, {}
    runs = [(n, i) for n in names if n in latency.SCENARIOS for i in impls]
    for name, impl in tqdm(runs, desc="scenarios", disable=None):
        plan = plans.setdefault(
            name, latency.scenario_plan(name, scale, cfg.max_expected_seq_len, new_tokens)
        )
        r = latency.run_scenario(
            model,
            impl,
            plan,
            kernel=kernel,
            warmup=args.warmup,
            seed=args.seed,
            warm=True,
            bandwidth_gbs=results["bandwidth_gbs"],
            compile_step=args.compile_step,
        )
        scen.setdefault(name, {})[impl] = r
        if args.memory:
            mcfg = {
                "model": spec,
                "attn_impl": impl,
                "kernel": kernel,
                "plan": plan,
                "threads": torch.get_num_threads(),
            }
            mem.setdefault(name, {})[impl] = measure_peak(mcfg, device)
    results.update(scenarios=scen, memory=mem, plans=plans)
    results["compare"] = {n: compare(scen[n], mem.get(n, {})) for n in scen if len(scen[n]) == 2}

    if "decode" in names:
        results["decode"] = latency.decode_benchmark(
            model, scale, kernel=kernel, steps=args.decode_steps, warmup=max(args.warmup, 1), seed=args.seed,
            modes=[m.strip() for m in args.decode_modes.split(",") if m.strip()],
        )
    if args.ppl:
        ids, what = eval_tokens(args, model, spec.get("model_path"))
        results["perplexity"] = {**perplexity_all(model, impls, ids, args.ppl_window, kernel), "text": what}
    if args.peers:
        from fms_paged.bench.peers import run_peers_isolated

        prompts = {
            n: latency.random_prompts(plans[n]["prompt_lengths"], cfg.src_vocab_size, args.seed)
            for n in ("single", "mixed")
            if n in plans
        }
        if not prompts:
            prompts = {
                "mixed": latency.random_prompts(
                    latency.scenario_plan("mixed", scale, cfg.max_expected_seq_len, new_tokens)[
                        "prompt_lengths"
                    ],
                    cfg.src_vocab_size,
                    args.seed,
                )
            }
        peers = run_peers_isolated(model, spec.get("model_path"), prompts, new_tokens,
                                   compile=kernel == "flex")
        for by in peers.values():
            for n, r in by.items() if isinstance(by, dict) else []:
                if isinstance(r, dict) and "outputs" in r and n in scen:
                    ours = next(iter(scen[n].values()))["outputs"]
                    r["same_as_ours"] = r.pop("outputs") == ours
        results["peers"] = peers
    results["elapsed_s"] = time.perf_counter() - t_start

    paths = write_all(results, out)
    print(markdown(results))
    if args.wandb:
        from fms_paged.bench.wandb_log import log_run

        results["wandb"] = log_run(results, out, args.wandb_project, results["config"]["name"])
        paths = write_all(results, out)
        print(f"[bench] wandb ({results['wandb']['mode']}): {results['wandb']['dir']}")
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def ppl_main(argv: list[str] | None = None) -> int:
    """`scripts/perplexity.py`: perplexity of both backends (and the no-cache reference) only."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--scenario" not in argv:
        argv += ["--scenario", "none"]
    return main(argv + ["--ppl", "--no-memory"])


if __name__ == "__main__":
    raise SystemExit(main())
