#!/usr/bin/env python
"""8-bit KV pages against 16-bit ones (`kv_cache_dtype`, docs/benchmarks.md "8-bit KV pages"):
fidelity, the scale granularity, decode speed at long contexts and KV bytes per token.

1. Fidelity, teacher-forced over the stdlib documentation (`fms_paged.bench.fidelity.doc_text`,
   through the checkpoint's own tokenizer, BOS windows of --window tokens): each window's first half
   prefilled in chunks of 32, then one decode step per token (`fidelity.cached_logits`), on the paged
   backend with each KV form that ships (--kv: int8 through the cpp kernel, fp8 e4m3 through
   gather); the reference is the same model and schedule with 16-bit pages ("auto"). Perplexity
   (float64) and top-1 agreement with the reference at every position.
1b. Quantizers screened by fake-quant (--screen): every layer's keys and values, after RoPE,
   quantized and dequantized by a candidate, then attended causally over the whole window in one
   forward without a cache; the same function as pages quantized on write and read back (a
   token's own key is read from its page too), computed in one forward a window instead of a
   decode step a token. Candidates: symmetric int8 per head, per 32 and per 16 dims, affine u8
   with a zero point (OpenVINO's form) per head and per 32 dims, keys affine per 32 dims with
   values symmetric per head, fp8 e4m3 per head; and the model in fp32 with no quantization, the
   scale for what an agreement means (the bf16 model's own rounding moves that many argmaxes).
   --screen-fp32 repeats the screen in the fp32 model against fp32 K/V, with bf16 K/V as a
   candidate: what quantizing K/V alone moves, without the bf16 arithmetic of the rest; and each
   8-bit form against the same fp32 model with bf16 (16-bit) K/V ("vs_bf16_kv").
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
    [--kv int8,fp8_e4m3] [--screen] [--screen-fp32] [--contexts 4096,16384] --out results/kv8
Writes <out>/kv_cache_fidelity.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from fms_paged.kv.spec import attend
from fms_paged.models.registry import default_model_path, get_model
from fms_paged.tokenizers import load_tokenizer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fidelity(model, windows, chunk: int, kinds: list[str]) -> dict:
    """Perplexity and top-1 agreement of 8-bit pages of each of `kinds` (one scale per token and kv
    head, as they ship) against 16-bit pages."""
    W = max(len(w) for w in windows)
    runs = ["auto", *kinds]
    caches = {kv: PagedCache(model, 1, W, kv_cache_dtype=kv) for kv in runs}
    nll = dict.fromkeys(runs, 0.0)
    agree = dict.fromkeys(runs, 0)
    n = 0
    for i, w in enumerate(windows):
        target = torch.tensor(w[1:])
        ref = None
        for kv in runs:
            logits = cached_logits(model, caches[kv], w, chunk)[:-1].double()  # [n - 1, V]
            nll[kv] += F.cross_entropy(logits, target, reduction="sum").item()
            top = logits.argmax(-1)
            ref = top if ref is None else ref
            agree[kv] += int((top == ref).sum())
        n += len(w) - 1
        log(f"[fidelity] window {i + 1}/{len(windows)}")
    base = math.exp(nll["auto"] / n)
    out = {}
    for kv in runs:
        ppl = math.exp(nll[kv] / n)
        out[kv] = {"kernel": caches[kv].kernel.name, "ppl": ppl, "ppl_rel_pct": 100 * (ppl - base) / base,
                   "top1_agree_pct": 100 * agree[kv] / n, "differ": n - agree[kv]}
    return {"positions": n, "systems": out}


def symmetric(x: torch.Tensor, group: int, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """`quant.quantize` (int8: absmax / 127, fp8 e4m3: absmax / 448) per group of `group` dims,
    then dequantized: x [..., D] -> [..., D] fp32."""
    return dequantize(*quantize(x, dtype, x.shape[-1] // group), torch.float32)


class FakeQuantStep:
    """A no-cache attention step that quantizes and dequantizes each layer's k and v ([B, Hkv, S, D],
    after RoPE) with `fk` / `fv` (None: as they are), then attends causally (`fms_paged.kv.spec`)."""

    def __init__(self, model, fk, fv):
        self.model, self.fk, self.fv = model, fk, fv

    def prepare(self) -> FakeQuantStep:
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k if self.fk is None else self.fk(k).to(k.dtype)
        v = v if self.fv is None else self.fv(v).to(v.dtype)
        return attend(q, k, v, self.model.layers[layer].attn.spec, mask=None, is_causal=True)


def screen(model, model32, windows, fp32_ref: bool = False) -> dict:
    """Top-1 agreement and perplexity of fake-quantized K/V candidates (module docstring, 1b) against
    the same model's K/V as computed, over every window in one forward each (no cache). `fp32_ref`:
    in `model32` against fp32 K/V, with bf16 K/V as a candidate; else in `model` with `model32`
    unquantized as a candidate."""
    if any(layer.attn.spec.window is not None for layer in model.layers):
        raise ValueError("the screen attends causally over the whole window: a model without sliding layers")
    D = model.config.head_dim
    g = 32 if D > 32 else D
    sym = {"head": lambda x: symmetric(x, D), f"{g}": lambda x: symmetric(x, g),
           "16": lambda x: symmetric(x, min(16, D))}
    aff = {"head": lambda x: affine_u8(x, 1), f"{g}": lambda x: affine_u8(x, D // g)}
    m = model32 if fp32_ref else model
    cands = {"reference": (m, None, None)}
    if fp32_ref:
        bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
        cands["bf16 K/V"] = (m, bf, bf)
    else:
        cands["model in fp32, K/V unquantized"] = (model32, None, None)
    cands |= {f"int8 sym / {name}": (m, f, f) for name, f in sym.items()}
    cands |= {f"u8 affine / {name}": (m, f, f) for name, f in aff.items()}
    cands[f"K u8 affine / {g}, V int8 sym / head"] = (m, aff[f"{g}"], sym["head"])
    f8 = lambda x: symmetric(x, D, torch.float8_e4m3fn)  # noqa: E731
    cands["fp8 e4m3 / head"] = (m, f8, f8)
    nll = dict.fromkeys(cands, 0.0)
    agree = dict.fromkeys(cands, 0)
    agree16 = dict.fromkeys(cands, 0)  # (fp32_ref) with the argmax of bf16 K/V: the same model's 16-bit KV
    n = 0
    with torch.inference_mode():
        for i, w in enumerate(windows):
            t = torch.tensor([w])  # [1, n]
            target, ref, ref16 = t[0, 1:], None, None
            for name, (mm, fk, fv) in cands.items():
                step = None if fk is None and fv is None else FakeQuantStep(mm, fk, fv)
                logits = mm(t, torch.arange(len(w))[None], step)[0, :-1].double()  # [n - 1, V]
                nll[name] += F.cross_entropy(logits, target, reduction="sum").item()
                top = logits.argmax(-1)
                ref = top if ref is None else ref
                agree[name] += int((top == ref).sum())
                if fp32_ref:  # (the candidates after "reference": bf16 K/V first)
                    ref16 = top if name == "bf16 K/V" else ref16
                    agree16[name] += int((top == ref16).sum()) if ref16 is not None else 0
            n += len(w) - 1
            log(f"[screen{' fp32' if fp32_ref else ''}] window {i + 1}/{len(windows)}")
    base = math.exp(nll["reference"] / n)
    ref_name = "the model in fp32, K/V unquantized" if fp32_ref else "the model, K/V unquantized"
    out = {"positions": n, "reference": ref_name,
           "candidates": {name: {"ppl": math.exp(nll[name] / n),
                                 "ppl_rel_pct": 100 * (math.exp(nll[name] / n) - base) / base,
                                 "top1_agree_pct": 100 * agree[name] / n, "differ": n - agree[name]}
                          for name in cands}}
    if fp32_ref:  # against the same fp32 model with 16-bit (bf16) K/V: the 8-bit forms' own effect
        base16 = math.exp(nll["bf16 K/V"] / n)
        for name, c in out["candidates"].items():
            if name not in ("reference", "bf16 K/V"):
                c["vs_bf16_kv"] = {"ppl_rel_pct": 100 * (c["ppl"] - base16) / base16,
                                   "top1_agree_pct": 100 * agree16[name] / n}
    return out


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
    p.add_argument("--kv", default="int8,fp8_e4m3", help="8-bit forms of the paged fidelity runs")
    p.add_argument("--screen", action="store_true", help="the fake-quant screen of quantizers (1b)")
    p.add_argument("--screen-fp32", action="store_true", help="the screen in the fp32 model (1b)")
    p.add_argument("--out", default="results/kv8")
    a = p.parse_args(argv)
    # a first start's kernels build in the background while torch's operations stand in: wait for
    # them, so that every measured call takes one path
    os.environ.setdefault("FMS_PAGED_WAIT_FOR_BUILDS", "1")
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
        res["positions"] = sum(len(w) - 1 for w in windows)
        if a.screen or a.screen_fp32:
            model32 = get_model(model_path=path, attn_impl="paged", dtype="float32", device="cpu",
                                max_expected_seq_len=max(longest, 2048)).eval()
            for key, on, fp32_ref in (("screen", a.screen, False), ("screen_fp32", a.screen_fp32, True)):
                if on:
                    res[key] = screen(model, model32, windows, fp32_ref)
                    log(json.dumps(res[key], indent=1))
        kinds = [k for k in a.kv.split(",") if k]
        if kinds:
            res["fidelity"] = fidelity(model, windows, a.chunk, kinds)
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
