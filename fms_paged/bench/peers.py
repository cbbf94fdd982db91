"""The serving benchmark's peers, each in a process of its own on the engine's weights (a peer's
threads in our process once slowed our decode tenfold; `python -m fms_paged.bench.peers dense|hf
JOB.json OUT.json`): dense `generate` in static waves, Hugging Face `generate_batch` (its paged
continuous batching) and vLLM's CPU build (`scripts/peer_vllm.py` in `.venv-vllm`, made by `make
peer-vllm`; never a dependency of ours). Also `vs_vllm`: the engine and vLLM side by side on the
workloads vLLM was first measured on, with the decode roofline. A peer that cannot run is recorded
with why, and the benchmark goes on.
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

from fms_paged.bench.environment import REPO_ROOT, kv_bytes_per_token, measure_read_bandwidth, weight_bytes
from fms_paged.bench.report import table
from fms_paged.device import keep_freed_cpu_memory
from fms_paged.engine import Engine, SamplingParams
from fms_paged.generation import generate
from fms_paged.models import get_model
from fms_paged.models.hf import save_hf_llama
from fms_paged.models.llama import LLaMA, LLaMAConfig

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = REPO_ROOT / "scripts" / "peer_vllm.py"


def hf_checkpoint_dir(model: torch.nn.Module, model_path: str | None, tmp: str | Path) -> Path:
    """The HF-format directory holding `model`'s weights: its own checkpoint, or a saved copy."""
    if model_path is None or not (Path(model_path) / "config.json").is_file():
        save_hf_llama(model, model_path := Path(tmp) / "hf_model")
    return Path(model_path)


def _job(ckpt: Path, model, prompts: list[list[int]], news: list[int], seqs: int, budget: int,
         **extra: Any) -> dict[str, Any]:
    return {"model_path": str(ckpt), "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "requests": [{"prompt": p, "max_new_tokens": n} for p, n in zip(prompts, news)],
            "max_num_seqs": seqs, "max_num_batched_tokens": budget, "block_size": 128, **extra}


def _run(cmd: list[str], job: dict[str, Any], tmp: Path, out, tag: str) -> dict[str, Any]:
    """`cmd JOB.json OUT.json` -> OUT.json's figures, or why it did not run (its log in `out`)."""
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    run = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True)
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
    v = _run([str(VLLM_PYTHON), str(VLLM_SCRIPT)], job, tmp, out, tag)
    return v, before + [engine_run() for _ in range(repeats)]


def run_peers(model, model_path: str | None, specs, args, out, engine_run: Callable[[], float],
              log=print, repeats: int = 3) -> dict[str, Any]:
    """The offline mix (`specs`) through each peer of `args.peers` -> each one's output tok/s and
    tokens, or why it did not run; vLLM's `around_vllm` (`engine_run`: our output tok/s on the mix)."""
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = _job(hf_checkpoint_dir(model, model_path, tmp), model, [s.prompt for s in specs],
                   [s.max_new_tokens for s in specs], args.max_num_seqs, args.max_num_batched_tokens,
                   kv_space_gib=4, compile=args.compile, repeats=repeats)
        for peer in args.peers:
            if peer == "vllm":
                res[peer], around = around_vllm(job, Path(tmp), out, "vllm", engine_run, repeats, log)
                res[peer].update(engine_output_tok_s_runs=around,
                                 engine_output_tok_s=statistics.median(around))
                continue
            log(f"[bench-serve] peer {peer} ...")
            res[peer] = _run([sys.executable, "-m", "fms_paged.bench.peers", peer], job, Path(tmp), out, peer)
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


def peer_main(peer: str, src: str, dst: str) -> int:
    """One peer of `run_peers`, timed in this (fresh) process."""
    if peer not in ("dense", "hf"):
        raise ValueError(f"peer {peer!r}; expected dense or hf (vllm runs scripts/peer_vllm.py)")
    job = json.loads(Path(src).read_text())
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


# engine vs vLLM: (model, prompt lengths, new tokens per request, max_num_seqs, max_num_batched_tokens).
# "smollm2": a seeded random model of SmolLM2-135M's shape (its weights are not shipped or downloaded;
# a step's speed does not depend on their values); "default": the benchmark's model.
VS_VLLM = {
    "SmolLM2-135M shape, 4 prompts 32..128, 64 new": ("smollm2", [32, 64, 96, 128], 64, 4, 512),
    "SmolLM2-135M shape, 1 prompt of 64, 64 new": ("smollm2", [64], 64, 4, 512),
    "default model, 16 prompts 62..1000, 16 new": (
        "default", [round(62 + i * (1000 - 62) / 15) for i in range(16)], 16, 16, 1024),
}
SMOLLM2_135M = dict(src_vocab_size=49152, emb_dim=576, nheads=9, kvheads=3, nlayers=30,
                    hidden_grow_factor=1536 / 576, multiple_of=1, rope_theta=100000.0,
                    max_expected_seq_len=8192, tie_heads=True)


def offline_engine(model, seqs: int, budget: int, compile, max_model_len: int) -> tuple[Engine, float]:
    """A warmed-up engine for `offline_runs` (prefix cache off, as for vLLM) -> (engine, warm-up s)."""
    eng = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=budget, compile=compile,
                 max_model_len=max_model_len, enable_prefix_caching=False)
    return eng, eng.warmup(progress=False)


def offline_runs(eng: Engine, prompts: list[list[int]], new: int, repeats: int) -> list[dict[str, Any]]:
    """`repeats` offline runs of `prompts` (`new` tokens each) -> each run's seconds, output tok/s,
    decode steps/s (1 / mean TPOT) and tokens."""
    runs = []
    for _ in range(repeats):
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
        got: dict[int, list[int]] = {}
        stats: dict[int, dict] = {}  # each request's final statistics (`RequestOutput.stats`)
        t0 = time.perf_counter()
        for out in eng.stream():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                stats[out.request_id] = out.stats
        dt = time.perf_counter() - t0
        runs.append({"duration_s": dt, "output_tok_s": len(prompts) * new / dt,
                     "decode_steps_s": 1 / statistics.fmean(stats[i]["tpot"] for i in ids),
                     "tokens": [got[i] for i in ids]})
    return runs


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with every run's throughput listed."""
    mid = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    return {**mid, "output_tok_s_runs": [r["output_tok_s"] for r in runs],
            "tokens_equal_runs": all(r["tokens"] == runs[0]["tokens"] for r in runs)}


def vs_vllm(args, model, model_path: str | None, out, log=print, repeats: int = 3) -> dict[str, Any]:
    """Each `VS_VLLM` workload through the engine (`args.compile`, `around_vllm`) and vLLM (same
    settings, median of `repeats`), with the decode roofline: the read bandwidth measured here over
    the bytes a decode step reads (every weight once, and the live K/V)."""
    bw = measure_read_bandwidth(model.device)
    res: dict[str, Any] = {"read_bandwidth_gbs": bw, "workloads": {}, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        tmp, models = Path(tmp), {"default": (model, hf_checkpoint_dir(model, model_path, tmp))}
        for name, (which, lens, new, seqs, budget) in VS_VLLM.items():
            if which not in models:  # seeded, without touching the caller's RNG state
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    smol = LLaMA(LLaMAConfig(**SMOLLM2_135M))
                    smol.reset_parameters()
                save_hf_llama(smol, tmp / which)
                models[which] = (get_model(model_path=tmp / which, attn_impl="paged", device=model.device),
                                 tmp / which)
            m, ckpt = models[which]
            g = torch.Generator().manual_seed(args.seed)
            prompts = [torch.randint(3, m.config.src_vocab_size, (n,), generator=g).tolist() for n in lens]
            # one max_model_len for all workloads of a model: the same step shapes, the graphs reused
            span = max(max(w[1]) + w[2] for w in VS_VLLM.values() if w[0] == which)
            log(f"[bench-serve] {name}: engine compile={args.compile} ...")
            eng, warm = offline_engine(m, seqs, budget, args.compile, span)
            job = _job(ckpt, m, prompts, [new] * len(lens), seqs, budget, kv_space_gib=1, repeats=repeats)
            v, runs = around_vllm(job, tmp, out, f"vllm_{which}_{len(lens)}",
                                  lambda e=eng, p=prompts, n=new: offline_runs(e, p, n, 1)[0], repeats, log)
            e = {"compile": args.compile, "warmup_s": warm, **median_run(runs)}
            if "tokens" in v:
                v["tokens_equal_engine"] = v["tokens"] == e["tokens"]
                if len(lens) == 1 and v.get("ttft_s"):
                    v["decode_steps_s"] = (new - 1) / (v["duration_s"] - v["ttft_s"][0])
            read = weight_bytes(m) + (max(lens) + new) * kv_bytes_per_token(m.config, m.dtype)  # bytes
            res["workloads"][name] = {"roofline_steps_s": bw * 1e9 / read, "engine": e, "vllm": v}
    return res


VS_COLUMNS = [("workload", "workload", ""), ("system", "system", ""), ("output tok/s", "output_tok_s", ".1f"),
              ("engine / vLLM", "ratio", ".2f"), ("decode steps/s (% of roofline)", "steps", ""),
              ("start-up s (engine warm-up; vLLM init)", "startup_s", ".1f"), ("greedy tokens", "same", "")]


def vs_vllm_markdown(vs: dict[str, Any]) -> list[str]:
    n, rows = vs.get("repeats", 3), []
    for name, r in vs["workloads"].items():
        e, v = r["engine"], r["vllm"]
        ratio = e["output_tok_s"] / v["output_tok_s"] if "output_tok_s" in v else None
        for system, x in ((f"engine compile={e['compile']}", e), ("vLLM CPU", v)):
            if "error" in x:
                why = x["error"].strip().splitlines()[-1][:120]
                rows.append({"workload": name, "system": system, "output_tok_s": f"did not run: {why}"})
                continue
            steps = x.get("decode_steps_s") if len(x["tokens"]) == 1 else None
            rows.append({"workload": name, "system": system, "output_tok_s": x["output_tok_s"],
                         "ratio": ratio if x is e else None,
                         "steps": steps and f"{steps:.1f} ({100 * steps / r['roofline_steps_s']:.0f}%)",
                         "startup_s": x.get("warmup_s") if x is e else x.get("init_s"),
                         "same": None if x is v or "tokens" not in v else v["tokens"] == e["tokens"]})
    return ["", f"### Engine vs vLLM (read bandwidth {vs['read_bandwidth_gbs']:.1f} GB/s; median of {n} vLLM "
            f"runs, engine median of {2 * n}: {n} before and {n} after vLLM's)", "", table(rows, VS_COLUMNS)]


if __name__ == "__main__":
    keep_freed_cpu_memory()  # the same allocator setting as the engine's process (vLLM: tcmalloc)
    sys.exit(peer_main(*sys.argv[1:4]))
