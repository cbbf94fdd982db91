"""Timed generation: scenarios (single / mixed / chat), TTFT and per-token latency, and the decode
micro-benchmark (dense vs paged ms/step at fixed contexts, with the step-metadata share).

One model serves both backends: the model's forward is driven by the `step` a backend builds, so the
same weights run dense (`DenseBackend`) and paged (`PagedBackend`) in the same process and run.
Timing: warm-up first, `sync` before every clock read, `time.perf_counter`, medians and percentiles
over the steady state (decode steps after `warmup`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fms_paged.bench.environment import decode_roofline_ms, sync
from fms_paged.bench.memory import kv_accounting, min_pages
from fms_paged.engine.model_step import decode_fn
from fms_paged.kv.cache import DenseBackend
from fms_paged.modules import RotaryEmbedding

SCENARIOS = ("single", "mixed", "chat")
# lengths at scale 1.0
SINGLE_LEN = 8000
MIXED_RANGE, MIXED_N = (500, 8000), 16
CHAT_TURNS, CHAT_MSG = 8, 1000
DECODE_CONTEXTS, DECODE_BATCH = (512, 2048, 8192), 8
DECODE_MODES = ("eager", "compiled")
MASK_TIMING_STEPS = 16  # decode steps that time the BlockMask build (see time_decode)


# ---------------------------------------------------------------------------- models and backends
def load_model(spec: dict[str, Any], attn_impl: str = "sdpa") -> torch.nn.Module:
    """spec: {"variant" | "model_path" | neither (default model), "device", "dtype", "seed",
    optional "page_size", and "nlayers" (with a variant)}."""
    from fms_paged.models.registry import get_model

    return get_model(
        variant=spec.get("variant"),
        model_path=spec.get("model_path"),
        attn_impl=attn_impl,
        device=spec.get("device", "auto"),
        dtype=spec.get("dtype"),
        seed=spec.get("seed", 0),
        **({"page_size": spec["page_size"]} if spec.get("page_size") else {}),
        **({"nlayers": spec["nlayers"]} if spec.get("nlayers") else {}),
    )


def with_config(model: torch.nn.Module, **changes: Any) -> torch.nn.Module:
    """A shallow twin sharing every weight, whose config differs by `changes` (another backend,
    another page size)."""
    twin = copy.copy(model)
    twin.config = dataclasses.replace(model.config, **changes)
    return twin


def make_backend(
    model, impl: str, max_batch: int, max_seq_len: int, *, kernel: str = "auto", num_pages: int | None = None
):
    if impl == "sdpa":
        return DenseBackend(model, max_batch, max_seq_len)
    from fms_paged.kv.paged import PagedBackend

    return PagedBackend(model, max_batch, max_seq_len, num_pages=num_pages, kernel=kernel)


def pool_pages(lengths: Sequence[int], page_size: int, slack_pages: int = 0) -> int:
    """Pages for a pool sized to the workload: every sequence at its final length + the null page."""
    return min_pages(lengths, page_size) + 1 + slack_pages


# ---------------------------------------------------------------------------- scenarios
def scenario_plan(name: str, scale: float, max_len: int, new_tokens: int) -> dict[str, Any]:
    """Prompt lengths of a scenario at `scale`, clipped so every sequence fits `max_len`."""
    cap = max_len - new_tokens
    if cap < 2:
        raise ValueError(f"new_tokens={new_tokens} leaves no room in max_len={max_len}")
    clip = lambda n: int(min(max(2, round(n * scale)), cap))
    if name == "single":
        plan = {"prompt_lengths": [clip(SINGLE_LEN)]}
    elif name == "mixed":
        raw = np.linspace(*MIXED_RANGE, MIXED_N)
        plan = {"prompt_lengths": [clip(n) for n in raw]}
    elif name == "chat":
        msg = max(2, round(CHAT_MSG * scale))
        turns, total = [], 0
        for _ in range(CHAT_TURNS):  # each turn: the user message (+ last reply token), then a reply
            if total + msg + 1 + new_tokens > max_len:
                break
            turns.append(msg)
            total += msg + new_tokens
        if not turns:
            turns = [max(2, cap)]
        plan = {"prompt_lengths": [turns[0]], "turns": turns}
    else:
        raise ValueError(f"scenario={name!r}; expected one of {SCENARIOS}")
    plan.update(name=name, scale=scale, new_tokens=new_tokens)
    return plan


def final_lengths(plan: dict[str, Any]) -> list[int]:
    """Tokens each sequence holds in the cache at the end of the scenario."""
    n = plan["new_tokens"]
    if plan["name"] == "chat":
        return [sum(plan["turns"]) + len(plan["turns"]) * n - 1]
    return [p + n - 1 for p in plan["prompt_lengths"]]


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def stats_ms(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p90_ms": float("nan"), "n": 0}
    return {
        "mean_ms": float(a.mean()),
        "p50_ms": float(np.percentile(a, 50)),
        "p90_ms": float(np.percentile(a, 90)),
        "n": int(a.size),
    }


# ---------------------------------------------------------------------------- the timed loop
@torch.inference_mode()
def _turn(model, cache, seq_ids, prompts, starts, lengths, new_tokens, device, desc, compile_step=False):
    """Prefill `prompts` at `starts`, then greedily decode `new_tokens - 1` more tokens (each step
    one compiled graph if `compile_step`). -> (outputs [B][new_tokens], ttft seconds, per-step
    seconds). `lengths` is updated in place."""
    B = len(seq_ids)
    decode = decode_fn(cache, compile_step)
    sync(device)
    t0 = time.perf_counter()
    tokens, positions, step, last = cache.prefill(seq_ids, prompts, starts)
    logits = model(tokens, positions, step)  # [B', S', V]
    next_tok = logits.flatten(0, 1)[last].argmax(-1)  # [B]
    out = [[t] for t in next_tok.tolist()]  # host sync: the first token is out
    ttft = time.perf_counter() - t0
    for i, p in enumerate(prompts):
        lengths[i] += len(p)
    steps = []
    for _ in tqdm(range(new_tokens - 1), desc=desc, leave=False, disable=None):
        t = time.perf_counter()
        tokens, positions, step = cache.decode(seq_ids, next_tok, lengths, [True] * B)
        next_tok = decode(model, tokens, positions, step).argmax(-1)  # logits: [B, V]
        for o, tok in zip(out, next_tok.tolist()):  # host sync ends the step
            o.append(tok)
        steps.append(time.perf_counter() - t)
        for i in range(B):
            lengths[i] += 1
    return out, ttft, steps


def run_scenario(
    model,
    impl: str,
    plan: dict[str, Any],
    *,
    kernel: str = "auto",
    warmup: int = 2,
    bandwidth_gbs: float | None = None,
    seed: int = 0,
    warm: bool = False,
    num_pages: int | None = None,
    max_seq_len: int | None = None,
    compile_step: bool = False,
) -> dict[str, Any]:
    """Run one scenario on one backend; -> raw figures (JSON-ready) + "outputs" (token ids).

    The paged pool is sized to the workload (every sequence at its final length). `warm=True` first
    runs a short untimed copy with the same shapes (prompts, batch, pool), so one-time costs such as
    compiling the paged kernel stay out of TTFT."""
    device, n = model.device, plan["new_tokens"]
    vocab, P = model.config.src_vocab_size, model.config.page_size
    finals = final_lengths(plan)
    B = len(finals)
    if impl == "paged" and num_pages is None:
        num_pages = pool_pages(finals, P)
    if warm:
        short = dict(plan, new_tokens=min(n, warmup + 2))
        if plan["name"] == "chat":
            short["turns"] = plan["turns"][:2]
        run_scenario(
            model,
            impl,
            short,
            kernel=kernel,
            warmup=0,
            seed=seed,
            num_pages=num_pages,
            max_seq_len=max(finals) + 1,
            compile_step=compile_step,
        )
    cache = make_backend(model, impl, B, max_seq_len or max(finals) + 1, kernel=kernel, num_pages=num_pages)
    seq_ids, lengths = list(range(B)), [0] * B
    desc = f"{plan['name']}/{impl}"
    if plan["name"] == "chat":
        ttfts, steps, outs, ctx_at_turn, kv_turn = [], [], [[]], [], []
        msgs = random_prompts(plan["turns"], vocab, seed)
        for t, msg in enumerate(msgs):
            prompt = msg if t == 0 else [outs[0][-1]] + msg  # the last reply token enters the cache
            ctx_at_turn.append(lengths[0] + len(prompt))
            o, ttft, st = _turn(
                model, cache, [0], [prompt], [lengths[0]], lengths, n, device, f"{desc} turn {t}",
                compile_step,
            )
            outs[0] += o[0]
            kv_turn.append(kv_accounting(cache, lengths, model.config, model.dtype))
            ttfts.append(ttft)
            steps.append(st)
        steady = [s for st in steps for s in st[warmup:]]
        per_turn = [
            {
                "context": c,
                "ttft_ms": tt * 1e3,
                **stats_ms(st[warmup:]),
                "kv_bytes_held": kv["kv_bytes_held"],
                "kv_bytes_needed": kv["kv_bytes_needed"],
            }
            for c, tt, st, kv in zip(ctx_at_turn, ttfts, steps, kv_turn)
        ]
        ttft_total, decode_total = sum(ttfts), sum(sum(st) for st in steps)
        decode_steps = sum(len(st) for st in steps)
    else:
        prompts = random_prompts(plan["prompt_lengths"], vocab, seed)
        outs, ttft, st = _turn(model, cache, seq_ids, prompts, [0] * B, lengths, n, device, desc,
                               compile_step)
        ttfts, steady, per_turn = [ttft], st[warmup:], []
        ttft_total, decode_total, decode_steps = ttft, sum(st), len(st)
    kv = kv_accounting(cache, lengths, model.config, model.dtype)
    cache.release(seq_ids)
    generated = sum(len(o) for o in outs)
    lat = stats_ms(steady)
    mid_tokens = int(np.sum(finals)) - B * n // 2  # K/V read by a mid-run decode step (minimum)
    res: dict[str, Any] = {
        "scenario": plan["name"],
        "attn_impl": impl,
        "kernel": getattr(cache, "kernel", "sdpa"),
        "compile_step": compile_step,
        "batch": B,
        "prompt_lengths": plan["prompt_lengths"],
        "final_lengths": lengths,
        "new_tokens": n,
        "warmup_steps": warmup,
        "ttft_ms": float(np.mean(ttfts)) * 1e3,
        "ttft_ms_per_turn": [t * 1e3 for t in ttfts],
        "per_token": lat,
        "decode_steps": decode_steps,
        "tokens_generated": generated,
        "prefill_s": ttft_total,
        "decode_s": decode_total,
        "tokens_per_s": generated / (ttft_total + decode_total),
        "decode_tokens_per_s": B * lat["n"] / (lat["mean_ms"] * lat["n"] / 1e3) if lat["n"] else None,
        "kv": kv,
        "turns": per_turn,
        "outputs": outs,
    }
    if bandwidth_gbs:
        roof = decode_roofline_ms(model, mid_tokens, bandwidth_gbs)
        res["roofline_ms"] = roof
        res["decode_vs_roofline"] = lat["mean_ms"] / roof if lat["n"] else None
    return res


# ---------------------------------------------------------------------------- decode micro-benchmark
@torch.inference_mode()
def _prefill_chunked(model, cache, prompts, chunk: int) -> None:
    """Fill the cache without timing it, in chunks of `chunk` tokens: dense all rows at once
    (rows 0..B-1), paged one sequence at a time (few distinct compiled prefill shapes)."""
    if isinstance(cache, DenseBackend):
        for start in range(0, max(len(p) for p in prompts), chunk):
            # rows already complete rewrite their last token in place (same token, same K/V)
            starts = [min(start, len(p) - 1) for p in prompts]
            pieces = [p[s : start + chunk] for s, p in zip(starts, prompts)]
            tokens, positions, step, _ = cache.prefill(list(range(len(prompts))), pieces, starts)
            model(tokens, positions, step)
        return
    for s, p in enumerate(prompts):
        for start in range(0, len(p), chunk):
            tokens, positions, step, _ = cache.prefill([s], [p[start : start + chunk]], [start])
            model(tokens, positions, step)


def _time_mask_build(step) -> float | None:
    """Seconds to build this step's BlockMask alone (`FlexDecodeStep.prepare`, eager ops): a pure
    function of the step's metadata and the page table, so re-running it changes nothing."""
    if getattr(step, "decode_meta", None) is None:
        return None
    device = step.decode_meta.device
    sync(device)
    t0 = time.perf_counter()
    step.prepare()
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def time_decode(model, caches: dict[str, Any], prompts, steps: int, warmup: int, chunk: int = 512,
                compile: bool = False) -> dict[str, dict[str, Any]]:
    """Prefill every cache once, then time `steps` decode steps on each (after `warmup` each),
    interleaved step by step (ABBA order), so that the drift of a shared machine falls on every
    backend alike and step i of one cache can be paired with step i of another. -> per cache name:
    median ms of the whole step, of `cache.decode` alone (host step metadata: page reservation,
    slots) and of the BlockMask build alone, and every step's ms ("step_ms", for paired ratios).
    `compile`: each decode step one compiled graph (`compiled_decode`)."""
    device, B = model.device, len(prompts)
    seq_ids = list(range(B))
    state = {}
    for name, cache in caches.items():
        cache.reset()
        _prefill_chunked(model, cache, prompts, chunk)
        state[name] = {
            "decode": decode_fn(cache, compile),
            "lengths": [len(p) for p in prompts],
            "tok": torch.zeros(B, dtype=torch.long, device=device),
            "whole": [], "meta": [], "mask": [],
        }

    def run(name: str, n: int, record: bool, time_mask: bool = False) -> None:
        cache, st = caches[name], state[name]
        for _ in range(n):
            sync(device)
            t0 = time.perf_counter()
            tokens, positions, step = cache.decode(seq_ids, st["tok"], st["lengths"], [True] * B)
            sync(device)
            t1 = time.perf_counter()
            st["tok"] = st["decode"](model, tokens, positions, step).argmax(-1)
            sync(device)
            t2 = time.perf_counter()
            st["lengths"] = [n + 1 for n in st["lengths"]]
            m = _time_mask_build(step) if time_mask else None
            if m is not None:
                st["mask"].append(m)
            if record:
                st["whole"].append(t2 - t0)
                st["meta"].append(t1 - t0)

    names = list(caches)
    for name in names:
        run(name, warmup, record=False)
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            run(name, 1, record=True)
    med = lambda xs: float(np.median(xs)) * 1e3 if xs else None
    out = {}
    for name, cache in caches.items():
        st = state[name]
        # the BlockMask build alone (re-run after a step on its metadata), in steps of their own:
        # in the timed ones its extra eager ops would cool the caches before the next step
        run(name, MASK_TIMING_STEPS, record=False, time_mask=True)
        cache.release(seq_ids)
        step_ms, meta_ms, mask_ms = med(st["whole"]), med(st["meta"]), med(st["mask"])
        out[name] = {
            "ms_per_step": step_ms,
            "meta_ms": meta_ms,
            "meta_share": meta_ms / step_ms,
            "mask_ms": mask_ms,
            "mask_share": mask_ms / step_ms if mask_ms is not None else None,
            "steps": len(st["whole"]),
            "step_ms": [t * 1e3 for t in st["whole"]],
        }
    return out


def with_rope_len(model, max_len: int):
    """A shallow twin sharing every weight whose RoPE table reaches `max_len` positions (decode
    timing at contexts past the model's trained length: the cost does not depend on the values)."""
    if max_len <= model.config.max_expected_seq_len:
        return model
    twin = copy.copy(model)
    twin._modules = dict(model._modules)  # don't touch the original's submodules
    twin.config = dataclasses.replace(model.config, max_expected_seq_len=max_len)
    c = twin.config
    twin.rot_emb = RotaryEmbedding(c.head_dim, max_len, c.rope_theta, c.rope_scaling)
    twin.rot_emb.reset_buffers(model.device)
    return twin


def decode_benchmark(
    model,
    scale: float,
    *,
    kernel: str = "auto",
    steps: int = 20,
    warmup: int = 3,
    batch: int = DECODE_BATCH,
    seed: int = 0,
    modes: Sequence[str] = DECODE_MODES,
) -> list[dict[str, Any]]:
    """Dense vs paged decode ms/step at each context in DECODE_CONTEXTS x scale, for one sequence and
    for a mixed batch of `batch` sequences with lengths spread up to the context, in each mode:
    "eager" (the model op by op; the paged attention kernel compiled per layer) and "compiled"
    (the whole decode step one compiled graph, for both backends). Contexts past the model's
    maximum length run on a twin with a longer RoPE table (`with_rope_len`)."""
    bad = set(modes) - set(DECODE_MODES)
    if bad:
        raise ValueError(f"decode modes {sorted(bad)}; expected some of {DECODE_MODES}")
    contexts = sorted({max(16, round(c * scale)) for c in DECODE_CONTEXTS})
    span = max(contexts) + warmup + steps + MASK_TIMING_STEPS + 1
    model = with_rope_len(model, span)
    P, vocab = model.config.page_size, model.config.src_vocab_size
    # one paged backend per batch size for the whole benchmark (decode shapes depend only on the
    # pool and B), each with the rows and pool that `generate` would give it: B rows, B sequences
    pagers = {
        n: make_backend(model, "paged", n, span, kernel=kernel, num_pages=pool_pages([span] * n, P))
        for n in (1, batch)
    }
    rows = []
    cases = [(m, c, k) for m in modes for c in contexts for k in ("single", "mixed")]
    for mode, ctx, kind in tqdm(cases, desc="decode benchmark", disable=None):
        lengths = [ctx] if kind == "single" else np.linspace(ctx / batch, ctx, batch).round().astype(int)
        prompts = random_prompts([int(n) for n in lengths], vocab, seed)
        dense = make_backend(model, "sdpa", len(prompts), span)
        paged = pagers[len(prompts)]
        compiled = mode == "compiled"
        t = time_decode(model, {"dense": dense, "paged": paged}, prompts, steps, warmup,
                        compile=compiled)
        d, p = t["dense"], t["paged"]
        del dense
        rows.append(
            {
                "mode": mode,
                "context": ctx,
                "case": kind,
                "batch": len(prompts),
                "lengths": [int(n) for n in lengths],
                "dense_ms": d["ms_per_step"],
                "paged_ms": p["ms_per_step"],
                "ratio_paged_dense": p["ms_per_step"] / d["ms_per_step"],
                # paired: step i of paged over step i of dense (timed back to back); the spread
                # of these shows how much of a difference is the machine's noise
                "ratio_quartiles": [float(x) for x in np.percentile(
                    np.divide(p["step_ms"], d["step_ms"]), [25, 50, 75])],
                "paged_meta_ms": p["meta_ms"],
                "paged_meta_share": p["meta_share"],
                # eager rows: the build's share of the step; compiled rows: the build is fused into
                # the step's graph, so only its eager time (an upper bound) is kept
                "paged_mask_ms": p["mask_ms"],
                "paged_mask_share": None if compiled else p["mask_share"],
                "dense_meta_share": d["meta_share"],
                "kernel": paged.kernel,
                "page_size": P,
                "steps": p["steps"],
            }
        )
    return rows
