"""GGUF Q8_0 / Q4_0 files on the qgemv kernel (`fms_paged/csrc/kernels/qgemv.cpp`) beside llama.cpp
on the same file, each system in a process of its own (docs/benchmarks.md, "Quantized GGUF kernels").

    python -m benchmarks.gguf_blocks FILE.gguf [FILE.gguf ...] [--rounds 2] [--out results/gguf-blocks]

Workloads (greedy, every request making all its tokens, prefix caching off): one stream (prompt 64,
64 new), four streams (prompts 80, 64 new each), and a prefill of 512 tokens (one request, two new
tokens). Output tok/s is new tokens over a run's wall time (the prefill's included), the median
of `repeats` timed runs after a warm-up run, as `make bench-native` reports it; prefill tok/s is
512 over the run's time (the prefill and one decode step, for both systems). The engine:
`benchmarks.vs_native_engine` (default settings) with the model in `--dtype` (its activations and
KV pages); llama.cpp: `scripts/peer_llamacpp.py` (.venv-llamacpp), f16 KV cache. Steady RSS: each
process's resident memory sampled every 50 ms, the median over its last half (the timed runs).
Systems alternate within a round and the order flips every other round (A B, B A): a shared VM's
speed drifts over minutes. `--cores 0` pins both systems to those cores (taskset; llama.cpp takes
as many threads as its affinity mask has cores, the engine OMP_NUM_THREADS of them): on a machine
that other jobs oversubscribe, two threads that meet at a barrier per operation wait for each
other's time slices, and both systems then measure the scheduler more than their kernels.
`--dequantized` adds a third system: ours on the same file with `gguf_blocks=False` (every tensor
dequantized at load into `--dtype`, the dense kernels). Writes OUT/gguf_blocks.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import REPO_ROOT, checkout_env

LLAMACPP_PY = Path(os.environ.get("LLAMACPP_PY", REPO_ROOT / ".venv-llamacpp" / "bin" / "python"))
WORKLOADS = {"one stream": (1, 64, 64), "four streams": (4, 80, 64), "prefill 512": (1, 512, 2)}


def requests(n: int, prompt: int, new: int, vocab: int = 49152) -> list[dict]:
    import random

    rng = random.Random(n * 1000 + prompt)
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(prompt)], "max_new_tokens": new}
            for _ in range(n)]


def vocab_size(path: Path) -> int:
    """The file's vocabulary: its tokenizer's tokens (the prompts' ids are drawn below it)."""
    from fms_paged.models.gguf import open_gguf

    return len(open_gguf(path).fields["tokenizer.ggml.tokens"].data)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_job(cmd: list[str], job: dict, tmp: Path, tag: str, cores: str | None = None) -> dict:
    src, dst = tmp / f"{tag}.in.json", tmp / f"{tag}.out.json"
    src.write_text(json.dumps(job))
    env = checkout_env()
    if cores:
        cmd = ["taskset", "-c", cores, *cmd]
        env["OMP_NUM_THREADS"] = str(len(cores.split(",")))
    proc = subprocess.Popen([*cmd, str(src), str(dst)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    samples: list[float] = []

    def sample() -> None:
        while proc.poll() is None:
            r = rss_mb(proc.pid)
            if r is not None:
                samples.append(r)
            time.sleep(0.05)

    t = threading.Thread(target=sample)
    t.start()
    out, err = proc.communicate()
    t.join()
    if proc.returncode or not dst.exists():
        return {"error": (err or out)[-1500:]}
    res = json.loads(dst.read_text())
    res["steady_rss_mb"] = statistics.median(samples[len(samples) // 2:]) if samples else None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--cores", default=None, help="pin both systems to these cores (taskset -c), e.g. 0")
    ap.add_argument("--out", type=Path, default=Path("results/gguf-blocks"))
    ap.add_argument("--dequantized", action="store_true", help="also ours with gguf_blocks=False")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    systems = {"fms_paged": [sys.executable, "-m", "benchmarks.vs_native_engine"],
               "llama.cpp": [str(LLAMACPP_PY), str(REPO_ROOT / "scripts" / "peer_llamacpp.py")]}
    if args.dequantized:
        systems["fms_paged dequantized"] = systems["fms_paged"]
    results: dict[str, dict] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in args.files:
            for w in args.workloads.split(","):
                n, prompt, new = WORKLOADS[w]
                job = {"model_path": str(f.resolve()), "requests": requests(n, prompt, new, vocab_size(f)),
                       "max_num_seqs": n, "max_num_batched_tokens": 512, "repeats": args.repeats}
                for r in range(args.rounds):
                    order = list(systems) if r % 2 == 0 else list(systems)[::-1]
                    for name in order:
                        ours = name.startswith("fms_paged")
                        dtype = args.dtype if ours else "float16"
                        extra = {"gguf_blocks": False} if name == "fms_paged dequantized" else {}
                        loads.append(os.getloadavg()[0])
                        res = run_job(systems[name], {**job, "dtype": dtype, **extra}, Path(tmp),
                                      f"{name.replace(' ', '-')}-{r}", args.cores)
                        key = f"{f.name} | {w} | {name}"
                        results.setdefault(key, {"runs": []})["runs"].append(res)
                        rate = res.get("output_tok_s")
                        if w == "prefill 512" and res.get("duration_s"):
                            # the prompt over the run (its prefill and one decode step), alike for both
                            rate = res["prefill_tok_s"] = prompt / res["duration_s"]
                        print(f"{key} round {r}: {rate} tok/s, rss {res.get('steady_rss_mb')} MB "
                              f"{res.get('error', '')[:300]}", flush=True)
    rows = []
    for key, v in results.items():
        f, w, name = key.split(" | ")
        metric = "prefill_tok_s" if w == "prefill 512" else "output_tok_s"
        rates = [r[metric] for r in v["runs"] if r.get(metric)]
        rss = [r["steady_rss_mb"] for r in v["runs"] if r.get("steady_rss_mb")]
        v.update(median=statistics.median(rates) if rates else None,
                 rss_mb=statistics.median(rss) if rss else None)
        rows.append((f, w, name, v["median"], v["rss_mb"]))
    (args.out / "gguf_blocks.json").write_text(json.dumps({"results": results, "load_avg": loads}, indent=1))
    deq = " | dequantized tok/s | blocks / dequantized" if args.dequantized else ""
    lines = ["| file | workload | fms_paged tok/s | llama.cpp tok/s | ratio | RSS fms_paged / llama.cpp MB"
             f"{deq} |",
             "|---|---|---|---|---|---|" + ("---|---|" if deq else "")]
    for f in args.files:
        for w in args.workloads.split(","):
            a = results.get(f"{f.name} | {w} | fms_paged", {})
            b = results.get(f"{f.name} | {w} | llama.cpp", {})
            ra, rb = a.get("median"), b.get("median")
            ratio = f"{ra / rb:.2f}x" if ra and rb else "-"
            rss_a, rss_b = a.get("rss_mb"), b.get("rss_mb")
            row = (f"| {f.name} | {w} | {ra and round(ra, 1)} | {rb and round(rb, 1)} | {ratio} | "
                   f"{rss_a and round(rss_a)} / {rss_b and round(rss_b)} |")
            if deq:
                rd = results.get(f"{f.name} | {w} | fms_paged dequantized", {}).get("median")
                row += f" {rd and round(rd, 1)} | {f'{ra / rd:.2f}x' if ra and rd else '-'} |"
            lines.append(row)
    lines.append(f"\nload average (1 min) at each process's start: {min(loads):.1f} .. {max(loads):.1f}")
    (args.out / "gguf_blocks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
