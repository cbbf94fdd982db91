"""Timed generation through each KV backend on one model's weights, in one process (the forward is
driven by the `step` a backend builds): the dense cache (`sdpa`), the paged cache (`paged`) and no
cache (`no-cache`: every step runs each sequence's whole history again, the paper's reference).
Scenarios, each a sweep over the sequence length (`SWEEP` of the full length, times `scale`):
- `single`: one sequence of each length;
- `mixed`: 16 sequences spread from 1/16 of the length to the length (where a dense cache pads);
- `chat`: one conversation of 8 turns, each turn's message appended to the cached history.
Timing: warm-up first, `sync` before every clock read, medians and percentiles over the steady
state (decode steps after `warmup`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fms_paged.bench.environment import kv_accounting, min_pages, sync
from fms_paged.engine.model_step import decode_fn
from fms_paged.kv.cache import DenseBackend, PagedCache
from fms_paged.kv.paged import attention_specs, model_groups
from fms_paged.models.registry import get_model
from fms_paged.modules import RotaryEmbedding

SCENARIOS = ("single", "mixed", "chat")
IMPLS = ("no-cache", "sdpa", "paged")
SINGLE_LEN = 8000  # the longest prompt at scale 1.0
SWEEP = (0.125, 0.25, 0.5, 1.0)  # the lengths of a sweep, as fractions of the longest
MIXED_N = 16
CHAT_TURNS, CHAT_MSG = 8, 1000
NO_CACHE_STEPS = 4  # timed decode steps of no cache in a sweep: each is a whole forward, alike


def load_model(spec: dict[str, Any], attn_impl: str = "sdpa") -> torch.nn.Module:
    """spec: {"variant" (of "architecture", default llama) | "model_path" | neither (the default
    model), "device", "dtype", "seed", optional "page_size", "kv_cache_dtype", "quantization" (and
    its "quantization_group_size"), and "nlayers" (with a variant)}."""
    return get_model(spec.get("architecture", "llama"), variant=spec.get("variant"),
                     model_path=spec.get("model_path"), attn_impl=attn_impl,
                     device=spec.get("device", "auto"), dtype=spec.get("dtype"), seed=spec.get("seed", 0),
                     quantization=spec.get("quantization"),
                     quantization_group_size=spec.get("quantization_group_size") or 128,
                     **{k: spec[k] for k in ("page_size", "nlayers", "kv_cache_dtype") if spec.get(k)})


def with_config(model: torch.nn.Module, **changes: Any) -> torch.nn.Module:
    """A shallow twin sharing every weight, whose config differs by `changes` (e.g. the page size)."""
    twin = copy.copy(model)
    twin.config = dataclasses.replace(model.config, **changes)
    return twin


def with_rope_len(model: torch.nn.Module, max_len: int) -> torch.nn.Module:
    """A twin sharing every weight, its RoPE table reaching `max_len` positions: for runs past the
    trained length that measure memory or time (the tokens are not meaningful there)."""
    if max_len <= model.config.max_expected_seq_len:
        return model
    twin = with_config(model, max_expected_seq_len=max_len)
    twin._modules = dict(model._modules)  # don't touch the original's submodules
    twin.ropes = torch.nn.ModuleList(RotaryEmbedding(r.head_dim, max_len, r.theta, r.scaling)
                                     for r in model.ropes)
    twin.reset_buffers()
    return twin


class NoCache:
    """No KV cache, `DenseBackend`'s interface: each step feeds every sequence's whole history
    (right-padded, causal); the step is the `last` token of each row, whose logits are read."""

    kernel, kv_bytes = "none", 0

    def __init__(self, device: torch.device):
        self.device, self.history = device, {}

    def _batch(self, seq_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.history[s] for s in seq_ids]
        S = max(map(len, rows))
        tokens = torch.zeros(len(rows), S, dtype=torch.long)  # [B, S]
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r)
        last = torch.tensor([b * S + len(r) - 1 for b, r in enumerate(rows)])  # into [B * S]
        return tokens.to(self.device), last.to(self.device)

    def prefill(self, seq_ids, prompts, starts=None):
        for s, p in zip(seq_ids, prompts):
            self.history.setdefault(s, []).extend(p)
        tokens, last = self._batch(seq_ids)
        return tokens, None, None, last

    def decode(self, seq_ids, tokens, lengths, active):
        for s, t in zip(seq_ids, tokens.tolist()):
            self.history[s].append(t)
        tokens, last = self._batch(seq_ids)
        return tokens, None, last

    @staticmethod
    def decode_step(model, tokens, positions, last) -> torch.Tensor:
        return model(tokens, None, None, logits_at=last)  # [B, V]

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.history.pop(s, None)


def make_backend(model, impl: str, max_batch: int, max_seq_len: int, *, kernel: str = "auto",
                 num_pages: int | None = None):
    if impl == "no-cache":
        return NoCache(model.device)
    if impl == "sdpa":
        return DenseBackend(model, max_batch, max_seq_len)
    if impl == "paged":
        return PagedCache(model, max_batch, max_seq_len, num_pages=num_pages, kernel=kernel)
    raise ValueError(f"attn_impl={impl!r}; expected one of {IMPLS}")


def scenario_plans(name: str, scale: float, max_len: int, new_tokens: int) -> list[dict[str, Any]]:
    """The runs of a scenario at `scale`: prompt lengths (and chat turns), each clipped to fit
    `max_len` with `new_tokens` more; `length` is the longest prompt (chat: the last context)."""
    cap = max_len - new_tokens
    if cap < 2:
        raise ValueError(f"new_tokens={new_tokens} leaves no room in max_len={max_len}")
    clip = lambda n: int(min(max(2, round(n)), cap))
    if name == "chat":  # as many turns as fit (each: message, reply token fed back, new tokens)
        msg = clip(CHAT_MSG * scale)
        turns = [msg] * min(CHAT_TURNS, max_len // (msg + 1 + new_tokens)) or [cap]
        plan = {"name": name, "prompt_lengths": turns[:1], "turns": turns, "new_tokens": new_tokens}
        return [dict(plan, length=final_lengths(plan)[0])]
    if name not in ("single", "mixed"):
        raise ValueError(f"scenario={name!r}; expected one of {SCENARIOS}")
    plans = {}
    for f in SWEEP:
        L = clip(SINGLE_LEN * scale * f)
        lens = [L] if name == "single" else [clip(x) for x in np.linspace(L / MIXED_N, L, MIXED_N)]
        plans[L] = {"name": name, "length": L, "prompt_lengths": lens, "new_tokens": new_tokens}
    return list(plans.values())


def final_lengths(plan: dict[str, Any]) -> list[int]:
    """Tokens each sequence holds at the end (the last generated token is never fed back)."""
    n = plan["new_tokens"]
    if "turns" in plan:
        return [sum(plan["turns"]) + len(plan["turns"]) * n - 1]
    return [p + n - 1 for p in plan["prompt_lengths"]]


def shortened(plan: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """The same shapes, fewer tokens and turns: a warm-up run (and the memory of no cache)."""
    return dict(plan, new_tokens=min(plan["new_tokens"], new_tokens), **(
        {"turns": plan["turns"][:2]} if "turns" in plan else {}))


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def stats_ms(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64) * 1e3
    mean, p50, p90 = (a.mean(), *np.percentile(a, [50, 90])) if a.size else (float("nan"),) * 3
    return {"mean_ms": float(mean), "p50_ms": float(p50), "p90_ms": float(p90), "n": int(a.size)}


def _turn(model, cache, step_fn, prompts, lengths: list[int], new_tokens: int):
    """Prefill `prompts` after each row's `lengths` cached tokens (updated in place), then greedily
    decode `new_tokens - 1` more -> (tokens [B][new_tokens], TTFT s, seconds of each decode step)."""
    B, device, ids = len(prompts), model.device, list(range(len(prompts)))
    sync(device)
    t0 = time.perf_counter()
    tokens, positions, step, last = cache.prefill(ids, prompts, list(lengths))
    tok = model(tokens, positions, step, logits_at=last).argmax(-1)  # logits: [B, V]
    out = [[t] for t in tok.tolist()]  # host sync: the first tokens are out
    ttft = time.perf_counter() - t0
    lengths[:] = [n + len(p) for n, p in zip(lengths, prompts)]
    steps = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        tokens, positions, step = cache.decode(ids, tok, lengths, [True] * B)
        tok = step_fn(model, tokens, positions, step).argmax(-1)  # logits: [B, V]
        for o, x in zip(out, tok.tolist()):  # host sync ends the step
            o.append(x)
        steps.append(time.perf_counter() - t)
        lengths[:] = [n + 1 for n in lengths]
    return out, ttft, steps


@torch.inference_mode()
def run_plan(model, impl: str, plan: dict[str, Any], *, kernel: str = "auto", warmup: int = 2,
             seed: int = 0, compile: bool = False) -> dict[str, Any]:
    """One run of `plan` on backend `impl` -> its figures (JSON-ready) and "outputs" (token ids).
    The paged pool holds exactly the workload (+ the null page); the dense rows, the longest."""
    finals, n, specs = final_lengths(plan), plan["new_tokens"], attention_specs(model)
    # (in every layer slice of a model whose pages are held per layer group)
    slices = model_groups(model).num_slices
    pages = slices * min_pages(finals, model.config.page_size) + 1 if impl == "paged" else None
    cache = make_backend(model, impl, len(finals), max(finals) + 1, kernel=kernel, num_pages=pages)
    step_fn = cache.decode_step if impl == "no-cache" else decode_fn(cache, compile)
    messages = random_prompts(plan.get("turns", plan["prompt_lengths"]), model.config.src_vocab_size, seed)
    turns = [[m] for m in messages] if "turns" in plan else [messages]
    lengths, outs, per_turn = [0] * len(finals), [[] for _ in finals], []
    for t, prompts in enumerate(turns):
        if t:  # the last reply token enters the cache with the next message
            prompts = [[o[-1]] + p for o, p in zip(outs, prompts)]
        context = lengths[0] + len(prompts[0])
        got, ttft, steps = _turn(model, cache, step_fn, prompts, lengths, n)
        for o, g in zip(outs, got):
            o += g
        kv = kv_accounting(cache, lengths, model.config, model.dtype, [s.window for s in specs])
        per_turn.append({"context": context, "ttft_s": ttft, "steps": steps, "kv": kv})
    cache.release(list(range(len(finals))))
    prefill_s, decode_s = sum(t["ttft_s"] for t in per_turn), sum(sum(t["steps"]) for t in per_turn)
    generated = sum(map(len, outs))
    return {
        "scenario": plan["name"], "length": plan["length"], "attn_impl": impl,
        "kernel": cache.kernel.name if impl == "paged" else impl, "batch": len(outs),
        "prompt_lengths": plan["prompt_lengths"], "final_lengths": list(lengths), "new_tokens": n,
        "warmup_steps": warmup, "ttft_ms": 1e3 * prefill_s / len(per_turn),
        "per_token": stats_ms([s for t in per_turn for s in t["steps"][warmup:]]),
        "decode_steps": sum(len(t["steps"]) for t in per_turn), "tokens_generated": generated,
        "prefill_s": prefill_s, "decode_s": decode_s, "tokens_per_s": generated / (prefill_s + decode_s),
        "kv": per_turn[-1]["kv"], "outputs": outs,
        "turns": [{"context": t["context"], "ttft_ms": 1e3 * t["ttft_s"], **stats_ms(t["steps"][warmup:]),
                   "kv_bytes_held": t["kv"]["kv_bytes_held"]} for t in per_turn] if "turns" in plan else [],
    }


def run_scenarios(model, args, log=print) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every plan of every scenario of `args` on every backend -> (plans, runs); the backends in ABBA
    order over the plans (the machine's drift falls on all alike), each after an untimed short copy
    of the first plan (one-time costs; with `--compile true` of every plan: its shapes compile)."""
    plans, runs, warmup, compile = [], [], args.warmup, args.compile is True
    kw = dict(kernel=args.kernel, seed=args.seed, compile=compile)
    for name in args.scenarios:
        todo = scenario_plans(name, args.scale, model.config.max_expected_seq_len, args.new_tokens)
        plans += todo
        for i, plan in enumerate(todo):
            for impl in args.impls if i % 2 == 0 else args.impls[::-1]:
                if i == 0 or compile:
                    run_plan(model, impl, shortened(plan, warmup + 2), warmup=0, **kw)
                short = impl == "no-cache" and "turns" not in plan
                runs.append(r := run_plan(model, impl, shortened(plan, warmup + NO_CACHE_STEPS + 1) if short
                                          else plan, warmup=warmup, **kw))
                log(f"[bench] {name} {plan['length']:>5} {impl:8s} TTFT {r['ttft_ms']:8.1f} ms, "
                    f"{r['per_token']['p50_ms']:7.2f} ms/token (p50)")
    return plans, runs
