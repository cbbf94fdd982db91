"""The engine's side of `make bench-native` (`vs_native`), one job in a fresh process:
`python -m benchmarks.vs_native_engine IN.json OUT.json` (the peers' job and figures format). A first
run gives the start; then the timed runs, and for one request the decode step's anatomy and the read
bandwidth beside each run.
"""

from __future__ import annotations

import time

import fms_paged  # noqa: F401  (imported before the clock below starts; see _T0)

# this process's start, for the job's start time: taken once the package is imported, as when this
# job ran as `python -m fms_paged.bench.vs_native` (the package imported before the module), so that
# recorded starts stay comparable across that move; the imports below are counted
_T0 = time.perf_counter()

import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks import REPO_ROOT  # noqa: E402
from fms_paged import native  # noqa: E402
from fms_paged.bench.environment import measure_read_bandwidth  # noqa: E402
from fms_paged.engine import Engine, SamplingParams  # noqa: E402
from fms_paged.models import get_model  # noqa: E402


def engine_job(job: dict[str, Any]) -> dict[str, Any]:
    """The engine on `job` (the peers' IN.json) in this fresh process -> the peers' OUT.json
    figures: a first run (its first token gives the start: from this process's start, and from
    `Engine(...)`), then `repeats` timed runs."""
    t_load = time.perf_counter()
    # (a GGUF file's `gguf_blocks`: False dequantizes it)
    extra = {"gguf_blocks": job["gguf_blocks"]} if "gguf_blocks" in job else {}
    model = get_model(model_path=job["model_path"], attn_impl="paged", dtype=getattr(torch, job["dtype"]),
                      **extra)
    reqs = job["requests"]
    t_engine = time.perf_counter()
    eng = Engine(
        model,
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        compile=job.get("compile", "auto"),
        enable_prefix_caching=False,
        max_model_len=max(len(r["prompt"]) + r["max_new_tokens"] for r in reqs),
        decode_steps=job.get("decode_steps", "auto"),
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
    the whole `Engine.step`, the model's forward in it (the runner's `forward_hook`), and the time
    inside the C++ kernels (GEMV, attention and the rows kernel: `native.kernel_clock`); host = step -
    kernels, of it outside the forward (scheduling, sampling, bookkeeping) = step - forward. One-token
    steps (`decode_steps` 1 meanwhile): the step that lookahead steps run several of in one call."""
    runner, forwards, lookahead = eng.runner, [], eng.decode_steps
    eng.decode_steps = 1
    runner.forward_hook = lambda kind, seconds: forwards.append(seconds) if kind == "decode" else None
    try:
        eng.add_request(req["prompt"], SamplingParams(max_new_tokens=req["max_new_tokens"], ignore_eos=True))
        eng.step()  # the prefill
        steps, kernels = [], []
        forwards.clear()
        with native.kernel_clock() as kernel_ns:
            while eng.has_unfinished():
                k0, t0 = kernel_ns(), time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
                kernels.append((kernel_ns() - k0) * 1e-9)
    finally:
        runner.forward_hook, eng.decode_steps = None, lookahead
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    step, forward, kernel = med(steps), med(forwards), med(kernels)
    return {
        "step": step,
        "forward": forward,
        "kernels": kernel,
        "host": step - kernel,
        "host_outside_forward": step - forward,
    }


def main(argv: list[str] | None = None) -> int:
    """`IN.json OUT.json`: the engine on the job in this process, its figures written."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(f"usage: python -m benchmarks.vs_native_engine IN.json OUT.json (got {argv})")
    job = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(engine_job(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
