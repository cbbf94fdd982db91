"""`vs_native`: the engine beside the native CPU engines a user would pick instead, on the workloads
the engine was first measured against vLLM on (`vs_vllm.VS_VLLM`), plus each system's start.

- llama.cpp (`scripts/peer_llamacpp.py` in `.venv-llamacpp`, made by `make peer-llamacpp`: built
  from the `llama-cpp-python` sdist for this CPU, the model converted by its own
  `convert_hf_to_gguf.py`), in f32, bf16 and f16;
- OpenVINO GenAI (`scripts/peer_openvino.py` in `.venv-openvino`, made by `make peer-openvino`: its
  `ContinuousBatchingPipeline` on an IR exported by optimum-intel), in f32 and bf16 (its inference
  precision hint);
- the engine (this module's `engine` job), in bf16, fp16 and fp32.

Every system runs in a process of its own on the same token ids (prefix caching off, greedy, every
request making all its tokens), warms up once, then times `repeats` runs, and reports its start:
from the start of its process to its first token (a peer's model conversion is cached and not
counted). The engine's start is also measured cold, with empty kernel and compile caches
(`FMS_PAGED_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR`). Each system and dtype runs in `rounds` such
processes, one a round, every system once a round and the order reversed every other round (A B C
C B A): a VM's speed can drift by 10-20% over minutes, and one process each, minutes apart, would
compare the drift as much as the systems. The reported rate is the median of all the rounds' timed
runs (`pool_processes`). A peer that is not installed or fails is recorded with why, and the rest
goes on.

    python -m fms_paged.bench.vs_native --out results/bench-native     # `make bench-native`
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # this process's start, for an engine job's start time (imports below)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from fms_paged.bench.environment import REPO_ROOT  # noqa: E402

PEERS = {  # name -> (python, script, the dtypes it runs, what its jobs add)
    # llama.cpp keeps its own default KV cache type (f16) at every weight dtype: its CPU flash
    # attention has no fast bf16 path (a bf16 cache ran the default-model workload ~3x slower)
    "llama.cpp": (
        REPO_ROOT / ".venv-llamacpp" / "bin" / "python",
        REPO_ROOT / "scripts" / "peer_llamacpp.py",
        ("float32", "bfloat16", "float16"),
        {"kv_cache_dtype": "float16"},
    ),
    "OpenVINO GenAI": (
        REPO_ROOT / ".venv-openvino" / "bin" / "python",
        REPO_ROOT / "scripts" / "peer_openvino.py",
        ("float32", "bfloat16"),
        {},
    ),
}
ENGINE = "fms_paged"
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
# the targets (issue: ahead of the native CPU engines): output tok/s against the best peer at its
# best dtype on each workload; one request's decode against the read roofline; start-up seconds
PEER_RATIO, ROOFLINE_SHARE, COLD_START_S, WARM_START_S = 1.0, 0.8, 10.0, 3.0
# the engine's lookahead decode steps in these runs (`Engine(decode_steps=...)`): up to this many
# greedy steps in one operator call once nothing waits, as a user sets it for throughput (1: a
# token per engine step, `--decode-steps 1`)
DECODE_STEPS = 8
ONE_REQUEST = "SmolLM2-135M shape, 1 prompt of 64, 64 new"


def engine_job(job: dict[str, Any]) -> dict[str, Any]:
    """The engine on `job` (the peers' IN.json) in this fresh process -> the peers' OUT.json
    figures: a first run (its first token gives the start: from this process's start, and from
    `Engine(...)`), then `repeats` timed runs."""
    import torch

    from fms_paged.engine import Engine, SamplingParams
    from fms_paged.models import get_model

    t_load = time.perf_counter()
    model = get_model(model_path=job["model_path"], attn_impl="paged", dtype=getattr(torch, job["dtype"]))
    reqs = job["requests"]
    t_engine = time.perf_counter()
    eng = Engine(
        model,
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        compile=job.get("compile", "auto"),
        enable_prefix_caching=False,
        max_model_len=max(len(r["prompt"]) + r["max_new_tokens"] for r in reqs),
        decode_steps=job.get("decode_steps", 1),
    )

    def run() -> tuple[float, list[float], list[list[int]], float]:
        ids = [
            eng.add_request(r["prompt"], SamplingParams(max_new_tokens=r["max_new_tokens"], ignore_eos=True))
            for r in reqs
        ]
        got: dict[int, list[int]] = {i: [] for i in ids}
        first, t0 = None, time.perf_counter()
        for out in eng.stream():
            got[out.request_id].extend(out.new_token_ids)
            first = first or time.perf_counter()
        end = time.perf_counter()
        return end - t0, [first], [got[i] for i in ids], end - first

    duration, (first,), tokens, after_first = run()
    end_first_run = time.perf_counter()
    from fms_paged import native

    # a first start's background builds (the first run may have run by torch's operations while they
    # compiled): the timed runs take the kernels. (Done by the first run's end where they ended in it.)
    built_in_run = not native.compiling()
    native.wait_for_builds()
    res = {
        "builds_done_s": (end_first_run if built_in_run else time.perf_counter()) - _T0,
        "load_s": t_engine - t_load,
        "start_s": first - _T0,
        "engine_first_token_s": first - t_engine,
        "first_run_s": duration,
        "kernel": eng.backend.kernel.name,
        "compiled": eng.runner.compiled,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    from fms_paged.bench.environment import measure_read_bandwidth

    # one request: the roofline's bandwidth is read before each timed run and after the last, and a
    # run's decode is set against the mean of the two readings beside it. On a VM the read bandwidth
    # moves with other tenants' traffic, over seconds and for all of a process's memory at once
    # (one process's readings went 30, 45, 30 GB/s a second apart): a decode set against readings
    # taken before and after all the runs (their highest) compared that drift as much as the decode.
    one, readings, runs = len(reqs) == 1, [], []
    for _ in range(job.get("repeats", 3)):
        if one:
            readings.append(measure_read_bandwidth(torch.device("cpu")))
        runs.append(run())
    if one:
        readings.append(measure_read_bandwidth(torch.device("cpu")))
    n = sum(r["max_new_tokens"] for r in reqs)
    rates = [n / r[0] for r in runs]
    i_mid = sorted(range(len(runs)), key=lambda i: rates[i])[len(runs) // 2]
    mid = runs[i_mid]
    res.update(
        tokens=mid[2],
        duration_s=mid[0],
        output_tokens=n,
        output_tok_s=statistics.median(rates),
        output_tok_s_runs=rates,
        tokens_equal_runs=all(r[2] == runs[0][2] for r in runs),
    )
    if one:  # its decode steps per second after the first token, and the bandwidth read beside them
        res["decode_steps_s"] = (reqs[0]["max_new_tokens"] - 1) / mid[3]
        res["step_anatomy_ms"] = step_anatomy(eng, reqs[0])
        res["read_bandwidth_gbs"] = (readings[i_mid] + readings[i_mid + 1]) / 2
        res["read_bandwidth_readings_gbs"] = readings
        res["process_read_gbs"] = process_read_gbs()
    return res


def process_read_gbs() -> float:
    """This process's read bandwidth as each peer reads its own (scripts/peer_bandwidth.py: numpy,
    one sum per core), so that one-request decode rates can be set beside the bandwidth of the
    process that ran them with one method for all."""
    path = REPO_ROOT / "scripts" / "peer_bandwidth.py"
    spec = importlib.util.spec_from_file_location("peer_bandwidth", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_bandwidth_gbs()


def step_anatomy(eng, req: dict[str, Any]) -> dict[str, float]:
    """Where a one-request decode step's time goes (medians over the request's decode steps, ms):
    the whole `Engine.step`, the model's forward in it, and the time inside the C++ kernels (GEMV,
    attention and the rows kernel, counted by the operators: `fms_paged::_kernel_ns`); host = step -
    kernels,
    of it outside the forward (scheduling, sampling, bookkeeping) = step - forward. One-token steps
    (`decode_steps` 1 meanwhile): the step that lookahead steps run several of in one call."""
    import torch

    from fms_paged.engine import SamplingParams

    runner, timings, lookahead = eng.runner, {"forward": []}, eng.decode_steps
    eng.decode_steps = 1
    decode = runner._decode

    def timed_decode(*args, **kw):
        t0 = time.perf_counter()
        out = decode(*args, **kw)
        timings["forward"].append(time.perf_counter() - t0)
        return out

    runner._decode = timed_decode
    try:
        eng.add_request(req["prompt"], SamplingParams(max_new_tokens=req["max_new_tokens"], ignore_eos=True))
        eng.step()  # the prefill
        steps, kernels = [], []
        timings["forward"].clear()
        while eng.has_unfinished():
            k0, t0 = torch.ops.fms_paged._kernel_ns(), time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
            kernels.append((torch.ops.fms_paged._kernel_ns() - k0) * 1e-9)
    finally:
        runner._decode, eng.decode_steps = decode, lookahead
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    step, forward, kernel = med(steps), med(timings["forward"]), med(kernels)
    return {
        "step": step,
        "forward": forward,
        "kernels": kernel,
        "host": step - kernel,
        "host_outside_forward": step - forward,
    }


def _run(cmd: list[str], job: dict[str, Any], tmp: Path, out: Path, tag: str, env=None) -> dict[str, Any]:
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    run = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True, env=env)
    (out / f"{tag}.log").write_text(run.stdout[-20000:] + run.stderr[-20000:])
    if run.returncode or not dst.exists():
        return {"error": ((run.stderr or run.stdout).strip() or f"exit {run.returncode}")[-1500:]}
    return json.loads(dst.read_text())


def pool_processes(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system and dtype's processes (one a round) -> one result: the timed runs of all of them
    pooled (`output_tok_s`: their median), the rest (tokens, start, a one-request decode and the
    bandwidth its process read) from the process whose own median rate is nearest the pooled one,
    and each process's rates and start under `processes`. An error if any process failed."""
    failed = [r for r in results if "output_tok_s" not in r]
    if failed:
        return failed[0]
    pooled = [x for r in results for x in r["output_tok_s_runs"]]
    rate = statistics.median(pooled)
    out = dict(min(results, key=lambda r: abs(r["output_tok_s"] - rate)))
    out.update(
        output_tok_s=rate,
        output_tok_s_runs=pooled,
        tokens_equal_runs=all(r.get("tokens_equal_runs", True) and r.get("tokens") == results[0].get("tokens")
                              for r in results),
        processes=[{k: r.get(k) for k in ("output_tok_s", "output_tok_s_runs", "start_s", "decode_steps_s",
                                          "read_bandwidth_gbs")} for r in results],
    )
    return out


def _engine_cmd() -> list[str]:
    return [sys.executable, "-m", "fms_paged.bench.vs_native", "engine"]


def vs_native(out: Path, repeats: int = 3, rounds: int = 2, log=print,
              decode_steps: int = DECODE_STEPS) -> dict[str, Any]:
    """Every `VS_VLLM` workload through the engine (with `decode_steps` lookahead steps) and each
    peer of `PEERS`, at each of their dtypes, in `rounds` processes each (`pool_processes`); the
    engine's cold start; the read roofline of the one-request decode; the targets."""
    import torch

    from fms_paged.bench.environment import environment_info, kv_bytes_per_token, measure_read_bandwidth
    from fms_paged.bench.vs_vllm import SMOLLM2_135M, VS_VLLM
    from fms_paged.models import default_model_path
    from fms_paged.models.hf import save_hf_llama
    from fms_paged.models.llama import LLaMA, LLaMAConfig

    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "environment": environment_info(torch.device("cpu")),
        "repeats": repeats,
        "rounds": rounds,
        "decode_steps": decode_steps,
        "read_bandwidth_gbs": measure_read_bandwidth(torch.device("cpu")),
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpts = {"default": Path(default_model_path()), "smollm2": tmp / "smollm2"}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            smol = LLaMA(LLaMAConfig(**SMOLLM2_135M))
            smol.reset_parameters()
        save_hf_llama(smol, ckpts["smollm2"])
        vocabs = {
            which: json.loads((path / "config.json").read_text())["vocab_size"]
            for which, path in ckpts.items()
        }
        for name, (which, lens, new, seqs, budget) in VS_VLLM.items():
            g, vocab = torch.Generator().manual_seed(0), vocabs[which]
            job = {
                "model_path": str(ckpts[which]),
                "max_num_seqs": seqs,
                "max_num_batched_tokens": budget,
                "repeats": repeats,
                "requests": [
                    {"prompt": torch.randint(3, vocab, (n,), generator=g).tolist(), "max_new_tokens": new}
                    for n in lens
                ],
            }
            w = res["workloads"][name] = {}
            systems = [(ENGINE, _engine_cmd(), ENGINE_DTYPES, {"decode_steps": decode_steps})] + [
                (peer, [str(py), str(script)], dts, extra) for peer, (py, script, dts, extra) in PEERS.items()
            ]
            runs = [(system, cmd, dtype, extra) for system, cmd, dtypes, extra in systems for dtype in dtypes]
            got: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for r in range(rounds):  # every system once a round, the order reversed every other round
                for system, cmd, dtype, extra in runs if r % 2 == 0 else runs[::-1]:
                    tag = f"{system}_{which}_{len(lens)}_{dtype}_{r}".replace(" ", "_").replace(".", "")
                    if not Path(cmd[0]).exists():
                        target = "peer-llamacpp" if "llama" in system else "peer-openvino"
                        got[system, dtype] = [{"error": f"{cmd[0]} not found: `make {target}` creates it"}]
                        continue
                    log(f"[bench-native] {name}: {system} {dtype} (round {r + 1} of {rounds}) ...")
                    got.setdefault((system, dtype), []).append(
                        _run(cmd, {**job, **extra, "dtype": dtype}, tmp, out, tag)
                    )
            for system, _, dtype, _ in runs:
                w.setdefault(system, {})[dtype] = pool_processes(got[system, dtype])
            # a one-request step reads every weight once (the tied head: the embedding) and the KV
            if name == ONE_REQUEST:
                params = sum(p.numel() for p in smol.parameters())
                res["roofline_bytes_per_step"] = {
                    dt: params * getattr(torch, dt).itemsize
                    + (max(lens) + new) * kv_bytes_per_token(smol.config, getattr(torch, dt))
                    for dt in ENGINE_DTYPES
                }
        # the engine's cold start: SmolLM2, one request, empty kernel and compile caches
        which, lens, new, seqs, budget = VS_VLLM[ONE_REQUEST]
        job = {
            "model_path": str(ckpts[which]),
            "max_num_seqs": seqs,
            "max_num_batched_tokens": budget,
            "repeats": 1,
            "requests": [{"prompt": list(range(3, 3 + lens[0])), "max_new_tokens": new}],
        }
        res["cold_start"] = {}
        for dtype in ENGINE_DTYPES:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(
                    os.environ, FMS_PAGED_CACHE_DIR=f"{cache}/kernels", TORCHINDUCTOR_CACHE_DIR=f"{cache}/ind"
                )
                log(f"[bench-native] cold start of the engine, {dtype} ...")
                res["cold_start"][dtype] = _run(
                    _engine_cmd(), {**job, "dtype": dtype, "decode_steps": decode_steps}, tmp, out,
                    f"cold_{dtype}", env=env)
    from fms_paged.bench.vs_native_report import per_bandwidth, targets

    res["targets"] = targets(res)
    res["one_request_per_gbs"] = per_bandwidth(res)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":  # one engine job in this fresh process: engine IN.json OUT.json
        job = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(engine_job(job)))
        return 0
    p = argparse.ArgumentParser(
        prog="python -m fms_paged.bench.vs_native", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("results/bench-native"))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per system and dtype, one a round")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                   help="the engine's lookahead decode steps (Engine(decode_steps=...); 1: none)")
    args = p.parse_args(argv)
    from fms_paged.bench.report import write_report
    from fms_paged.bench.vs_native_report import figures, markdown

    res = vs_native(args.out, args.repeats, args.rounds, decode_steps=args.decode_steps)
    paths = write_report(args.out, res, markdown=markdown(res), rows={}, figures=figures(res))
    print(markdown(res))
    print(f"written: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
