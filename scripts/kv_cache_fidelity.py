#!/usr/bin/env python
"""8-bit KV pages against 16-bit ones (`kv_cache_dtype`, docs/benchmarks.md "8-bit KV pages"):
fidelity, the scale granularity, decode speed at long contexts and KV bytes per token.

1. Fidelity, teacher-forced over the stdlib documentation (`fms_paged.bench.fidelity.doc_text`,
   through the checkpoint's own tokenizer, BOS windows of --window tokens): each window's first half
   prefilled in chunks of 32, then one decode step per token (`fidelity.cached_logits`), on the paged
   backend with each KV candidate; the reference is the same model and schedule with 16-bit pages
   ("auto"). Perplexity (float64) and top-1 agreement with the reference at every position.
   Candidates: int8 with one scale per token and kv head (what ships; the cpp kernel), int8 with a
   scale per 32 head dims (16 for a head of 32; gather kernel), fp8 e4m3 per token and kv head
   (gather).
2. Granularity offline: the keys and values one window writes (read back from 16-bit pages), each
   quantized by a candidate and compared with the original: relative RMS error (||x - q(x)|| /
   ||x||) and the worst element's error relative to its row's absmax, for symmetric int8
   (absmax / 127) per head, per 64 / 32 dims, affine u8 with a zero point (OpenVINO's form) per head
   and per 32 dims, fp8 e4m3 per head, and KIVI's per-channel keys (over the whole window: what
   incremental writes cannot do without re-quantizing, shown for reference).
3. Decode speed at --contexts tokens, one request, 16-bit vs int8 pages, the pages filled with
   random keys and values (a decode step's cost does not depend on them): --steps timed steps after
   --warmup, alternating the two (ABBA), the median and the minimum per step (the minimum: the
   step least disturbed by other processes on a shared machine).
4. KV bytes per token (every layer's K and V, scales included).

python scripts/kv_cache_fidelity.py [--model-path DIR] [--dtype bfloat16] [--chars 20000] \
    [--contexts 4096,16384] --out results/kv8
Writes <out>/kv_cache_fidelity.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fms_paged.bench.environment import environment_info
from fms_paged.bench.fidelity import bos_windows, cached_logits, doc_text
from fms_paged.kv._pool_ops import read_slots, write_slots
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.quant import dequantize, quantize
from fms_paged.models.registry import default_model_path, get_model
from fms_paged.tokenizers import load_tokenizer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def candidates(head_dim: int) -> list[tuple[str, str, int | None]]:
    """(label, kv_cache_dtype, group) of the paged runs; group None: one scale per token and head."""
    g = 32 if head_dim > 32 else 16
    return [("int8 / head", "int8", None), (f"int8 / {g} dims", "int8", g),
            ("fp8 e4m3 / head", "fp8_e4m3", None)]


def fidelity(model, windows, chunk: int, groups: bool = True) -> dict:
    """Perplexity and top-1 agreement of each candidate against 16-bit pages (`groups`: the
    per-group int8 candidate too)."""
    W = max(len(w) for w in windows)
    runs = [("16-bit (auto)", "auto", None),
            *(c for c in candidates(model.config.head_dim) if groups or c[2] is None)]
    caches = {label: PagedCache(model, 1, W, kv_cache_dtype=kv, kv_group=g) for label, kv, g in runs}
    nll = {label: 0.0 for label, _, _ in runs}
    agree = {label: 0 for label, _, _ in runs}
    n = 0
    for i, w in enumerate(windows):
        target = torch.tensor(w[1:])
        ref = None
        for label, _, _ in runs:
            logits = cached_logits(model, caches[label], w, chunk)[:-1].double()  # [n - 1, V]
            nll[label] += F.cross_entropy(logits, target, reduction="sum").item()
            top = logits.argmax(-1)
            ref = top if ref is None else ref
            agree[label] += int((top == ref).sum())
        n += len(w) - 1
        log(f"[fidelity] window {i + 1}/{len(windows)}")
    base = math.exp(nll["16-bit (auto)"] / n)
    out = {}
    for label, kv, g in runs:
        ppl = math.exp(nll[label] / n)
        out[label] = {"kv_cache_dtype": kv, "group": g, "kernel": caches[label].kernel.name, "ppl": ppl,
                      "ppl_rel_pct": 100 * (ppl - base) / base, "top1_agree_pct": 100 * agree[label] / n}
    return {"positions": n, "systems": out}


def affine_u8(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Affine u8 with a zero point per group (OpenVINO's KV form), quantized and dequantized."""
    *lead, D = x.shape
    xg = x.reshape(*lead, groups, D // groups)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    q = ((xg - lo) / scale).round().clamp(0, 255)
    return (q * scale + lo).reshape(x.shape)


def per_channel(x: torch.Tensor) -> torch.Tensor:
    """KIVI's keys: symmetric int8 with one scale per channel over all tokens. x: [Hkv, T, D]."""
    s = x.abs().amax(1, keepdim=True) / 127
    return (x / s.clamp(min=1e-12)).round().clamp(-127, 127) * s


def granularity(model, window: list[int]) -> dict:
    """The errors of each quantizer on the keys and values `window` writes (every layer)."""
    cache = PagedCache(model, 1, len(window))
    with torch.inference_mode():
        tokens, positions, step, _ = cache.prefill([0], [window])
        model(tokens, positions, step)
    slots = cache.pm.slots([0] * len(window), list(range(len(window))))
    D = model.config.head_dim
    quantizers = {"int8 sym / head": lambda x: dequantize(*quantize(x, torch.int8, 1), torch.float64)}
    for g in (64, 32):
        if g < D:
            quantizers[f"int8 sym / {g} dims"] = (
                lambda x, g=g: dequantize(*quantize(x, torch.int8, D // g), torch.float64))
    quantizers["u8 affine / head"] = lambda x: affine_u8(x, 1)
    quantizers["u8 affine / 32 dims"] = lambda x: affine_u8(x, max(1, D // 32))
    quantizers["fp8 e4m3 / head"] = lambda x: dequantize(*quantize(x, torch.float8_e4m3fn, 1), torch.float64)
    quantizers["int8 per channel (KIVI keys, whole window)"] = per_channel
    sums = {name: {"k": [0.0, 0.0, 0.0], "v": [0.0, 0.0, 0.0]} for name in quantizers}  # err2, norm2, worst
    for layer in range(model.config.nlayers):
        kv = read_slots(cache.k_pools[layer], cache.v_pools[layer], slots)  # [1, Hkv, T, D] each
        for which, x in zip("kv", kv):
            x = x[0].double()  # [Hkv, T, D]
            amax = x.abs().amax(-1, keepdim=True)
            for name, q in quantizers.items():
                err = q(x.float()).double() - x
                s = sums[name][which]
                s[0] += float((err**2).sum())
                s[1] += float((x**2).sum())
                s[2] = max(s[2], float((err.abs() / amax.clamp(min=1e-30)).max()))
    return {name: {f"{w}_rel_rms_pct": 100 * math.sqrt(v[0] / v[1]) for w, v in s.items()}
            | {f"{w}_worst_of_absmax_pct": 100 * v[2] for w, v in s.items()} for name, s in sums.items()}


def fill(cache: PagedCache, n: int, gen: torch.Generator) -> None:
    """Seq 0 holds n tokens of random keys and values in every layer (as ASSIGN writes them)."""
    cache.backend.prepare_pages(cache.pm.reserve([0], [n]))
    slots = cache.pm.slots([0] * n, list(range(n)))
    c, dt = cache.backend, cache.backend.view.compute_dtype
    for layer in range(len(c.k_pools)):
        H, D = c.k_pools[layer].shape[1], c.k_pools[layer].shape[3]
        k, v = (torch.randn(n, H, D, generator=gen).to(dt) for _ in range(2))
        write_slots(c.k_pools[layer], c.v_pools[layer], slots, k, v, *c.view.scales(layer))


def decode_speed(model, contexts: list[int], steps: int, warmup: int) -> dict:
    """Median seconds per decode step of one request at each context, 16-bit vs int8 pages."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for n in contexts:
        room = n + steps + warmup + 8
        caches = {kv: PagedCache(model, 1, room, kv_cache_dtype=kv) for kv in ("auto", "int8")}
        for c in caches.values():
            fill(c, n, gen)
        times = {kv: [] for kv in caches}
        lengths = dict.fromkeys(caches, n)
        with torch.inference_mode():
            for i in range(warmup + steps):
                for kv in ("auto", "int8") if i % 2 == 0 else ("int8", "auto"):  # ABBA
                    tokens, positions, step = caches[kv].decode([0], torch.tensor([1]), [lengths[kv]], [True])
                    t0 = time.perf_counter()
                    model(tokens, positions, step)
                    if i >= warmup:
                        times[kv].append(time.perf_counter() - t0)
                    lengths[kv] += 1
        med = {kv: statistics.median(t) for kv, t in times.items()}
        low = {kv: min(t) for kv, t in times.items()}  # the least disturbed step (a shared machine)
        out[n] = {"auto_ms": 1e3 * med["auto"], "int8_ms": 1e3 * med["int8"],
                  "int8_over_auto": med["int8"] / med["auto"],
                  "auto_min_ms": 1e3 * low["auto"], "int8_min_ms": 1e3 * low["int8"],
                  "int8_over_auto_min": low["int8"] / low["auto"],
                  "kernels": {kv: c.kernel.name for kv, c in caches.items()}}
        log(f"[speed] {n}: {out[n]}")
    return out


def kv_bytes_per_token(model) -> dict:
    out = {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        c = PagedCache(model, 1, 64, num_pages=5, kv_cache_dtype=kv)
        out[kv] = c.kv_bytes / (5 * c.pm.page_size)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="checkpoint dir (default: the embedded default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chars", type=int, default=20_000)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--contexts", default="4096,16384", help="decode-speed contexts ('' for none)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--no-fidelity", action="store_true")
    p.add_argument("--no-groups", action="store_true", help="leave out the per-group int8 candidate")
    p.add_argument("--out", default="results/kv8")
    a = p.parse_args(argv)
    path = a.model_path or str(default_model_path())
    contexts = [int(c) for c in a.contexts.split(",") if c]
    longest = max([a.window, *contexts]) + a.steps + a.warmup + 16
    model = get_model(model_path=path, attn_impl="paged", dtype=a.dtype, device="cpu",
                      max_expected_seq_len=max(longest, 2048)).eval()
    c = model.config
    res = {"model": path, "dtype": a.dtype, "shape": {"nlayers": c.nlayers, "kvheads": c.kvheads,
                                                       "head_dim": c.head_dim, "page_size": c.page_size},
           "environment": environment_info(torch.device("cpu")),
           "kv_bytes_per_token": kv_bytes_per_token(model)}
    if not a.no_fidelity:
        tok = load_tokenizer(path)
        text = doc_text(a.chars)
        windows = bos_windows(tok.encode(text, add_special_tokens=False), a.window, tok.bos_id
                              if tok.bos_id is not None else c.bos_token_id)
        res["text"] = {"chars": len(text), "windows": len(windows), "window": a.window}
        res["granularity"] = granularity(model, windows[0])
        log(json.dumps(res["granularity"], indent=1))
        res["fidelity"] = fidelity(model, windows, a.chunk, not a.no_groups)
        log(json.dumps(res["fidelity"], indent=1))
    if contexts:
        res["decode_speed"] = decode_speed(model, contexts, a.steps, a.warmup)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_cache_fidelity.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "environment"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
