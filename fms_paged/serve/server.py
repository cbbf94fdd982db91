"""`fms-paged serve`: load the model, build the engine, serve the OpenAI API with uvicorn.

The model, tokenizer, chat template and engine are built before the port opens, so a bad flag or
checkpoint fails at once with one line (exit 2). The engine then warms up in its own thread while
the server already answers: `/health` says 503 until the warm-up is done. SIGINT / SIGTERM stop
accepting connections, let running requests finish for up to `--shutdown-timeout` seconds, abort
the rest, and exit 0."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from fms_paged.kv.quant import KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES

API_KEY_ENV = "FMS_PAGED_API_KEY"


def add_serve_args(p: argparse.ArgumentParser, positive_int) -> None:
    p.add_argument("model", nargs="?", type=Path, default=None,
                   help="Hugging Face checkpoint dir (config.json, *.safetensors, tokenizer) of a family "
                        "we load (`fms-paged info` lists them), or any decoder IBM FMS loads (--loader). "
                        "Default: the embedded default model.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint dir's name)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"bearer token required on /v1/* (default: ${API_KEY_ENV}, else none)")
    g.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template file (default: the checkpoint's own, if any)")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: "
                        "Hermes, Qwen), llama3_json ({\"name\": ..., \"parameters\": ...}: Llama 3.x), "
                        "or auto: the format the chat template writes (default)")
    g.add_argument("--max-waiting", type=positive_int, default=None,
                   help="answer 429 to a request arriving while this many are waiting (default: "
                        "queue without bound)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM before they are aborted")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    g = p.add_argument_group("engine")
    g.add_argument("--loader", default="auto", choices=["auto", "ours", "fms"],
                   help="who builds the model: ours (fms_paged's families), fms (IBM FMS's "
                        "get_model('hf_pretrained'), served through its paged attention op), or auto: "
                        "ours when config.json names a family we load, else FMS's (default)")
    g.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    g.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="quantize the decoder's projections on load, weight-only (vLLM's name): int8 per "
                        "output channel, int4 per group; ATen's CPU kernels (default: none)")
    g.add_argument("--quantization-group-size", type=positive_int, default=128,
                   help="int4's group of input channels: 32, 64, 128 or 256 (default: 128, torchao's)")
    g.add_argument("--max-num-seqs", type=positive_int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=1024,
                   help="tokens in one forward (decodes + prefill chunks)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output (default: the model's)")
    g.add_argument("--page-size", type=positive_int, default=None, help="tokens per KV page")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    g.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="share of free memory the KV pool may take (default: the budget's own)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV of common prompt prefixes")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="ranks to split the model over (heads and MLP; gloo on the CPU, one GPU each on "
                        "CUDA), spawned on this host; under torchrun, the ranks torchrun started "
                        "(rank 0 serves)")
    g.add_argument("--speculative-config", type=speculative_config, default=None,
                   help='speculative decoding, as JSON (vLLM\'s flag): {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
                        '(prompt lookup), or {"method": "draft_model", "model": "<checkpoint dir>", '
                        '"num_speculative_tokens": 4} (a smaller model of the same tokenizer; default: off)')
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no compiled graphs and no warm-up")


def speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object that `SpeculativeConfig.parse` accepts, checked here
    so that a bad one stops the command line (argparse names the flag)."""
    from fms_paged.engine.speculative import SpeculativeConfig

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    try:
        SpeculativeConfig.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def engine_spec(args) -> dict:
    """What the engine process builds (`fms_paged.serve.loop.build_engine`)."""
    from fms_paged.engine.tensor_parallel import torchrun_rank
    from fms_paged.models import default_model_path

    return {"model_dir": str(args.model if args.model is not None else default_model_path()),
            "loader": args.loader, "device": args.device, "dtype": args.dtype, "page_size": args.page_size,
            "quantization": args.quantization, "quantization_group_size": args.quantization_group_size,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "kv_memory_fraction": args.kv_memory_fraction,
            "kv_cache_dtype": args.kv_cache_dtype, "speculative": getattr(args, "speculative_config", None),
            "enable_prefix_caching": args.enable_prefix_caching, "enforce_eager": args.enforce_eager,
            "tensor_parallel_size": args.tensor_parallel_size, "log_level": args.log_level,
            "torchrun": torchrun_rank() is not None}


def serve_worker(args) -> int:
    """A torchrun rank other than 0: build this rank's part of the model and its engine, then
    follow rank 0's engine (which serves) until it stops; no HTTP here."""
    import torch

    from fms_paged.engine.tensor_parallel import run_worker
    from fms_paged.serve.loop import build_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the ranks stop
        signal.signal(sig, signal.SIG_IGN)
    engine = build_engine(engine_spec(args))
    print(f"fms-paged serve: tensor-parallel rank {engine.tp_rank} following rank 0", flush=True)
    run_worker(engine)
    engine.shutdown()
    torch.distributed.destroy_process_group()
    return 0


def build(args, on_dead=None):
    """-> (app, model name): the engine process started (its model loaded and its engine built,
    or an error) and the FastAPI app over it, nothing served yet. `on_dead(why)`: the engine
    process stopped unasked."""
    from fms_paged import load_tokenizer
    from fms_paged.serve.app import build_app
    from fms_paged.serve.chat import ChatTemplate, find_chat_template, special_tokens
    from fms_paged.serve.loop import EngineLoop
    from fms_paged.serve.metrics import ServerMetrics
    from fms_paged.serve.requests import ServeContext
    from fms_paged.serve.tools import template_format

    spec = engine_spec(args)
    model_dir = spec["model_dir"]
    # (before xgrammar's import below: a GGUF file's tokenizer imports transformers, which xgrammar
    # imports too, and two threads importing it at once fail)
    tokenizer = load_tokenizer(model_dir)
    if importlib.util.find_spec("xgrammar") is not None:  # structured outputs' 400s check grammars
        # here: import it now, beside the engine's start, not on the first such request's path
        threading.Thread(target=importlib.import_module, args=("xgrammar",), daemon=True).start()
    source = find_chat_template(model_dir, args.chat_template)
    chat = None if source is None else ChatTemplate(source, special_tokens(model_dir))
    name = args.served_model_name or Path(model_dir).name
    metrics = ServerMetrics(name)
    loop = EngineLoop(spec, on_finished=lambda out: metrics.finished(out.stats, out.index == 0),
                      on_state=metrics.engine_state, on_tokens=metrics.generation_tokens.inc,
                      on_ready=lambda s: print(f"fms-paged serve: ready (warm-up {s:.1f} s)", flush=True),
                      on_dead=on_dead)
    info = loop.start()
    fmt = template_format(source) if args.tool_call_parser == "auto" else args.tool_call_parser
    ctx = ServeContext(loop, tokenizer, name, info["max_model_len"], info["vocab_size"], chat,
                       args.max_waiting, model_dir, capacity=info["capacity"], tool_format=fmt)
    return build_app(ctx, metrics, api_key=args.api_key or None), name


def serve(args) -> int:
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"argument --port: {args.port} is not a port number (0..65535)")
    from fms_paged.engine.tensor_parallel import torchrun_rank

    ranks = torchrun_rank()
    if ranks is not None:  # started by torchrun: its ranks split the model, rank 0 serves
        rank, world = ranks
        if args.tensor_parallel_size not in (1, world):
            raise ValueError(f"argument --tensor-parallel-size: {args.tensor_parallel_size}, but torchrun "
                             f"started {world} ranks (WORLD_SIZE)")
        args.tensor_parallel_size = world
        if rank != 0:
            return serve_worker(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    died: list[str] = []
    holder: list = []  # the uvicorn server, once made

    def on_dead(why: str) -> None:  # the reader thread: a server without its engine stops, exit 1
        died.append(why)
        print(f"fms-paged serve: the engine stopped: {why}; shutting down", file=sys.stderr, flush=True)
        if holder:
            holder[0].should_exit = True

    app, name = build(args, on_dead)
    print(f"fms-paged serve: {name!r} on http://{args.host}:{args.port}/v1 (warming up: /health "
          "answers 503 until ready)", flush=True)
    # uvicorn handles SIGINT / SIGTERM itself while it serves (graceful shutdown), then raises the
    # signal again for the handler that was there before: let that one be a no-op, so the process
    # exits 0 after its shutdown instead of dying by the signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug"))
    holder.append(server)
    server.should_exit = bool(died)  # (it died while uvicorn was being set up)
    server.run()
    print("fms-paged serve: stopped", flush=True)
    return 1 if died else 0
