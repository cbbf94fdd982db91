"""Peers measured in the same run on the same weights: Hugging Face `LlamaForCausalLM.generate`
(dynamic and static cache), HF continuous batching `generate_batch` (when this transformers has it),
and PyTorch's experimental `_paged_attention` at the op level (when this torch has it).

A peer that cannot run here is recorded with its error string instead of stopping the benchmark.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fms_paged.bench.environment import sync


def hf_checkpoint_dir(model: torch.nn.Module, model_path: str | None, tmp: str) -> Path:
    """The HF-format directory holding `model`'s weights: its own checkpoint, or a saved copy."""
    if model_path is not None and (Path(model_path) / "config.json").is_file():
        return Path(model_path)
    from fms_paged.models.hf import save_hf_llama

    out = Path(tmp) / "hf_model"
    save_hf_llama(model, out)
    return out


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]


class _TokenClock:
    """A `generate` streamer that timestamps every put: the prompt first, then each new token."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def _hf_generate(hf, prompts, new_tokens: int, device, warmup: int = 2, **kw) -> dict[str, Any]:
    """Left-padded batch through `hf.generate` (greedy, exactly `new_tokens` tokens), timed per token
    by a streamer: TTFT = first token - call start; per-token = gaps between later tokens."""
    B, S = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's last prompt token is at S - 1
        ids[b, S - len(p) :] = torch.tensor(p)
        mask[b, S - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    common = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None, **kw)
    hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **common)  # warm-up
    clock = _TokenClock(device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock, **common)
    sync(device)
    total = time.perf_counter() - t0
    tok_times = clock.times[1:]  # times[0]: the prompt
    gaps = np.diff(tok_times)[warmup:] * 1e3
    gen = out[:, S:]
    return {
        "ttft_ms": (tok_times[0] - t0) * 1e3,
        "per_token_mean_ms": float(gaps.mean()) if gaps.size else None,
        "per_token_p50_ms": float(np.median(gaps)) if gaps.size else None,
        "total_s": total,
        "tokens_generated": int(gen.numel()),
        "tokens_per_s": gen.numel() / total,
        "outputs": gen.tolist(),
    }


@torch.no_grad()  # not inference_mode: HF's continuous batching writes its static tensors in place
def _hf_generate_batch(hf, prompts, new_tokens: int, device) -> dict[str, Any]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    sync(device)
    t0 = time.perf_counter()
    res = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    sync(device)
    total = time.perf_counter() - t0
    outs = [list(r.generated_tokens) for r in res.values()]
    n = sum(len(o) for o in outs)
    if n == 0:
        return {
            "error": "generate_batch returned no tokens (its requests failed; see the log above)",
            "total_s": total,
        }
    return {"total_s": total, "tokens_generated": n, "tokens_per_s": n / total}


@torch.inference_mode()
def torch_paged_attention_op(model, lengths, device, steps: int = 10, compile: bool = False) -> dict:
    """One decode attention call (one query per sequence) through
    `torch.nn.attention.experimental._paged_attention.PagedAttention`: ms per call, next to padded
    dense SDPA on the same K/V."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return {"status": "unavailable"}
    c = model.config
    H, Hkv, D, P = c.nheads, c.kvheads, c.head_dim, c.page_size
    B, L = len(lengths), max(lengths)
    n_pages = sum(-(-n // P) for n in lengths)
    pa = PagedAttention(n_pages, P, B, device=str(device))
    k_cache = torch.zeros(1, Hkv, n_pages * P, D, device=device, dtype=model.dtype)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device, model.dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(device, model.dtype)
    for b, n in enumerate(lengths):
        pa.reserve(torch.tensor(b), torch.tensor(n))
        pa.assign(
            torch.tensor([b]),
            torch.arange(n)[None],
            k[b : b + 1, :, :n],
            v[b : b + 1, :, :n],
            k_cache,
            v_cache,
        )
    kv_len = torch.tensor(lengths, device=device)
    logical = create_block_mask(
        lambda b, h, q, kv: kv < kv_len[b], B, None, 1, L, device=str(device), BLOCK_SIZE=(128, P)
    )
    mask = pa.convert_logical_block_mask(logical, kv_len=kv_len)
    q = torch.randn(B, H, 1, D, generator=g).to(device, model.dtype)
    fn = torch.compile(flex_attention, fullgraph=True) if compile else flex_attention
    dense_mask = (torch.arange(L, device=device)[None] < kv_len[:, None])[:, None, None, :]

    def med(call):
        call()
        ts = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            call()
            sync(device)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    paged_ms = med(lambda: fn(q, k_cache, v_cache, block_mask=mask, enable_gqa=True))
    dense_ms = med(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_mask, enable_gqa=True
        )
    )
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, enable_gqa=True)
    got = fn(q, k_cache, v_cache, block_mask=mask, enable_gqa=True)
    return {
        "status": "ok",
        "compiled": compile,
        "lengths": list(lengths),
        "paged_ms_per_call": paged_ms,
        "dense_sdpa_ms_per_call": dense_ms,
        "max_abs_diff_vs_sdpa": float((got - ref).abs().max()),
    }


def run_peers(
    model,
    model_path: str | None,
    prompts_by_scenario: dict[str, list[list[int]]],
    new_tokens: int,
    compile: bool = False,
) -> dict[str, Any]:
    """All peers on each scenario's prompts; -> {peer: {scenario: figures | {"error": ...}}}."""
    device = model.device
    out: dict[str, Any] = {"hf_dynamic": {}, "hf_static": {}, "hf_generate_batch": {}}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            from transformers import LlamaForCausalLM

            path = hf_checkpoint_dir(model, model_path, tmp)
            hf = LlamaForCausalLM.from_pretrained(path, dtype=model.dtype).to(device).eval()
        except Exception as e:
            return {"error": _err(e)}
        for name, prompts in prompts_by_scenario.items():
            for key, kw in (("hf_dynamic", {}), ("hf_static", {"cache_implementation": "static"})):
                try:
                    out[key][name] = _hf_generate(hf, prompts, new_tokens, device, **kw)
                except Exception as e:
                    out[key][name] = {"error": _err(e)}
            if not hasattr(hf, "generate_batch"):
                out["hf_generate_batch"][name] = {"status": "unavailable in this transformers"}
                continue
            try:
                out["hf_generate_batch"][name] = _hf_generate_batch(hf, prompts, new_tokens, device)
            except Exception as e:
                out["hf_generate_batch"][name] = {"error": _err(e)}
        del hf
    lengths = [len(p) for p in prompts_by_scenario.get("mixed", next(iter(prompts_by_scenario.values())))]
    try:
        out["torch_paged_attention"] = torch_paged_attention_op(model, lengths, device, compile=compile)
    except Exception as e:
        out["torch_paged_attention"] = {"status": "error", "error": _err(e)}
    return out


def _run_peers_child(path: str, device: str, dtype: str, prompts_by_scenario, new_tokens: int,
                     compile: bool) -> dict[str, Any]:
    from fms_paged.models import get_model

    model = get_model(model_path=path, device=device, dtype=dtype)
    return run_peers(model, path, prompts_by_scenario, new_tokens, compile=compile)


def run_peers_isolated(model, model_path: str | None, prompts_by_scenario: dict[str, list[list[int]]],
                       new_tokens: int, compile: bool = False) -> dict[str, Any]:
    """`run_peers` in a process of its own (spawned), on the same weights: a peer's threads and
    allocations in our process once slowed our decode tenfold after it ran."""
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        path = str(hf_checkpoint_dir(model, model_path, tmp))
        dtype = str(model.dtype).removeprefix("torch.")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_run_peers_child, (path, str(model.device), dtype, prompts_by_scenario,
                                                 new_tokens, compile))
