"""`fms-paged bench`: every benchmark and its options (`scripts/benchmark_inference.py` and
`scripts/perplexity.py` enter here). Each writes <out>/results.json (figures + environment),
results.csv, results.md (also printed) and PNG plots; `--wandb` also logs them (offline without a key).

    fms-paged bench --attn-impl all --out results/bench-llama-paged   # latency, memory, perplexity vs length
    fms-paged bench --scenario none --attn-impl both                    # perplexity only
    fms-paged bench --scenario serve --out results/bench-serve          # the engine under serving traffic
    fms-paged bench --variant micro --scale 0.01 --no-memory --no-ppl   # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from fms_paged.bench import inference, latency, serve
from fms_paged.bench.environment import environment_info, weight_bytes
from fms_paged.bench.report import write_report
from fms_paged.data import DatasetSource
from fms_paged.device import resolve_device
from fms_paged.kv.quant import KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES
from fms_paged.models.registry import default_model_path

MODEL_FIELDS = ("family", "src_vocab_size", "emb_dim", "nheads", "kvheads", "nlayers", "head_dim",
                "page_size", "max_expected_seq_len", "sliding_window", "layer_types")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv(cast):
    return lambda text: [cast(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fms-paged bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="all", help="single,mixed,chat | all | none (ppl only) | serve")
    g = p.add_argument_group("model")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--variant", help="a registered variant (random weights) of --architecture, e.g. micro, "
                                     "7b, 3-8b")
    m.add_argument("--model-path", help="a Hugging Face checkpoint of a family we load (default: the "
                                        "embedded model)")
    g.add_argument("--architecture", default="llama",
                   help="with --variant: the family (llama, mistral, qwen2, qwen3, granite, gemma2, gemma3)")
    g.add_argument("--nlayers", type=int, help="with --variant: its first N layers only")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the model's)")
    g.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="quantize the decoder's projections on load, weight-only (vLLM's name): int8 per "
                        "output channel, int4 per group; ATen's CPU kernels (default: none)")
    g.add_argument("--quantization-group-size", type=int, default=128,
                   help="int4's group of input channels: 32, 64, 128 or 256 (default: 128, torchao's)")
    g.add_argument("--page-size", type=int, help="tokens per KV page (default: the device's)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("latency and memory (single, mixed, chat)")
    g.add_argument("--attn-impl", default="all", help="no-cache,sdpa,paged | both (sdpa,paged) | all")
    g.add_argument("--kernel", default="auto", choices=["auto", "cpp", "flex", "gather"],
                   help="the paged backend's attention kernel")
    g.add_argument("--compile", type=lambda s: {"true": True, "false": False}.get(s.lower(), s.lower()),
                   choices=["auto", True, False], default="auto", metavar="{auto,true,false}",
                   help="serve: the engine's mode; scenarios: true compiles each decode step as one graph")
    g.add_argument("--scale", type=float, help="multiply every length (default: 1 on CUDA, else 0.25)")
    g.add_argument("--new-tokens", type=int, help="tokens generated per sequence and turn")
    g.add_argument("--warmup", type=int, default=2, help="decode steps left out of the statistics")
    g.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="peak of each run")
    g = p.add_argument_group("perplexity")
    g.add_argument("--ppl", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--ppl-chars", type=int, default=20_000, help="characters of evaluation text")
    g.add_argument("--ppl-window", type=int, default=256)
    g.add_argument("--text-file", help="evaluation text (default: held-out Python stdlib source)")
    DatasetSource.add_arguments(g)
    g = p.add_argument_group("serving (--scenario serve)")
    g.add_argument("--workloads", default=serve.default_workloads(),
                   help="the peer ones (vs_vllm, vs_native) run from a checkout only")
    g.add_argument("--num-requests", type=int, help="requests of the mix (default 64)")
    g.add_argument("--rate-fractions", type=_csv(float), default=[0.25, 0.5, 1.0], help="x offline req/s")
    g.add_argument("--prefix-requests", type=int, default=64, help="requests sharing the system prompt")
    g.add_argument("--prefix-scale", type=float, default=1.0, help="scale of the shared-prefix workload")
    g.add_argument("--capacity-lens", type=_csv(int), default=[2048, 32768], help="max_seq_len of capacity")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--num-pages", type=int, help="default: sized by memory")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--peers", type=_csv(str), default=serve.default_peers(),
                   help="some of dense,hf,vllm; '' for none (from a checkout only)")
    g = p.add_argument_group("report")
    g.add_argument("--out", help="default: results/bench (results/bench-serve for serve)")
    g.add_argument("--name", help="run name (default: the --out folder's name)")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline without a key)")
    g.add_argument("--wandb-project", default="fms-paged-bench")
    return p


def _resolve(p: argparse.ArgumentParser, args) -> None:
    """Check and expand the options that argparse cannot (a usage error exits 2, one line)."""
    names = [s for s in args.scenario.split(",") if s and s != "none"]
    names = [*latency.SCENARIOS] if "all" in names else names
    bad = set(names) - {*latency.SCENARIOS, "serve"}
    if bad or ("serve" in names and len(names) > 1):
        p.error(f"--scenario {args.scenario}: expected some of single,mixed,chat | all | none | serve alone")
    sets = {"both": ["sdpa", "paged"], "all": list(latency.IMPLS)}
    impls = [i for s in args.attn_impl.split(",") for i in sets.get(s, [s])]
    if not impls or set(impls) - set(latency.IMPLS):
        p.error(f"--attn-impl {args.attn_impl}: expected some of {','.join(latency.IMPLS)} | both | all")
    if args.nlayers is not None and (not args.variant or args.nlayers < 1):
        p.error(f"--nlayers {args.nlayers}: expected a positive int, with --variant")
    args.serve, args.scenarios, args.impls = names == ["serve"], names, list(dict.fromkeys(impls))
    args.out = args.out or ("results/bench-serve" if args.serve else "results/bench")
    args.name = args.name or Path(args.out).name


def model_spec(args, device: torch.device) -> tuple[dict[str, Any], str]:
    """-> (spec for `latency.load_model`, a description); `micro` (announced) for a missing default."""
    spec: dict[str, Any] = {"device": str(device), "dtype": args.dtype, "seed": args.seed,
                            "page_size": args.page_size, "kv_cache_dtype": args.kv_cache_dtype,
                            "quantization": args.quantization,
                            "quantization_group_size": args.quantization_group_size}
    if args.variant:
        layers = f", first {args.nlayers} layers" if args.nlayers else ""
        variant = {"architecture": args.architecture, "variant": args.variant, "nlayers": args.nlayers}
        return {**spec, **variant}, f"{args.architecture} variant {args.variant}{layers} (random weights)"
    if args.model_path:
        return {**spec, "model_path": str(args.model_path)}, f"checkpoint {args.model_path}"
    if ((path := default_model_path()) / "config.json").is_file():
        return {**spec, "model_path": str(path)}, f"default model {path}"
    print(f"[bench] the default model is missing at {path}; using --variant micro", file=sys.stderr)
    return {**spec, "variant": "micro"}, "variant micro (default model missing)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve(parser, args)
    if args.wandb and importlib.util.find_spec("wandb") is None:
        print("fms-paged bench: error: --wandb was given but the `wandb` package is not installed; `pip "
              "install wandb` (or `pip install -e '.[bench]'`), or drop --wandb", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    # every length times the scale: full on CUDA, smaller elsewhere so that a `make bench-*` takes minutes
    # (a CPU: the serving mix's prompts up to 1000 tokens; the sweeps up to 2000, the default model's 2048)
    args.scale, args.scale_reason = (args.scale, "given with --scale") if args.scale is not None else {
        "cuda": (1.0, "auto: CUDA device, full lengths"), "mps": (0.25, "auto: MPS device")}.get(
        device.type, (0.125 if args.serve else 0.25, f"auto: CPU with {os.cpu_count()} cores"))
    spec, source = model_spec(args, device)
    target = serve if args.serve else inference
    if not args.serve:
        args.new_tokens = args.new_tokens or max(8, round(128 * args.scale))
        print(f"[bench] device {device}, scale {args.scale} ({args.scale_reason}), {args.new_tokens} new "
              f"tokens, backends {','.join(args.impls)}, paged kernel {args.kernel}", file=sys.stderr)
    model = latency.load_model(spec, "paged" if args.serve else "sdpa")
    Path(args.out).mkdir(parents=True, exist_ok=True)  # peers' logs go there during the run
    results = {"config": dict(vars(args)), "environment": environment_info(device), "model": {
        "source": source, "spec": spec, "dtype": str(model.dtype), "weight_bytes": weight_bytes(model),
        "params": sum(p.numel() for p in model.parameters()),
        "config": {k: getattr(model.config, k) for k in MODEL_FIELDS}}}
    target.run(args, model, spec, results, log=lambda s: print(s, file=sys.stderr, flush=True))
    md = target.markdown(results)
    paths = write_report(Path(args.out), results, markdown=md, rows=target.rows(results),
                         figures=target.figures(results))
    print(md)
    if "wandb" in results:
        print(f"[bench] wandb ({results['wandb']['mode']}): {results['wandb']['dir']}", file=sys.stderr)
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def ppl_main(argv: list[str] | None = None) -> int:
    """`scripts/perplexity.py`: perplexity through each cache and without one, only."""
    return main(["--scenario", "none", *(sys.argv[1:] if argv is None else argv), "--no-memory", "--ppl"])


if __name__ == "__main__":
    raise SystemExit(main())
