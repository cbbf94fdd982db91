"""`vs_native`: the engine beside the native CPU engines a user would pick instead, on the workloads
the engine was first measured against vLLM on (`vs_vllm.VS_VLLM`), plus each system's start.

- llama.cpp (`scripts/peer_llamacpp.py` in `.venv-llamacpp`, made by `make peer-llamacpp`: built
  from the `llama-cpp-python` sdist for this CPU, the model converted by its own
  `convert_hf_to_gguf.py`), in f32, bf16 and f16;
- OpenVINO GenAI (`scripts/peer_openvino.py` in `.venv-openvino`, made by `make peer-openvino`: its
  `ContinuousBatchingPipeline` on an IR exported by optimum-intel), in f32 and bf16 (its inference
  precision hint);
- the engine (`vs_native_engine`, a job in a process of its own), in bf16, fp16 and fp32.

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

    python -m benchmarks.vs_native --out results/bench-native     # `make bench-native`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import checkout_env
from benchmarks.vs_native_cases import DECODE_STEPS, ENGINE, ENGINE_DTYPES, ONE_REQUEST, PEERS
from benchmarks.vs_native_report import figures, markdown, per_bandwidth, targets
from benchmarks.vs_vllm import VS_VLLM
from fms_paged.bench.environment import environment_info, kv_bytes_per_token, measure_read_bandwidth
from fms_paged.bench.report import write_report
from fms_paged.bench.tp import SMOLLM2_135M
from fms_paged.models import default_model_path
from fms_paged.models.hf import save_hf_llama
from fms_paged.models.llama import LLaMA, LLaMAConfig


def _run(cmd: list[str], job: dict[str, Any], tmp: Path, out: Path, tag: str, env=None) -> dict[str, Any]:
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    run = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True, env=checkout_env(env))
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
    return [sys.executable, "-m", "benchmarks.vs_native_engine"]


def vs_native(out: Path, repeats: int = 3, rounds: int = 2, log=print,
              decode_steps: int | str = DECODE_STEPS) -> dict[str, Any]:
    """Every `VS_VLLM` workload through the engine (with `decode_steps` lookahead steps) and each
    peer of `PEERS`, at each of their dtypes, in `rounds` processes each (`pool_processes`); the
    engine's cold start; the read roofline of the one-request decode; the targets."""
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
    res["targets"] = targets(res)
    res["one_request_per_gbs"] = per_bandwidth(res)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vs_native", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("results/bench-native"))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    p.add_argument("--rounds", type=int, default=2, help="processes per system and dtype, one a round")
    p.add_argument("--decode-steps", type=lambda v: v if v == "auto" else int(v), default=DECODE_STEPS,
                   help='the engine\'s lookahead decode steps (Engine(decode_steps=...): "auto", its '
                        'default, '
                        "or an int; 1: none)")
    args = p.parse_args(argv)
    res = vs_native(args.out, args.repeats, args.rounds, decode_steps=args.decode_steps)
    paths = write_report(args.out, res, markdown=markdown(res), rows={}, figures=figures(res))
    print(markdown(res))
    print(f"written: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
