"""`make bench-kv`: the KV bytes a paged engine holds per layer group, on a Gemma 3 270M-shaped model
(random weights written by transformers' own `Gemma3TextConfig` at the published shape: 18 layers,
15 sliding at a 512-token window and 3 full, one kv head of 256), in one process.

- **Held against needed** per layer group, for one request at 4x, 16x and 64x the window (2k, 8k and
  32k tokens): the pages its slices hold at its last decode step against what its next token reads
  (every token's K and V on a full layer, the window's on a sliding one).
- **One long request**: the KV bytes it holds at most, and the process's resident memory (RSS)
  growth over it, step by step: resident memory follows the pages held, because a sliding group's
  pages are reused as its window passes them (the pool is allocated untouched).
Each with the pages in the model's dtype and in int8 (`--kv-cache-dtypes`).
- **Capacity**: how many 8k-token requests a fixed KV budget holds at once, with pages held per
  layer group against one page table for every layer (what the engine did before groups): the
  page manager's own RESERVE and window release, grown in the engine's prefill chunks (host
  bookkeeping, no forward).

Writes <out>/results.json, results.md (printed), kv_held.png and rss_over_request.png (the longest
request's KV held and RSS growth, step by step).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fms_paged.bench.environment import environment_info, kv_accounting
from fms_paged.bench.report import MiB, plot, table
from fms_paged.engine import Engine, SamplingParams
from fms_paged.kv.budget import page_bytes
from fms_paged.kv.groups import layer_groups
from fms_paged.kv.page_groups import GroupedPages
from fms_paged.kv.page_manager import OutOfPages, PageManager
from fms_paged.kv.paged import attention_specs
from fms_paged.kv.quant import check_kv_cache_dtype
from fms_paged.models.registry import get_model

WINDOW = 512
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
                   max_position_embeddings=32768 + 1024, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0,
                   query_pre_attn_scalar=256, tie_word_embeddings=True)


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random-weight Gemma 3 270M-shaped checkpoint (fp32 safetensors) made by transformers."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**GEMMA3_270M)
    transformers.Gemma3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_request(eng: Engine, length: int, chunk: int, seed: int) -> dict[str, Any]:
    """One request of `length` tokens (a prompt of length - 4, 4 new): its KV per group at its last
    decode step, the most KV bytes it held at once, and RSS growth over it."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, eng.vocab_size, (length - 4,), generator=g).tolist()
    rss0 = _rss()
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    most_kv = most_rss = 0
    last: dict[str, Any] = {}
    trace: list[tuple[int, int, int]] = []  # (tokens computed, KV bytes held, RSS growth) per step
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        grew = _rss() - rss0
        most_rss = max(most_rss, grew)
        running = [r for r in eng.scheduler.running if r.request_id == rid]
        if running:
            r = running[0]
            kv = kv_accounting(eng.backend, [r.num_computed], eng.model.config, eng.model.dtype,
                               [s.window for s in attention_specs(eng.model)])
            most_kv = max(most_kv, kv["kv_bytes_held"])
            last = kv
            trace.append((r.num_computed, kv["kv_bytes_held"], grew))
    return {"length": length, "chunk": chunk, "seconds": time.perf_counter() - t0,
            "kv_bytes_held_last": last.get("kv_bytes_held"),
            "kv_bytes_needed_last": last.get("kv_bytes_needed"),
            "by_group": last.get("by_group", []), "kv_bytes_held_most": most_kv, "rss_growth_most": most_rss,
            "trace": trace}


def capacity(specs, page_bytes_by_layers: int, budget: int, P: int, length: int, chunk: int,
             grouped: bool, max_seqs: int = 1024) -> int:
    """Requests of `length` tokens that `budget` bytes of KV pages hold at once: sequences grown one
    after another to `length` tokens in prefill chunks of `chunk`, the pages behind each sliding
    window released before each chunk and before its first decode step (as the engine's scheduler
    does), until RESERVE runs out."""
    groups = layer_groups(specs, grouped=grouped)
    num_pages = budget // (page_bytes_by_layers * groups.layers_per_slice)
    pm = (GroupedPages(groups, num_pages, P, max_seqs, max_seq_len=length) if groups.grouped
          else PageManager(num_pages, P, max_seqs, max_seq_len=length))
    horizon = None if groups.grouped else groups.windows[0]
    for s in range(max_seqs):
        for done in range(0, length, chunk):
            if done:
                pm.release_behind_window([s], [done], horizon)
            try:
                pm.reserve([s], [min(done + chunk, length)])
            except OutOfPages:
                return s
        pm.release_behind_window([s], [length], horizon)  # (its next step, a decode, releases so)
    return max_seqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-kv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench-kv")
    p.add_argument("--model-path", help="a Gemma 3 checkpoint (default: a random one of 270M's shape)")
    p.add_argument("--lengths", default="2048,8192,32768", help="request lengths (4x, 16x, 64x the window)")
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (llama.cpp's ubatch)")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per page: a window's pages hold up to one page more than the window")
    p.add_argument("--budget-gib", type=float, default=2.0, help="KV budget of the capacity table")
    p.add_argument("--capacity-length", type=int, default=8192)
    p.add_argument("--kv-cache-dtypes", default="auto,int8", help="what the pages store, one run each")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    dtypes = [check_kv_cache_dtype(x) for x in args.kv_cache_dtypes.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model_path) if args.model_path else write_checkpoint(Path(tmp) / "gemma3-270m")
        model = get_model(model_path=path, attn_impl="paged", device="cpu", dtype=torch.bfloat16,
                          page_size=args.page_size)
    c = model.config
    specs = attention_specs(model)
    runs, cap, groups = [], [], ""
    budget = int(args.budget_gib * (1 << 30))
    for kv in dtypes:
        eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=args.chunk,
                     max_model_len=max(lengths) + 16, enable_prefix_caching=False, kv_cache_dtype=kv)
        groups = eng.backend.groups.describe()
        one_request(eng, 2 * args.chunk, args.chunk, seed=99)  # warm-up: a step's buffers exist before
        runs += [{**one_request(eng, n, args.chunk, seed=i), "kv_cache_dtype": kv}
                 for i, n in enumerate(lengths)]
        eng.shutdown()
        del eng
        per_layer_page = page_bytes(1, c.kvheads, c.head_dim, c.page_size, model.dtype, kv)
        for grouped in (False, True):
            layout = "pages per layer group" if grouped else "one page table for every layer"
            held = capacity(specs, per_layer_page, budget, c.page_size, args.capacity_length, args.chunk,
                            grouped=grouped)
            cap.append({"kv_cache_dtype": kv, "layout": layout, "length": args.capacity_length,
                        "budget_bytes": budget, "requests": held})
    res = {"model": f"Gemma 3 270M shape, random weights, bf16, pages of {c.page_size}", "groups": groups,
           "runs": runs, "capacity": cap, "environment": environment_info(model.device)}
    rows = []
    for r in runs:
        for gr in r["by_group"]:
            name = "full" if gr["window"] is None else f"window {gr['window']}"
            rows.append({"kv": r["kv_cache_dtype"], "length": r["length"], "group": name,
                         "layers": gr["layers"], "needed": gr["kv_bytes_needed"] / MiB,
                         "held": gr["kv_bytes_held"] / MiB, "ratio": gr["held_over_needed"]})
    md = [f"## KV held per layer group, {res['model']} ({res['groups']}), "
          f"{res['environment'].get('device_name', '')}\n",
          table(rows, [("kv_cache_dtype", "kv", ""), ("request tokens", "length", "d"),
                       ("group", "group", ""), ("layers", "layers", "d"), ("KV needed MiB", "needed", ".2f"),
                       ("KV held MiB", "held", ".2f"), ("held / needed", "ratio", ".3f")]),
          "\n### One request: most KV held, RSS growth\n",
          table([{**r, "kv": r["kv_bytes_held_most"] / MiB, "rss": r["rss_growth_most"] / MiB} for r in runs],
                [("kv_cache_dtype", "kv_cache_dtype", ""), ("request tokens", "length", "d"),
                 ("chunk", "chunk", "d"), ("most KV held MiB", "kv", ".1f"),
                 ("RSS growth MiB", "rss", ".1f"), ("seconds", "seconds", ".1f")]),
          f"\n### Capacity: {args.capacity_length}-token requests held at once in {args.budget_gib:g} GiB of "
          f"KV pages\n",
          table(cap, [("kv_cache_dtype", "kv_cache_dtype", ""), ("pages", "layout", ""),
                      ("requests", "requests", "d")])]
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plot(out / "kv_held.png", [{
        "title": "KV per layer group at the last decode step", "xlabel": "request tokens", "ylabel": "MiB",
        "logy": True, "series": [
            {"label": f"{kind} {g} ({kv})",
             "x": [r["length"] for r in rows if (r["group"], r["kv"]) == (g, kv)],
             "y": [r[kind] for r in rows if (r["group"], r["kv"]) == (g, kv)],
             "fmt": "o-" if kind == "held" else "s--"}
            for kv in dtypes for g in dict.fromkeys(r["group"] for r in rows)
            for kind in ("needed", "held")]}])
    series = []
    for kv in dtypes:
        longest = max((r for r in runs if r["kv_cache_dtype"] == kv), key=lambda r: r["length"])
        series += [{"label": f"KV held, {kv}", "x": [t[0] for t in longest["trace"]],
                    "y": [t[1] / MiB for t in longest["trace"]], "fmt": "-"},
                   {"label": f"RSS growth since the request arrived, {kv}",
                    "x": [t[0] for t in longest["trace"]], "y": [t[2] / MiB for t in longest["trace"]],
                    "fmt": "--"}]
    plot(out / "rss_over_request.png", [{
        "title": f"one request of {max(lengths)} tokens: KV held and RSS growth", "xlabel": "tokens computed",
        "ylabel": "MiB", "series": series}])
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
