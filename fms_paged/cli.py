"""`fms-paged` console script: generate / serve / bench / ppl / info.

- generate: a continuation of one prompt (greedy unless --temperature > 0), dense or paged;
- serve: an OpenAI-compatible HTTP server on the engine (`fms_paged.serve`);
- bench: the benchmarks (`fms_paged.bench.cli`; `--scenario serve` runs `fms_paged.bench.serve`);
- ppl: perplexity of both backends through their KV caches;
- info: the device, torch, which paged kernel runs here and how many KV pages fit.

Bad arguments exit with code 2 and one line naming the argument (no usage dump).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fms_paged.data import DatasetSource, heldout_text
from fms_paged.kv.quant import KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES
from fms_paged.serve.server import add_serve_args

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", type=Path, default=None,
                   help="Hugging Face checkpoint dir (config.json, *.safetensors, tokenizer.model or "
                        "tokenizer.json) of a family we load (`fms-paged info` lists them), or a llama.cpp "
                        ".gguf file. Default: the embedded default model.")
    g.add_argument("--variant", default=None,
                   help="a registered variant with random weights instead (e.g. micro); needs "
                        "--prompt-ids since it has no tokenizer")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: the checkpoint's dtype)")
    g.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="quantize the decoder's projections on load, weight-only (vLLM's name): int8 per "
                        "output channel, int4 per group; ATen's CPU kernels (default: none)")
    g.add_argument("--quantization-group-size", type=_positive_int, default=128,
                   help="int4's group of input channels: 32, 64, 128 or 256 (default: 128, torchao's)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fms-paged", description="Paged-KV-cache LLaMA inference, benchmarks and tools.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of a prompt (greedy unless "
                                   "--temperature > 0).")
    _model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file whose text is the prompt")
    src.add_argument("--prompt-ids", help="prompt as space-separated token ids")
    g.add_argument("--attn-impl", choices=["sdpa", "paged"], default="paged",
                   help="attention backend: paged (page pool; the kernel per device: `fms-paged info`) "
                   "or sdpa (dense)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    g.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k best")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--compile", action="store_true",
                   help="run each decode step as one compiled graph (the first step compiles)")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="ranks to split the model over on this host (paged; gloo on the CPU, a GPU "
                        "each on CUDA): docs/serving.md, tensor parallelism")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)

    s = sub.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP",
                       description="An OpenAI-compatible server on the continuous-batching engine: "
                                   "/v1/completions, /v1/chat/completions, /v1/models, /health, "
                                   "/metrics, /version, /tokenize, /detokenize.")
    add_serve_args(s, _positive_int)

    sub.add_parser("bench", help="run the inference benchmark (see `fms-paged bench --help`)",
                   add_help=False)

    q = sub.add_parser("ppl", help="perplexity of the dense and paged backends",
                       description="Perplexity with the KV cache enabled, for both backends, on "
                                   "held-out Python standard-library source (offline), a text file or "
                                   "a `datasets` dataset (e.g. --dataset wikitext --dataset-config "
                                   "wikitext-103-raw-v1 --split validation).")
    _model_args(q)
    t = q.add_argument_group("text")
    t.add_argument("--text-file", type=Path, default=None,
                   help="text to score (default: held-out Python standard-library source)")
    DatasetSource.add_arguments(t)
    t.add_argument("--max-chars", type=_positive_int, default=50_000, help="characters to score")
    q.add_argument("--window", type=_positive_int, default=256, help="tokens per scored window")

    i = sub.add_parser("info", help="device, torch, kernel availability and memory budget",
                       description="What this machine gives the paged backend.")
    i.add_argument("model", nargs="?", type=Path, default=None,
                   help="a .gguf file: also each layer's tensor formats and how they run")
    i.add_argument("--device", default="auto", help="device to inspect")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="also load the model (the one given, else the default model) quantized on the CPU "
                        "and say each layer's format and kernel")
    i.add_argument("--quantization-group-size", type=_positive_int, default=128,
                   help="int4's group of input channels (default: 128)")

    b = sub.add_parser("build-kernels", help="build the C++ CPU operators and this CPU's kernels now",
                       description="Build the PyTorch operators (fms_paged/csrc/ops) against this torch "
                                   "and the CPU kernels (fms_paged/csrc/kernels) for this CPU into the "
                                   "kernel cache ($FMS_PAGED_CACHE_DIR), so that a first model starts "
                                   "without a compiler run (`make install` runs it).")
    b.add_argument("--head-dims", type=_positive_int, nargs="+", default=[64, 128],
                   help="attention head dims to build kernels for (default: 64 128)")
    return p


def cmd_build_kernels(args) -> int:
    from fms_paged import native

    return 0 if native.build_all(head_dims=tuple(args.head_dims)) else 1


def _load(args, attn_impl: str = "sdpa", need_tokenizer: bool = True):
    """The model and its tokenizer (None for a variant, or a checkpoint without one when
    `need_tokenizer` is False: token ids in and out)."""
    from fms_paged import get_model, load_tokenizer
    from fms_paged.models import default_model_path

    if args.variant and args.model_path:
        raise ValueError("argument --variant: not allowed with --model-path")
    model = get_model(variant=args.variant, model_path=args.model_path, attn_impl=attn_impl,
                      device=args.device, dtype=args.dtype,
                      kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),  # (ppl has none)
                      quantization=args.quantization, quantization_group_size=args.quantization_group_size)
    tok = None
    if not args.variant:
        try:
            tok = load_tokenizer(args.model_path or default_model_path())
        except FileNotFoundError:
            if need_tokenizer:
                raise
    return model, tok


def cmd_generate(args) -> int:
    from fms_paged import generate
    from fms_paged.device import keep_freed_cpu_memory

    keep_freed_cpu_memory()  # a generating process: glibc keeps freed buffers for the next step
    if args.prompt_ids is not None:  # checked before the model loads (and starts its kernels' builds)
        try:
            ids = [int(t) for t in args.prompt_ids.split()]
        except ValueError:
            raise ValueError(f"argument --prompt-ids: expected integers, got {args.prompt_ids!r}") from None
    model, tok = _load(args, args.attn_impl, need_tokenizer=args.prompt_ids is None)
    if args.prompt_ids is None:
        if tok is None:
            raise ValueError("argument --prompt: a --variant model has no tokenizer; use --prompt-ids")
        text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
        ids = tok.encode(text, add_special_tokens=True)  # the checkpoint's BOS/EOS rule
        if args.stream:
            print(text, end="", flush=True)
    streamed: list[int] = []

    def on_token(_: int, token: int) -> None:
        streamed.append(token)
        if tok is None:
            print(token, end=" ", flush=True)
        else:  # decode the whole suffix so multi-piece characters print correctly
            full = tok.decode(streamed)
            prev = tok.decode(streamed[:-1])
            print(full[len(prev):], end="", flush=True)

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.tensor_parallel_size > 1:
        out = _generate_split(model, ids, args, sampling, on_token if args.stream else None)
    else:
        out = generate(model, [ids], args.max_new_tokens, on_token=on_token if args.stream else None,
                       compile=args.compile, **sampling)[0]
    if args.stream:
        print()
    elif tok is None:
        print(" ".join(map(str, out)))
    else:
        print((args.prompt or "") + tok.decode(out))
    return 0


def _generate_split(model, ids: list[int], args, sampling: dict, on_token) -> list[int]:
    """`generate` of one prompt on an `Engine` split over --tensor-parallel-size ranks spawned
    here: the same tokens as one rank's (greedy, or sampled with the same seed)."""
    from fms_paged import Engine, SamplingParams

    if args.attn_impl != "paged":
        raise ValueError("argument --tensor-parallel-size: tensor parallelism runs the paged engine; "
                         f"got --attn-impl {args.attn_impl}")
    if model.config.quantization is not None:
        raise ValueError("argument --tensor-parallel-size: a quantized model (--quantization "
                         f"{model.config.quantization}) is not split over ranks; run it on one")
    eos = model.config.eos_token_id
    engine = Engine(model, max_num_seqs=1, max_num_batched_tokens=max(len(ids), 256),
                    max_model_len=min(model.config.max_expected_seq_len, len(ids) + args.max_new_tokens),
                    compile=args.compile, tensor_parallel_size=args.tensor_parallel_size)
    try:
        engine.add_request(ids, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                               stop_token_ids=() if eos is None else (eos,), **sampling))
        out: list[int] = []
        for o in engine.stream():
            out += o.new_token_ids
            for t in o.new_token_ids if on_token is not None else ():
                on_token(0, t)
    finally:
        engine.shutdown()
    return out


def cmd_serve(args) -> int:
    from fms_paged.serve.server import serve

    try:  # the serve extra
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"serve needs the serve extra (pip install 'fms_paged[serve]'): {e}") from None
    return serve(args)


def cmd_ppl(args) -> int:
    from fms_paged.bench.perplexity import perplexity

    dataset = DatasetSource.from_args(args)
    if args.text_file is not None and dataset is not None:
        raise ValueError("argument --dataset: not allowed with --text-file")
    if args.text_file is not None:
        text = args.text_file.read_text()[: args.max_chars]
    elif dataset is not None:
        try:
            text = dataset.text(args.max_chars)
        except ImportError as e:
            raise ValueError(str(e)) from None
    else:
        text = heldout_text(args.max_chars)
    results = {}
    for impl in ("sdpa", "paged"):
        model, tok = _load(args, impl)
        if tok is None:
            raise ValueError("argument --variant: perplexity needs a tokenizer; use --model-path")
        # BOS + the text, whatever special tokens the checkpoint's own rule adds
        ids = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(text, add_special_tokens=False)
        results[impl] = perplexity(model, ids, window=args.window)
    for impl, r in results.items():
        print(f"{impl:6s} ppl {r['ppl']:.4f} over {r['tokens']} tokens")
    rel = abs(results["paged"]["ppl"] - results["sdpa"]["ppl"]) / results["sdpa"]["ppl"]
    print(f"paged/dense relative difference {rel:.2e}")
    return 0


def machine_info(device: str = "auto") -> dict:
    """What `fms-paged info` reports: the device and torch, whether compiled FlexAttention works
    (it compiles and runs a tiny call), which paged kernel the default model gets here (the cpp
    kernel when it can serve it), on the CPU which instruction set its kernels use and which path
    each dtype's attention and projections take, and the KV pool an `Engine` would get."""
    import platform
    import warnings

    import torch

    from fms_paged.device import resolve_device
    from fms_paged.kv import cpu_kernel
    from fms_paged.kv.kernels import choose_kernel, probe_compiled_flex

    dev = resolve_device(device)
    reason = probe_compiled_flex(dev)  # compiles a tiny call: a compiler alone is not enough
    info = {
        "device": str(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "architectures": supported_architectures(),
        "compiled_flex_available": reason is None,
        "paged_kernel": "flex" if reason is None else "gather",
        "fallback_reason": reason,
    }
    try:
        from fms_paged import get_model
        from fms_paged.kv.budget import KVBudgetError, kv_cache_budget

        model = get_model(device=dev)
        c = model.config
        why_not = cpu_kernel.unavailable_reason(dev, model.dtype, c.head_dim, c.page_size)  # builds it
        info["cpp_kernel_available"] = why_not is None
        if why_not is not None:
            info["cpp_kernel_reason"] = why_not
        with warnings.catch_warnings():  # the fallback reason is reported above
            warnings.simplefilter("ignore")
            info["paged_kernel"] = choose_kernel("auto", dev, c.page_size, head_dim=c.head_dim,
                                                 dtype=model.dtype).name
        if dev.type == "cpu":
            info["cpu"] = cpu_paths(c.head_dim, c.page_size)
        info["default_model"] = {
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.dtype).removeprefix("torch."),
            "page_size": c.page_size,
        }
        try:  # the pool an Engine would get (max_num_batched_tokens=512)
            info["kv_pool"] = kv_cache_budget(model, 512, model.config.max_expected_seq_len).as_dict()
        except KVBudgetError as e:
            info["kv_pool"] = f"refused: {e}"
    except FileNotFoundError as e:
        info["default_model"] = f"unavailable: {e}"
    return info


def supported_architectures() -> dict:
    """The checkpoints `--model-path` loads: per family, the transformers architectures config.json
    may name and what the family adds to LLaMA; and whether IBM FMS's loader is there for the
    rest (`fms-paged serve --loader fms`)."""
    from fms_paged.models.families import FAMILIES

    out = {f.name: f"{', '.join(f.architectures)}: {f.summary}" for f in FAMILIES.values()}
    try:
        import fms
        from fms.models import list_models

        version = getattr(fms, "__version__", "")
        out["fms (serve --loader fms)"] = f"ibm-fms {version}: {', '.join(list_models())}"
    except ImportError:
        out["fms (serve --loader fms)"] = "not installed (pip install 'fms_paged[fms]')"
    return out


def cpu_paths(head_dim: int, page_size: int) -> dict:
    """The CPU's features that matter to the kernels, what they are built for here, and per dtype
    the paged kernel (for a model of `head_dim` and `page_size`) and how projections run."""
    import warnings

    import torch

    from fms_paged import native
    from fms_paged.kv.kernels import choose_kernel
    from fms_paged.modules.linear import gemm_paths

    flags = native.cpu_flags()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "asimd")
    out = {"features": " ".join(f for f in wanted if f in flags) or "unknown",
           "kernel_isa": f"{native.isa()}: {native.kernel_isa()}"}
    for dt in native.ELEM_TYPES:
        with warnings.catch_warnings():  # a fallback's reason is `cpp_kernel_reason`'s
            warnings.simplefilter("ignore")
            kernel = choose_kernel("auto", torch.device("cpu"), page_size, head_dim=head_dim, dtype=dt)
        paths = gemm_paths(dt)
        name = str(dt).removeprefix("torch.")
        out[name] = (f"attention {kernel.name}; decode GEMMs: {paths['decode']}; "
                     f"prefill GEMMs: {paths['prefill']}")
    return out


def cmd_info(args) -> int:
    info = machine_info(args.device)
    if args.model is not None:  # a GGUF file: its architecture, each layer's formats, how they run
        from fms_paged.models.gguf import file_summary, layer_kernels

        info["model"] = file_summary(args.model)
        if args.quantization is None:  # each layer's format and the kernel that runs it, as loaded
            info["layers"] = layer_kernels(args.model)
    if args.quantization is not None:  # each layer's format and kernel once quantized
        from fms_paged import get_model
        from fms_paged.modules.quantized import layer_formats

        model = get_model(model_path=args.model, device="cpu", quantization=args.quantization,
                          quantization_group_size=args.quantization_group_size)
        info["quantized"] = layer_formats(model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from fms_paged.bench.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "serve": cmd_serve, "ppl": cmd_ppl, "info": cmd_info,
                "build-kernels": cmd_build_kernels}
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        msg = str(e).strip("'\"").splitlines()[0]
        print(f"fms-paged {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
