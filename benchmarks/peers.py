"""The serving benchmark's peers, each in a process of its own on the engine's weights (a peer's
threads in our process once slowed our decode tenfold; `python -m benchmarks.peers
dense|hf|warm JOB.json OUT.json`): dense `generate` in static waves, Hugging Face `generate_batch`
(its paged continuous batching) and vLLM's CPU build (`scripts/peer_vllm.py` in `.venv-vllm`, made
by `make peer-vllm`; never a dependency of ours); `warm` times the engine's own start in a fresh
process. A peer that cannot run is recorded with why, and the benchmark goes on.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks import REPO_ROOT, checkout_env
from fms_paged.device import keep_freed_cpu_memory
from fms_paged.engine import Engine
from fms_paged.generation import generate
from fms_paged.models import get_model
from fms_paged.models.hf import save_hf_llama

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = REPO_ROOT / "scripts" / "peer_vllm.py"


def hf_checkpoint_dir(model: torch.nn.Module, model_path: str | None, tmp: str | Path) -> Path:
    """The HF-format directory holding `model`'s weights: its own checkpoint, or a saved copy."""
    if model_path is None or not (Path(model_path) / "config.json").is_file():
        save_hf_llama(model, model_path := Path(tmp) / "hf_model")
    return Path(model_path)


def peer_job(ckpt: Path, model, prompts: list[list[int]], news: list[int], seqs: int, budget: int,
             **extra: Any) -> dict[str, Any]:
    """The job a peer's process reads: the checkpoint, dtype and device, the requests and the limits."""
    return {"model_path": str(ckpt), "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "requests": [{"prompt": p, "max_new_tokens": n} for p, n in zip(prompts, news)],
            "max_num_seqs": seqs, "max_num_batched_tokens": budget, "block_size": 128, **extra}


def peer_command(peer: str) -> list[str]:
    """The command that runs `peer` (dense, hf or warm: `peer_main`) on a job in a fresh process."""
    return [sys.executable, "-m", "benchmarks.peers", peer]


def run_peer(cmd: list[str], job: dict[str, Any], tmp: Path, out, tag: str) -> dict[str, Any]:
    """`cmd JOB.json OUT.json` in a process of its own (the checkout on its PYTHONPATH) -> OUT.json's
    figures, or why it did not run (its log in `out`/peer_`tag`.log)."""
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    run = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True, env=checkout_env())
    (Path(out) / f"peer_{tag}.log").write_text(run.stdout[-20000:] + run.stderr[-20000:])
    if run.returncode or not dst.exists():
        return {"error": (run.stderr or run.stdout)[-1500:]}
    return json.loads(dst.read_text())


def around_vllm(job: dict[str, Any], tmp: Path, out, tag: str, engine_run: Callable[[], Any], repeats: int,
                log=print) -> tuple[dict[str, Any], list[Any]]:
    """vLLM on `job` (its figures, or why it did not run), with `engine_run` run `repeats` times just
    before it and just after (the engine's runs): runs on both sides cancel a steady drift."""
    before = [engine_run() for _ in range(repeats)]
    if not VLLM_PYTHON.exists():
        return {"error": f"{VLLM_PYTHON} not found: `make peer-vllm` creates it"}, before
    log(f"[bench-serve] vLLM peer ({tag}) ...")
    v = run_peer([str(VLLM_PYTHON), str(VLLM_SCRIPT)], job, tmp, out, tag)
    return v, before + [engine_run() for _ in range(repeats)]


def run_peers(model, model_path: str | None, specs, args, out, engine_run: Callable[[], float],
              log=print, repeats: int = 3) -> dict[str, Any]:
    """The offline mix (`specs`) through each peer of `args.peers` -> each one's output tok/s and
    tokens, or why it did not run; vLLM's `around_vllm` (`engine_run`: our output tok/s on the mix)."""
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = peer_job(hf_checkpoint_dir(model, model_path, tmp), model, [s.prompt for s in specs],
                   [s.max_new_tokens for s in specs], args.max_num_seqs, args.max_num_batched_tokens,
                   kv_space_gib=4, compile=args.compile, repeats=repeats)
        for peer in args.peers:
            if peer == "vllm":
                res[peer], around = around_vllm(job, Path(tmp), out, "vllm", engine_run, repeats, log)
                res[peer].update(engine_output_tok_s_runs=around,
                                 engine_output_tok_s=statistics.median(around))
                continue
            log(f"[bench-serve] peer {peer} ...")
            res[peer] = run_peer(peer_command(peer), job, Path(tmp), out, peer)
    return res


def _dense_peer(job: dict[str, Any], prompts, news) -> Callable[[], list[list[int]]]:
    """Dense `generate` in static waves of max_num_seqs: a wave runs until its longest is done."""
    model = get_model(model_path=job["model_path"], attn_impl="sdpa", device=job.get("device", "cpu"),
                      dtype=job["dtype"])
    B, compile = job["max_num_seqs"], job["compile"] in ("auto", True)
    waves = [range(i, min(i + B, len(prompts))) for i in range(0, len(prompts), B)]

    def run() -> list[list[int]]:
        toks = []
        for w in waves:
            out = generate(model, [prompts[i] for i in w], max(news[i] for i in w), eos_id=None,
                           compile=compile)
            toks += [o[: news[i]] for o, i in zip(out, w)]
        return toks

    run()  # warm-up: each wave's cache length is a shape of its own to compile
    return run


def _hf_peer(job: dict[str, Any], prompts, news) -> Callable[[], list[list[int]]]:
    """Hugging Face `generate_batch`, one max_new_tokens for all (each output cut to its own), on
    the job's device. Weights: the job's checkpoint, or with a "config" (an HF config dict) random
    ones made on the device in the job's dtype (a large model: no checkpoint to write and load;
    a step's speed does not depend on the values). "cb": a `ContinuousBatchingConfig`'s sizes
    (else HF sizes its static buffers by the device's free memory)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dtype, device = getattr(torch, job["dtype"]), job.get("device", "cpu")
    if "config" in job:
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)  # this peer's process only
        with torch.device(device):
            hf = LlamaForCausalLM(LlamaConfig(**job["config"]))
    else:
        hf = LlamaForCausalLM.from_pretrained(job["model_path"], dtype=dtype).to(device)
    hf.eval()
    cfg = GenerationConfig(max_new_tokens=max(news), min_new_tokens=max(news), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    kw = {}
    if job.get("cb"):
        from transformers.generation import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(**job["cb"])

    @torch.no_grad()  # not inference_mode: HF's continuous batching writes its static tensors in place
    def run(batch=prompts) -> list[list[int]]:
        res = hf.generate_batch(inputs=batch, generation_config=cfg, progress_bar=False, **kw)
        return [list(r.generated_tokens)[:n] for r, n in zip(res.values(), news)]

    run(prompts[:2])  # warm-up
    return run


def offline_engine(model, seqs: int, budget: int, compile, max_model_len: int) -> tuple[Engine, float]:
    """A warmed-up engine for offline runs (prefix cache off, as for vLLM) -> (engine, warm-up s)."""
    eng = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=budget, compile=compile,
                 max_model_len=max_model_len, enable_prefix_caching=False)
    return eng, eng.warmup(progress=False)


def warm_start(job: dict[str, Any]) -> dict[str, Any]:
    """In this fresh process: load the job's checkpoint in its dtype, build its engine and warm it
    up -> seconds for each (what a server's restart costs once the compile caches are filled)."""
    t0 = time.perf_counter()
    model = get_model(model_path=job["model_path"], attn_impl="paged", device=job["device"],
                      dtype=job["dtype"])
    t1 = time.perf_counter()
    eng, warm = offline_engine(model, job["max_num_seqs"], job["max_num_batched_tokens"], job["compile"],
                               job["max_model_len"])
    t2 = time.perf_counter()
    return {"load_s": t1 - t0, "engine_s": t2 - t1 - warm, "warmup_s": warm, "start_s": t2 - t0,
            "kernel": eng.backend.kernel.name}


def peer_main(peer: str, src: str, dst: str) -> int:
    """One peer of `run_peers` timed in this (fresh) process, or the engine's `warm_start`."""
    if peer not in ("dense", "hf", "warm"):
        raise ValueError(f"peer {peer!r}; expected dense, hf or warm (vllm runs scripts/peer_vllm.py)")
    job = json.loads(Path(src).read_text())
    if peer == "warm":
        Path(dst).write_text(json.dumps(warm_start(job)))
        return 0
    prompts, news = [r["prompt"] for r in job["requests"]], [r["max_new_tokens"] for r in job["requests"]]
    t0 = time.perf_counter()
    run = (_dense_peer if peer == "dense" else _hf_peer)(job, prompts, news)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = run()
    duration, n = time.perf_counter() - t0, sum(map(len, tokens))
    Path(dst).write_text(json.dumps({"tokens": tokens, "duration_s": duration, "output_tokens": n,
                                     "output_tok_s": n / duration, "setup_s": setup,
                                     "transformers": transformers.__version__}))
    return 0


if __name__ == "__main__":
    keep_freed_cpu_memory()  # the same allocator setting as the engine's process (vLLM: tcmalloc)
    sys.exit(peer_main(*sys.argv[1:4]))
