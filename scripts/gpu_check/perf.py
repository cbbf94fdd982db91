"""`make gpu-check`, stage 4: benchmarks on one model, Llama-3-8B's shape with random bf16 weights
made on the device (`tiny`: `micro` in fp32 on the CPU, small numbers, the same code path).

1. `engine_decode`: batch-1 decode through the `Engine` (CUDA graphs on and off) at a few contexts,
   against the roofline: the read bandwidth measured here over the bytes a step reads.
2. `mixed_batch`: the paper's 16 prompts of linspace(500, 8000) tokens, paged against dense.
3. `decode_vs_dense`: paged against dense ms/token at equal context (`latency.run_plan`), one
   sequence whose turns bring it to each context in turn (`ladder_plan`).
4. `chat`: equal turns up to the longest context, paged against dense, per turn.
5. `serving`: the engine on the serving mix against HF's `generate_batch` in a process of its own
   (random weights of the same shape made on the device: a step's time does not depend on them);
   every request makes `serve_new` tokens, as `generate_batch` takes one max_new_tokens.

A paged step compiles per pool: the ladder and the chat end holding the same tokens (one pool),
and every engine has the same rows and pool. Each path runs untimed (its compiles), then timed
with the same shapes. A measurement that raises is recorded with its error and the stage goes on;
a section that would start past `budget_s` is skipped (the sections run in the order above: those
with targets first).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from benchmarks import peers, vs_vllm
from fms_paged.bench import environment as bench_env
from fms_paged.bench import serve
from fms_paged.bench.latency import final_lengths, random_prompts, run_plan
from fms_paged.bench.report import fmt, table
from fms_paged.device import default_page_size
from fms_paged.engine import Engine, SamplingParams
from fms_paged.flex.masks import decode_block_mask, decode_meta, paged_mask_mod
from fms_paged.kv import PageManager
from fms_paged.kv.geometry import page_slots
from fms_paged.kv.kernels import compiled_flex, flex_kernel_options
from fms_paged.models import get_model
from fms_paged.models.hf import config_to_hf

# tiny: eager steps (a cold compile of the CPU's graphs takes over a minute on 2 cores) and small
# static buffers for HF (`hf_cb`; by default HF sizes them by the free memory: 15 s to zero on a CPU)
SIZES: dict[bool, dict[str, Any]] = {  # full (an H100), tiny (the CPU dry run)
    False: dict(variant="3-8b", dtype=torch.bfloat16, compile=True, contexts=(128, 2048, 8000),
                new_tokens=32, mixed=(500, 8000, 16), chat_turns=8, serve_scale=0.25, serve_requests=32,
                serve_new=32, max_num_seqs=8, max_num_batched_tokens=2048, bandwidth_bytes=2**30,
                budget_s=240, hf_cb=None, decode_calls=(20, 5)),
    True: dict(variant="micro", dtype=torch.float32, compile=False, contexts=(32, 256, 1000),
               new_tokens=8, mixed=(31, 500, 16), chat_turns=4, serve_scale=0.03, serve_requests=4,
               serve_new=4, max_num_seqs=4, max_num_batched_tokens=256, bandwidth_bytes=2**28,
               budget_s=240, hf_cb=dict(num_blocks=64, max_batch_tokens=256), decode_calls=(2, 1)),
}
IMPLS = ("paged", "sdpa")
BUILT = "by get_model: cast on the meta device, then materialized and initialized on the device"
Result = dict[str, Any]


# ---------------------------------------------------------------------------- model, roofline
def build_model(device: torch.device, variant: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A paged `variant` with random weights made in `dtype` on `device` (`get_model` casts on the
    meta device first: the bf16 8B model never exists in fp32)."""
    return get_model(variant=variant, attn_impl="paged", device=device, dtype=dtype, seed=seed,
                     page_size=default_page_size(device))


def weights_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every distinct parameter once, less the embedding
    table (a step reads one row of it per sequence) unless the LM head shares it."""
    return bench_env.weight_bytes(model) - (0 if model.config.tie_heads else model.embedding.weight.nbytes)


def step_bytes(weights: int, kv_per_token: int, context: float) -> float:
    """Bytes one batch-1 decode step reads: the weights, and K and V of `context` tokens."""
    return weights + kv_per_token * context


def roofline_tok_s(bandwidth_gbs: float, nbytes: float) -> float:
    """Tokens/s of a batch-1 decode reading `nbytes` per step at `bandwidth_gbs` GB/s."""
    return bandwidth_gbs * 1e9 / nbytes


# ---------------------------------------------------------------------------- helpers
def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _attempt(fn: Callable[[], Result], device: torch.device) -> Result:
    """fn() or {"error": why}; what the exception held goes back (an OOM must not starve the rest)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error is the measurement's result
        err = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
    _release(device)  # after the except clause, which holds the failed frames and their tensors
    return err


def _pool_pages(model, size: Result, specs) -> int:
    """The stage's pool: every serving request at once, or one sequence of the model's length."""
    c, new = model.config, size["serve_new"]
    return max(bench_env.min_pages([len(s.prompt) + new for s in specs], c.page_size),
               bench_env.min_pages([c.max_expected_seq_len], c.page_size)) + 1


def _engine(model, size: Result, specs, cuda_graphs: bool | str = "auto") -> Engine:
    """The stage's one engine shape (rows, token budget, `_pool_pages`): every engine reuses the
    same compiled graphs. One token a step (decode_steps=1): the stage times a decode step (on the
    CPU the default lookahead would put several tokens in one)."""
    pages = _pool_pages(model, size, specs)
    return Engine(model, max_num_seqs=size["max_num_seqs"], num_pages=pages, compile=size["compile"],
                  max_num_batched_tokens=size["max_num_batched_tokens"], enable_prefix_caching=False,
                  cuda_graphs=cuda_graphs, decode_steps=1)


def _one_request(eng: Engine, prompt: list[int], new: int) -> tuple[float, list[float]]:
    """`prompt` alone through `eng` -> (TTFT s, seconds of each step after the first token). A
    step ends on the host's read of its tokens, so it includes the device's time."""
    eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    t0, ttft, steps = time.perf_counter(), None, []
    while eng.has_unfinished():
        t = time.perf_counter()
        outs = eng.step()
        if ttft is not None:
            steps.append(time.perf_counter() - t)
        elif any(o.new_token_ids for o in outs):
            ttft = time.perf_counter() - t0
    return ttft, steps


def _timed_plan(model, impl: str, plan: Result, size: Result, meter: bool = False) -> Result:
    """`run_plan`, once untimed (same shapes: its compiles) and once timed -> its figures, with the
    timed run's peak memory when `meter` (`peak_meter`: CUDA's allocator, a CPU's resident set);
    or {"error": why}."""
    def go() -> Result:
        run_plan(model, impl, plan, compile=size["compile"], warmup=0)
        pm = bench_env.peak_meter(model.device) if meter else None
        start = pm[0]() if pm else None
        r = run_plan(model, impl, plan, compile=size["compile"], warmup=2)
        out = {"kernel": r["kernel"], "ttft_ms": r["ttft_ms"], "ms_per_token_p50": r["per_token"]["p50_ms"],
               "tokens_per_s": r["tokens_per_s"], "kv_bytes_held": r["kv"]["kv_bytes_held"],
               "kv_bytes_needed": r["kv"]["kv_bytes_needed"], "turns": r["turns"]}
        return dict(out, peak_bytes=pm[1](), run_peak_bytes=pm[1]() - start) if pm else out

    return _attempt(go, model.device)


def sdpa_backends(model) -> dict[str, str]:
    """The SDPA kernel the dense cache's attention gets here, as `DenseStep.attend` calls it (GQA;
    a mask only where rows differ in length or a chunk starts past 0)."""
    c, kw, out = model.config, {"device": model.device, "dtype": model.dtype}, {}
    cases = {"decode, 1 row": (1, 1, 256, False, False), "decode, 4 rows (masked)": (4, 1, 256, True, False),
             "prefill from 0 (causal)": (2, 256, 256, False, True)}
    for name, (B, S, L, masked, causal) in cases.items():
        q = torch.zeros(B, c.nheads, S, c.head_dim, **kw)
        k = torch.zeros(B, c.kvheads, L, c.head_dim, **kw)
        mask = torch.ones(B, 1, S, L, dtype=torch.bool, device=model.device) if masked else None
        choice = torch._fused_sdp_choice(q, k, k, attn_mask=mask, is_causal=causal,
                                         enable_gqa=c.kvheads != c.nheads)
        out[name] = torch.nn.attention.SDPBackend(choice).name
    return out


# ---------------------------------------------------------------------------- sections
GRAPHS = {True: "on", False: "off"}  # `cuda_graphs=` as the engine tables show it


def _engine_rows(model, size: Result, specs, cuda_graphs, prompts, bw: float, log) -> Result:
    """Batch-1 decode through one engine at each context of `prompts` -> {"rows": a row per context}."""
    c, new, rows = model.config, size["new_tokens"], []
    weights, per_token = weights_read(model), bench_env.kv_bytes_per_token(c, model.dtype)
    eng = _engine(model, size, specs, cuda_graphs)
    graphs = GRAPHS[eng.runner.cuda_graphs]
    for p in prompts:  # untimed: the decode graph, the prefill chunks, the CUDA graph
        _one_request(eng, p, 3)
    for p in prompts:
        ctx = len(p)
        ttft, steps = _one_request(eng, p, new)
        sec = statistics.median(steps[1:])
        nbytes = step_bytes(weights, per_token, ctx + new / 2)  # the mean context of its steps
        roof = roofline_tok_s(bw, nbytes)
        rows.append({"cuda_graphs": graphs, "context": ctx, "ms_per_token": 1e3 * sec, "ttft_ms": 1e3 * ttft,
                     "tokens_per_s": 1 / sec, "step_bytes": nbytes, "roofline_tok_s": roof,
                     "roofline_share": 1 / sec / roof})
        log(f"[perf] engine batch-1 decode, context {ctx}, cuda_graphs={graphs}: {1e3 * sec:.2f} ms/token, "
            f"{1 / sec:.1f} tok/s, {100 / sec / roof:.0f}% of the roofline")
    return {"rows": rows}


def engine_decode(model, size: Result, specs, bw: float, log) -> Result:
    """`_engine_rows` with CUDA graphs on at every context, then (CUDA) off at the shortest, where
    a step's launch overhead weighs most, so the pair says whether graphs pay; each recorded even
    if the other fails."""
    prompts = random_prompts(size["contexts"], model.config.src_vocab_size, seed=1)
    rows = []
    for cg in (True, False) if model.device.type == "cuda" else (False,):
        some = prompts if cg or model.device.type != "cuda" else prompts[:1]
        got = _attempt(lambda cg=cg, some=some: _engine_rows(model, size, specs, cg, some, bw, log),
                       model.device)
        rows += got.get("rows") or [{"cuda_graphs": GRAPHS[cg], **got}]
        _release(model.device)
    return {"weights_read_bytes": weights_read(model), "rows": rows,
            "kv_bytes_per_token": bench_env.kv_bytes_per_token(model.config, model.dtype)}


def decode_blocks(model, size: Result, specs, bw: float, log) -> Result:
    """One layer's flex decode attention alone (the model's heads, one sequence at each context,
    over a pool of the engine's pages), its BlockMask in both forms of `decode_block_mask`: the
    seen pages as full blocks (the kernel's today) or all partial -> each form's time a call, its
    share of the bandwidth for the K and V it reads, and its error against SDPA over the gathered
    pages (fp32). Compiled on CUDA; eager in the dry run."""
    c, dev = model.config, model.device
    P, G, N = c.page_size, c.nheads // c.kvheads, _pool_pages(model, size, specs)
    pm = PageManager(N, P, max_seqs=1, device=dev, max_seq_len=max(size["contexts"]) + 1)
    g = torch.Generator(device=dev).manual_seed(0)
    kp, vp = (torch.randn(1, c.kvheads, N * P, c.head_dim, generator=g, device=dev, dtype=model.dtype)
              for _ in range(2))
    q = torch.randn(1, c.kvheads, G, c.head_dim, generator=g, device=dev, dtype=model.dtype)
    attn = compiled_flex(dynamic=False) if size["compile"] else flex_attention
    opts, rows = flex_kernel_options(dev, P), []
    for ctx in size["contexts"]:
        if pm.live_seqs:
            pm.erase([0])
        pm.reserve([0], [ctx])
        meta = decode_meta([0], [ctx - 1], pm.slots([0], [ctx - 1]).tolist(), P).to(dev)
        mm = paged_mask_mod(pm.page_table, pm.phys_to_logical, meta[0][:, None].int(),
                            meta[1][:, None].int(), P, gqa_packed=True)
        seen = torch.from_numpy(page_slots(np.asarray(pm.pages_of(0)), P).reshape(-1)[:ctx]).to(dev)
        ref = F.scaled_dot_product_attention(q.float(), kp[:, :, seen].float(), vp[:, :, seen].float())
        kv_bytes = 2 * ctx * c.kvheads * c.head_dim * kp.element_size()
        row = {"context": ctx, "pool_pages": N}
        for form, full in (("full", True), ("partial", False)):
            bm = decode_block_mask(pm.page_table, meta, N, P, mm, G, full_blocks=full)
            call = lambda bm=bm: attn(q, kp, vp, block_mask=bm, kernel_options=opts)  # noqa: E731
            out = call()
            sec = bench_env.time_calls(call, dev, *size["decode_calls"])
            row.update({f"{form}_us": 1e6 * sec, f"{form}_bandwidth_share": kv_bytes / sec / 1e9 / bw,
                        f"{form}_error": (out.float() - ref).abs().max().item()})
        rows.append(row)
        log(f"[perf] flex decode, context {ctx}: full blocks {row['full_us']:.1f} us, all partial "
            f"{row['partial_us']:.1f} us (errors vs SDPA {row['full_error']:.1e}, "
            f"{row['partial_error']:.1e})")
    return {"rows": rows}


def _per_turn(model, plan: Result, size: Result, log, what: str) -> Result:
    """`plan` (with turns) through both backends -> a row per turn: its context, TTFT, ms/token."""
    runs = {impl: _timed_plan(model, impl, plan, size) for impl in IMPLS}
    turns = {impl: r.pop("turns", None) or [] for impl, r in runs.items()}
    rows = []
    for n, t in enumerate(turns["paged"] or turns["sdpa"]):
        got = {impl: turns[impl][n] if turns[impl] else {} for impl in IMPLS}
        row = {"turn": n + 1, "context": t["context"], **{f"{i}_ms": got[i].get("p50_ms") for i in IMPLS},
               **{f"{i}_ttft_ms": got[i].get("ttft_ms") for i in IMPLS}}
        ratio = row["paged_ms"] / row["sdpa_ms"] if got["sdpa"] and got["paged"] else None
        rows.append(dict(row, paged_over_dense=ratio))
        log(f"[perf] {what} at context {t['context']}: paged {fmt(row['paged_ms'])} ms/token, dense "
            f"{fmt(row['sdpa_ms'])}, paged/dense {fmt(ratio, '.3f')}")
    for impl in (i for i in IMPLS if "error" in runs[i]):
        log(f"[perf] {what}, {impl}: {runs[impl]['error']}")
    return {"rows": rows, **runs}


def ladder_plan(contexts: list[int], new: int) -> Result:
    """One conversation whose turn k decodes from `contexts[k]` tokens on (its message, after the
    last reply token fed back, tops the cache up to it): decode at every context from one run, in
    one pool (one compiled graph per backend, not one per context)."""
    msgs, held = [], 0
    for ctx in contexts:
        msgs.append(ctx - held - (1 if held else 0))
        held = ctx + new - 1
    if min(msgs) < 1:
        raise ValueError(f"contexts {contexts} must grow by more than new_tokens={new} each")
    plan = {"name": "ladder", "prompt_lengths": msgs[:1], "turns": msgs, "new_tokens": new}
    return dict(plan, length=final_lengths(plan)[0])


def decode_vs_dense(model, size: Result, log) -> Result:
    res = _per_turn(model, ladder_plan(list(size["contexts"]), size["new_tokens"]), size, log, "decode")
    return dict(res, dense_sdpa_backend=_attempt(lambda: sdpa_backends(model), model.device))


def mixed_batch(model, size: Result, log) -> Result:
    lo, hi, n = size["mixed"]
    plan = {"name": "mixed", "length": hi, "prompt_lengths": [round(x) for x in np.linspace(lo, hi, n)],
            "new_tokens": size["new_tokens"]}
    by = {impl: _timed_plan(model, impl, plan, size, meter=True) for impl in IMPLS}
    for impl, r in by.items():
        if "error" not in r:
            r["kv_held_over_needed"] = r["kv_bytes_held"] / r["kv_bytes_needed"]
        log(f"[perf] mixed batch, {impl}: " + (r.get("error") or (
            f"TTFT {r['ttft_ms']:.0f} ms, {r['ms_per_token_p50']:.2f} ms/token, {r['tokens_per_s']:.0f} "
            f"tok/s, KV held/needed {r['kv_held_over_needed']:.3f}")))
    tok_s = [by[impl].get("tokens_per_s") for impl in IMPLS]
    return {"prompt_lengths": plan["prompt_lengths"], "rows": [{"backend": i, **r} for i, r in by.items()],
            "paged_over_dense_tok_s": tok_s[0] / tok_s[1] if None not in tok_s else None}


def chat_plan(context: int, turns: int, new: int) -> Result:
    """`turns` equal messages, `new` tokens each, that end holding what one prompt of `context`
    tokens and `new` new tokens holds when `turns` divides context + new (the same pool)."""
    msg = (context + new) // turns - new
    plan = {"name": "chat", "prompt_lengths": [msg], "turns": [msg] * turns, "new_tokens": new}
    return dict(plan, length=final_lengths(plan)[0])


def chat(model, size: Result, log) -> Result:
    plan = chat_plan(max(size["contexts"]), size["chat_turns"], size["new_tokens"])
    return dict(_per_turn(model, plan, size, log, "chat"), message=plan["turns"][0])


def serving(model, size: Result, specs, log) -> Result:
    new, prompts = size["serve_new"], [s.prompt for s in specs]

    def ours() -> Result:
        eng = _engine(model, size, specs)
        vs_vllm.offline_runs(eng, prompts, new, 1)  # untimed: the buckets this traffic meets compile
        r = vs_vllm.offline_runs(eng, prompts, new, 1)[0]
        return {k: r[k] for k in ("duration_s", "output_tok_s", "decode_steps_s")}

    engine = {"system": "engine", **_attempt(ours, model.device)}
    _release(model.device)  # the peer's process needs the memory
    hf = {"system": "HF generate_batch", **_attempt(lambda: hf_peer_run(model, prompts, new, size["hf_cb"]),
                                                    model.device)}
    for r in (engine, hf):
        log(f"[perf] serving mix, {r['system']}: " + (
            r["error"].strip().splitlines()[-1][:200] if "error" in r else f"{r['output_tok_s']:.1f} tok/s"))
    if "output_tok_s" in engine and "output_tok_s" in hf:
        engine["over_hf"] = engine["output_tok_s"] / hf["output_tok_s"]
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "rows": [engine, hf]}


# ---------------------------------------------------------------------------- the HF peer
def hf_peer_run(model, prompts: list[list[int]], new: int, cb: Result | None = None) -> Result:
    """`generate_batch` on `prompts` in a fresh process (`peers`' HF peer, with random weights of
    `model`'s shape made on its device) -> its figures. `cb`: a `ContinuousBatchingConfig`'s sizes,
    or None for HF's own (by the device's free memory)."""
    job = {"config": config_to_hf(model.config, model.dtype), "device": str(model.device), "cb": cb,
           "dtype": str(model.dtype).removeprefix("torch."),
           "requests": [{"prompt": p, "max_new_tokens": new} for p in prompts]}
    with tempfile.TemporaryDirectory() as tmp:
        r = peers.run_peer(peers.peer_command("hf"), job, Path(tmp), tmp, "hf")
    r.pop("tokens", None)
    return r


# ---------------------------------------------------------------------------- the stage
def targets(res: Result) -> list[Result]:
    """Each target with its value (None where a measurement it needs did not run) and whether met."""
    dec = res.get("engine_decode", {}).get("rows", [])
    shares = [r.get("roofline_share") for r in dec if r["cuda_graphs"] == dec[0]["cuda_graphs"]]  # default
    ratios = [r["paged_over_dense"] for r in res.get("decode_vs_dense", {}).get("rows", [])]
    mixed = res.get("mixed_batch", {})
    paged = next((r for r in mixed.get("rows", []) if r["backend"] == "paged"), {})
    worst = lambda xs, pick: pick(xs) if xs and None not in xs else None  # noqa: E731
    vals = [("batch-1 decode / roofline (worst context, the default graphs)", worst(shares, min), ">=", 0.7),
            ("paged / dense decode ms per token (highest context)", worst(ratios, max), "<=", 1.1),
            ("mixed batch, paged / dense tokens/s", mixed.get("paged_over_dense_tok_s"), ">=", 1.5),
            ("mixed batch, paged KV held / needed", paged.get("kv_held_over_needed"), "<=", 1.05)]
    return [{"name": name, "value": v, "target": f"{op} {t}",
             "met": v is not None and (v >= t if op == ">=" else v <= t)} for name, v, op, t in vals]


def errors(res: Any, where: str = "") -> list[str]:
    """'where: error' for every measurement in `res` that raised."""
    if isinstance(res, list):
        return [e for i, v in enumerate(res) for e in errors(v, f"{where}[{i}]")]
    if not isinstance(res, dict):
        return []
    own = [f"{where or 'stage'}: {res['error']}"] if "error" in res else []
    return own + [e for k, v in res.items() for e in errors(v, f"{where}/{k}" if where else k)]


def _setup(device: torch.device, size: Result, box: list) -> Result:
    t0 = time.perf_counter()
    box.append(model := build_model(device, size["variant"], size["dtype"]))
    c = model.config
    return {"variant": size["variant"], "dtype": str(model.dtype).removeprefix("torch."), "built": BUILT,
            "layers": c.nlayers, "heads": c.nheads, "kv_heads": c.kvheads, "head_dim": c.head_dim,
            "page_size": c.page_size, "weight_bytes": bench_env.weight_bytes(model),
            "build_s": time.perf_counter() - t0,
            "read_bandwidth_gbs": bench_env.measure_read_bandwidth(device, size["bandwidth_bytes"])}


def run(device: torch.device, tiny: bool, log: Callable[[str], None] = print, *,
        deadline_s: float | None = None) -> Result:
    """The stage -> its JSON-able result: "passed" (tiny: ran end to end; else every target met),
    "targets", each section's figures, "errors", wall times. No section starts past `deadline_s`
    (seconds from now; default: the size's `budget_s`)."""
    t0, size, box = time.perf_counter(), dict(SIZES[tiny]), []
    if deadline_s is not None:
        size["budget_s"] = deadline_s
    res: Result = {"stage": "benchmarks", "tiny": tiny, "environment": bench_env.environment_info(device),
                   "sizes": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in size.items()},
                   "section_s": {}, "model": _attempt(lambda: _setup(device, size, box), device)}
    if box:
        model, m = box[0], res["model"]
        log(f"[perf] {m['variant']} {m['dtype']} built in {m['build_s']:.1f} s; "
            f"read bandwidth {m['read_bandwidth_gbs']:.1f} GB/s")
        specs = serve.workload("mix", size["serve_scale"], model.config.src_vocab_size, 0,
                               size["serve_requests"])
        bw = m["read_bandwidth_gbs"]
        sections = {"engine_decode": lambda: engine_decode(model, size, specs, bw, log),
                    "decode_blocks": lambda: decode_blocks(model, size, specs, bw, log),
                    "mixed_batch": lambda: mixed_batch(model, size, log),
                    "decode_vs_dense": lambda: decode_vs_dense(model, size, log),
                    "chat": lambda: chat(model, size, log),
                    "serving": lambda: serving(model, size, specs, log)}
        for name, fn in sections.items():
            if time.perf_counter() - t0 > size["budget_s"]:
                res[name] = {"error": f"skipped: the stage's {size['budget_s']} s were spent"}
                continue
            t = time.perf_counter()
            try:
                res[name] = _attempt(fn, device)
            except KeyboardInterrupt:  # the driver's budget ran out: report the sections done
                res[name] = {"error": "interrupted: the stage's budget ran out"}
                break
            finally:
                res["section_s"][name] = time.perf_counter() - t
    res["targets"], res["errors"] = targets(res), errors(res)
    res["passed"] = not res["errors"] if tiny else all(t["met"] for t in res["targets"])
    res["wall_s"] = time.perf_counter() - t0
    log(f"[perf] {'passed' if res['passed'] else 'FAILED'} in {res['wall_s']:.0f} s")
    return res


# ---------------------------------------------------------------------------- the report
TURN_COLS = [("turn", "turn", "d"), ("context", "context", "d"), ("dense TTFT ms", "sdpa_ttft_ms", ".1f"),
             ("paged TTFT ms", "paged_ttft_ms", ".1f"), ("dense ms/token p50", "sdpa_ms", ".2f"),
             ("paged ms/token p50", "paged_ms", ".2f"), ("paged / dense", "paged_over_dense", ".3f")]
SECTIONS = {  # section -> (title, formatted with the sizes; its table's (header, key, format) columns)
    "engine_decode": ("Batch-1 decode through the engine (compile={compile}), {new_tokens} new tokens", [
        ("cuda_graphs", "cuda_graphs", ""), ("context", "context", "d"),
        ("ms/token p50", "ms_per_token", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
        ("MiB read per step", "step_bytes", "MiB.0f"), ("roofline tok/s", "roofline_tok_s", ".1f"),
        ("of roofline", "roofline_share", ".0%"), ("TTFT ms", "ttft_ms", ".1f")]),
    "decode_blocks": ("Flex decode attention alone, one layer, one sequence: the BlockMask's seen pages "
                      "as full blocks or all partial", [
        ("context", "context", "d"), ("pool pages", "pool_pages", "d"), ("full blocks us", "full_us", ".1f"),
        ("of bandwidth", "full_bandwidth_share", ".0%"), ("error", "full_error", ".1e"),
        ("all partial us", "partial_us", ".1f"), ("of bandwidth", "partial_bandwidth_share", ".0%"),
        ("error", "partial_error", ".1e")]),
    "mixed_batch": ("Mixed batch: prompts of linspace{mixed} tokens (first, last, count), {new_tokens} new", [
        ("backend", "backend", ""), ("TTFT ms", "ttft_ms", ".1f"),
        ("ms/token p50", "ms_per_token_p50", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
        ("peak MiB", "peak_bytes", "MiB.0f"), ("run peak MiB", "run_peak_bytes", "MiB.0f"),
        ("KV held MiB", "kv_bytes_held", "MiB.1f"), ("KV needed MiB", "kv_bytes_needed", "MiB.1f"),
        ("held / needed", "kv_held_over_needed", ".3f")]),
    "decode_vs_dense": ("Paged vs dense decode (compile={compile}): one sequence, its context brought to "
                        "each of {contexts} in turn, {new_tokens} new tokens each time", TURN_COLS),
    "chat": ("Growing chat: {chat_turns} equal turns up to the longest context, {new_tokens} new each",
             TURN_COLS),
    "serving": ("Serving mix at scale {serve_scale}: {serve_requests} requests of {serve_new} new tokens", [
        ("system", "system", ""), ("output tok/s", "output_tok_s", ".1f"), ("engine / HF", "over_hf", ".2f"),
        ("s", "duration_s", ".2f"), ("load + warm-up s", "setup_s", ".1f")]),
}
TARGET_COLS = [("target", "name", ""), ("value", "value", ".3f"), ("wanted", "target", ""),
               ("met", "met", "")]


def markdown(res: Result) -> str:
    """The stage's report: the machine, the targets, a table per section, then what failed."""
    env, m = res["environment"], res["model"]
    cuda = f", CUDA {env['cuda']}" if env.get("cuda") else ""
    lines = [f"## Benchmarks{' (tiny dry run)' if res['tiny'] else ''}: {env['device_name']}, "
             f"torch {env['torch']}{cuda}: {'passed' if res['passed'] else 'FAILED'}", ""]
    if "error" not in m:
        lines += [f"`{m['variant']}` shape: {m['layers']} layers, {m['heads']}/{m['kv_heads']} heads of "
                  f"{m['head_dim']}, {m['dtype']}, random weights made {m['built']}; pages of "
                  f"{m['page_size']}; read bandwidth {m['read_bandwidth_gbs']:.1f} GB/s. Targets "
                  f"({'reported, not enforced: tiny' if res['tiny'] else 'enforced'}):", "",
                  table(res["targets"], TARGET_COLS), ""]
    for name, (title, cols) in SECTIONS.items():
        rows = res.get(name, {}).get("rows", [])
        lines += [f"### {title.format(**res['sizes'])}", "", table(rows, cols), ""]
    backends = res.get("decode_vs_dense", {}).get("dense_sdpa_backend")
    walls = ", ".join(f"{k} {v:.1f}" for k, v in res["section_s"].items())
    lines += [f"- the dense cache's SDPA kernel here: {backends}", *(f"- error: {e}" for e in res["errors"])]
    return "\n".join([*lines, f"- wall time (s): {walls}; stage {res['wall_s']:.1f}"]) + "\n"
