"""`make gpu-check`, stage 5: tensor parallelism over every GPU the machine has (NCCL), when it has
more than one; skipped otherwise, saying so (the stage then passes: there is nothing to split over).

The engine on one GPU and split over N (`Engine(..., tensor_parallel_size=N)`, rank r on GPU r,
spawned), the same requests: greedy bf16 tokens equal to one GPU's up to a near tie (checked as
the half-precision tests do: the first difference must fall where one rank's top two
log-probabilities are within the tolerance), and the median decode step of each. `tiny`: the
CPU dry run, 2 ranks over gloo with the `micro` model in fp32 (tokens exactly equal), so the
stage's code runs in CI.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.bench.report import table

NEW = 24
TOL_BF16 = 32 * torch.finfo(torch.bfloat16).eps  # the half-precision tests' near-tie tolerance


def _model(device: torch.device, tiny: bool) -> torch.nn.Module:
    if tiny:
        return get_model(variant="micro", device="cpu", attn_impl="paged", seed=0)
    return get_model(variant="3-8b", device=device, attn_impl="paged", dtype=torch.bfloat16, seed=0,
                     nlayers=4, page_size=16)


def _run(device: torch.device, tiny: bool, size: int) -> dict[str, Any]:
    """The requests through an engine of `size` ranks -> tokens, top-2 log-probabilities, step times."""
    model = _model(device, tiny)
    vocab = model.config.src_vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (17, 64, 130, 200)]
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=256, num_pages=128, max_model_len=512,
                 compile=not tiny, tensor_parallel_size=size)
    try:
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2))
               for p in prompts]
        toks: dict[int, list[int]] = {i: [] for i in ids}
        lps: dict[int, list] = {i: [] for i in ids}
        steps = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
                lps[o.request_id] += o.logprobs or []
            steps.append(time.perf_counter() - t0)
    finally:
        eng.shutdown()
    return {"tokens": [toks[i] for i in ids], "logprobs": [lps[i] for i in ids],
            "step_ms": 1e3 * statistics.median(steps[len(steps) // 2:])}  # the later, decode-only steps


def _near_tie(lp) -> float:
    """The gap between a step's two best log-probabilities (inf if fewer were given)."""
    top = [v for _, v in lp.top] if lp is not None else []  # most likely first
    return top[0] - top[1] if len(top) >= 2 else float("inf")


def run(device: torch.device, tiny: bool, log: Callable[[str], None] = print, *,
        deadline_s: float | None = None) -> dict[str, Any]:
    if tiny:
        size = 2
    elif device.type != "cuda" or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if device.type == "cuda" else 0
        return {"passed": True, "skipped": f"{n} GPU(s) here: tensor parallelism needs more than one",
                "checks": []}
    else:
        size = torch.cuda.device_count()
    t0 = time.perf_counter()
    one = _run(device, tiny, 1)
    log(f"[tp] 1 rank: decode step {one['step_ms']:.2f} ms")
    if deadline_s is not None and time.perf_counter() - t0 > deadline_s / 2:
        return {"passed": False, "size": size, "error": f"not run: past half of {deadline_s:.0f} s",
                "checks": [], "step_ms": {1: one["step_ms"]}}
    split = _run(device, tiny, size)
    log(f"[tp] {size} ranks: decode step {split['step_ms']:.2f} ms")
    checks = []
    for i, (a, b) in enumerate(zip(one["tokens"], split["tokens"])):
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            checks.append({"request": i, "passed": len(a) == len(b) == NEW, "first_difference": None})
            continue
        gap = _near_tie(one["logprobs"][i][first])
        ok = not tiny and gap <= TOL_BF16  # fp32 (tiny): exact; bf16: only at a near tie
        checks.append({"request": i, "passed": ok, "first_difference": first, "top2_gap": gap})
    return {"passed": all(c["passed"] for c in checks), "size": size, "checks": checks,
            "step_ms": {1: one["step_ms"], size: split["step_ms"]}}


def markdown(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return f"## Tensor parallelism\n\nSkipped: {result['skipped']}."
    rows = [{"request": c["request"], "ok": c["passed"],
             "detail": "tokens equal" if c["first_difference"] is None else
             f"first difference at token {c['first_difference']} (top-2 gap {c.get('top2_gap', 0):.3g})"}
            for c in result.get("checks", [])]
    steps = ", ".join(f"{n} rank(s) {ms:.2f} ms" for n, ms in result.get("step_ms", {}).items())
    return (f"## Tensor parallelism ({result.get('size')} ranks)\n\nMedian decode step: {steps}.\n\n"
            + table(rows, [("request", "request", "d"), ("passed", "ok", ""), ("detail", "detail", "")]))
