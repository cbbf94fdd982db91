"""Stage 2 of `make gpu-check`: the paged cache is exact on the device, in fp32, bf16 and fp16.

Each case is a random-weight `transformers.LlamaForCausalLM` (2 layers, vocab 512, norms
randomized, weights N(0, 1/hidden) so attention scores have unit spread: neither uniform nor
one-hot, so a misread key moves the output) loaded into ours, run as the engine runs it: kernel
"auto" (flex on CUDA) unless the case names one, prefill through `PagedBackend` and the model's
forward, then greedy decode steps through the compiled decode step (`decode_fn(backend,
compile=True)`), rows padded to the engine's decode bucket with inactive rows. Two scenarios
share one backend (and its compiled kernels):
- "fresh": seqs 0..3, prompts of 1, P-1, P+1 and 2P+3 tokens (ending inside a page);
- "nan-reuse, rows 5,2,7": the fresh run's pages are filled with NaN and released; seqs 5, 2, 7 of
  an 8-row backend (rows that are not 0..B-1: attention-gym issue 189) reuse them, and decode
  padded with an inactive row (seq 0), as the engine pads.
References, teacher-forced on the paged run's tokens: the dense SDPA backend on the same weights
(in lockstep), HF in the case's dtype and HF in fp32 (attn_implementation="sdpa", same device).

Checks per scenario (metric "rel": max |logit error| / max |reference logit|; u: unit roundoff,
fp32 2^-24, bf16 2^-8, fp16 2^-11; a misread or stale page moves logits by O(1), NaN always fails):
- paged vs dense, same dtype. fp32: rel <= 2^10 u (6e-5). The paths differ in summation order
  only, whose round-off grows like sqrt(n) u per dot product (n <= 5632 here: ~75 u), compounded
  over 2 layers and the head. bf16 / fp16: rel <= 16 u. Both accumulate in fp32 and round ~26
  stored tensors to the dtype (about 12 per layer, then the final norm and the head); once
  attention rounds differently the two paths' roundings are independent: a random walk of
  sqrt(2 x 26) ~ 7 u, and 16 u is twice that.
- paged vs HF. fp32: rel vs HF <= 2^10 u, as above. bf16 / fp16: rel vs HF in fp32 <=
  max(1.5 x HF's own rel error in that dtype, 8 u): as accurate as HF within half again, and
  never held below ~sqrt(26) u, one half-precision forward's own error.
- fp32 greedy tokens: each paged token is the argmax of dense and of HF at its step, except where
  the reference's top two logits are closer than its tolerance (a tie at this precision).
fp32 runs with `torch.set_float32_matmul_precision("highest")` (no TF32), restored afterwards.

Matrix: a cover, not the cross product (3 dtypes x 3 head layouts x 2 page sizes = 18 cases; each
case compiles a flex prefill and a whole decode step, seconds each on an H100, and the stage has
~100 s). FULL, 5 cases: fp32 on every head layout (each against HF), bf16 (gqa 32/8, P=128) and
fp16 (gqa 8/2, P=16), so every dtype, head layout and page size appears, and both scenarios run in
every case, so NaN reuse and foreign rows run in every dtype. Head dims 64 and 128, hidden =
Hq x head_dim, prompts up to 2P+3 = 259 tokens, 16 decode steps. TINY (the CPU dry run): one case
per dtype, head_dim 16, P=16, 8 decode steps; bf16 on the flex kernel (the one CUDA runs, and one
that reads whole pages, so NaN left in them shows), fp32 and fp16 on the CPU's own (cpp).
"""

from __future__ import annotations

import contextlib
import copy
import io
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fms_paged.bench.latency import make_backend
from fms_paged.engine.model_step import decode_fn
from fms_paged.kv.geometry import page_slots
from fms_paged.models.registry import get_model

DTYPES = {"float32": (torch.float32, 2.0**-24), "bfloat16": (torch.bfloat16, 2.0**-8),
          "float16": (torch.float16, 2.0**-11)}
C_DENSE = {"float32": 2.0**10, "bfloat16": 16.0, "float16": 16.0}  # tolerance / u, paged vs dense
HF_FACTOR, HF_FLOOR = 1.5, 8.0  # half precision vs fp32 HF: max(1.5 x HF's error, 8 u)
VOCAB, LAYERS, MAX_BATCH = 512, 2, 8
FRESH_IDS, ROWS_IDS = [0, 1, 2, 3], [5, 2, 7]


@dataclass(frozen=True)
class Case:
    dtype: str
    nheads: int
    kvheads: int
    head_dim: int
    page: int
    kernel: str = "auto"

    @property
    def model(self) -> str:
        return f"{'mha' if self.nheads == self.kvheads else 'gqa'} {self.nheads}/{self.kvheads}"


FULL = [Case("bfloat16", 32, 8, 64, 128), Case("float32", 32, 8, 64, 16), Case("float16", 8, 2, 128, 16),
        Case("float32", 8, 2, 128, 128), Case("float32", 8, 8, 64, 16)]
TINY = [Case("float32", 8, 2, 16, 16), Case("bfloat16", 8, 2, 16, 16, "flex"), Case("float16", 4, 4, 16, 16)]


def hf_llama(case: Case, seed: int = 0) -> torch.nn.Module:
    """A random-weight fp32 `LlamaForCausalLM` on the CPU (norm weights drawn from U(0.5, 1.5))."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = case.nheads * case.head_dim
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=LAYERS, num_attention_heads=case.nheads,
                      num_key_value_heads=case.kvheads, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=hidden**-0.5,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def lockstep(model, paged, dense, step_fn, seq_ids: list[int], prompts: list[list[int]], steps: int,
             bucket: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Paged greedy run of `prompts` in rows `seq_ids` (decode padded to `bucket` rows), the dense
    backend fed the same tokens in rows 0..B-1 -> logits paged, dense [B, steps + 1, V] (fp32,
    the prefill's last position then each decode step) and the paged tokens [B][steps + 1]."""
    B = len(prompts)
    t, p, s, last = paged.prefill(seq_ids, prompts)
    out_p = [model(t, p, s, logits_at=last)]  # [B, V]
    t, p, s, last = dense.prefill(list(range(B)), prompts)
    out_d = [model(t, p, s, logits_at=last)]
    lengths, pad = [len(x) for x in prompts], bucket - B
    for _ in range(steps):
        tok = out_p[-1].argmax(-1)  # [B]
        rows = (seq_ids + [0] * pad, torch.cat([tok, tok.new_zeros(pad)]), lengths + [0] * pad,
                [True] * B + [False] * pad)
        t, p, s = paged.decode(*rows)
        out_p.append(step_fn(model, t, p, s)[:B])  # [B, V]
        t, p, s = dense.decode(list(range(B)), tok, lengths, [True] * B)
        out_d.append(model(t, p, s)[:, -1])
        lengths = [n + 1 for n in lengths]
    lp, ld = torch.stack(out_p, 1).float(), torch.stack(out_d, 1).float()  # [B, steps + 1, V]
    return lp, ld, lp.argmax(-1).tolist()


@torch.inference_mode()
def hf_logits(hf, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """HF teacher-forced on prompt + the paged tokens (each sequence alone, no padding) -> logits
    at the positions the paged run sampled: [B, steps + 1, V] fp32."""
    dev, out = next(hf.parameters()).device, []
    for prompt, toks in zip(prompts, tokens):
        ids = torch.tensor([prompt + toks[:-1]], device=dev)  # [1, L]
        out.append(hf(input_ids=ids).logits[0, len(prompt) - 1:].float())
    return torch.stack(out)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (NaN if x holds NaN or inf)."""
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).abs().max() / ref.abs().max()).item()


def token_mismatches(tokens: list[list[int]], ref: torch.Tensor, tol: float) -> int:
    """Steps where a paged token is not the reference's argmax and the reference's top two
    logits are more than `tol` x max |ref| apart (closer is a tie at this precision)."""
    top2 = ref.topk(2, dim=-1)  # values, indices: [B, steps + 1, 2]
    decisive = (top2.values[..., 0] - top2.values[..., 1]) > tol * ref.abs().max()
    wrong = torch.tensor(tokens, device=ref.device) != top2.indices[..., 0]
    return int((wrong & decisive).sum())


def check(name: str, case: Case, kernel: str, metric: str, value: float, tol: float, why: str,
          **extra: Any) -> dict[str, Any]:
    """One check's record (JSON-able: a NaN value is stored as None and fails)."""
    ok = value == value and value <= tol
    return {"name": name, "dtype": case.dtype, "model": case.model, "page_size": case.page,
            "kernel": kernel, "metric": metric, "value": value if value == value else None,
            "tolerance": tol, "why": why, "passed": bool(ok), **extra}


def scenario_checks(case: Case, kernel: str, scen: str, prompts, run, hfs) -> list[dict[str, Any]]:
    """The checks of one scenario from its paged/dense logits and tokens `run` and HF models
    `hfs` = (HF in the case's dtype, HF fp32)."""
    lp, ld, tokens = run
    dt, u = case.dtype, DTYPES[case.dtype][1]
    ref = hf_logits(hfs[1], prompts, tokens).to(lp.device)
    tol_d = C_DENSE[dt] * u
    why_d = (f"{C_DENSE[dt]:g} u: summation order alone differs (sqrt(n) u per dot product, 2 layers)"
             if dt == "float32" else f"{C_DENSE[dt]:g} u: 2 x the random walk of 2 x 26 independent "
             "roundings to the dtype (fp32 accumulation)")
    out = [check(f"{scen}: paged vs dense", case, kernel, "rel", rel_err(lp, ld), tol_d, why_d)]
    if dt == "float32":
        out.append(check(f"{scen}: paged vs HF", case, kernel, "rel", rel_err(lp, ref), tol_d,
                         why_d.replace("summation order alone", "HF's summation order alone")))
        miss = token_mismatches(tokens, ld, tol_d) + token_mismatches(tokens, ref, tol_d)
        out.append(check(f"{scen}: greedy tokens vs dense, HF", case, kernel, "mismatches", miss, 0,
                         "fp32 greedy tokens must be identical, but for ties within the tolerance"))
        return out
    hf_err = rel_err(hf_logits(hfs[0], prompts, tokens).to(lp.device), ref)
    tol_h = max(HF_FACTOR * hf_err, HF_FLOOR * u)
    out.append(check(f"{scen}: paged vs fp32 HF", case, kernel, "rel", rel_err(lp, ref), tol_h,
                     f"max(1.5 x HF's own {dt} error {hf_err:.2e}, {HF_FLOOR:g} u): as accurate as HF",
                     hf_rel=hf_err))
    return out


def poison_and_release(paged, seq_ids: list[int]) -> set[int]:
    """Fill every slot of the pages of `seq_ids` with NaN in every pool, then release them ->
    the pages."""
    pages = sorted({pg for s in seq_ids for pg in paged.pm.pages_of(s)})
    idx = torch.from_numpy(page_slots(np.asarray(pages), paged.pm.page_size).reshape(-1)).to(paged.device)
    for pool in paged.k_pools + paged.v_pools:
        pool.index_fill_(2, idx, float("nan"))
    paged.release(seq_ids)
    return set(pages)


def run_case(case: Case, device: torch.device, steps: int, checks: list[dict[str, Any]]) -> None:
    """Both scenarios of one case, their checks appended to `checks` as they are made."""
    dtype, P = DTYPES[case.dtype][0], case.page
    hf = hf_llama(case)
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            hf.save_pretrained(tmp)
        model = get_model(model_path=tmp, attn_impl="paged", device=device, dtype=dtype, page_size=P)
    hf32 = hf.to(device)
    hfs = (hf32 if dtype == torch.float32 else copy.deepcopy(hf32).to(dtype), hf32)  # (dtype, fp32)
    fresh_len, rows_len = [1, P - 1, P + 1, 2 * P + 3], [2 * P + 3, P + 1, P - 1]
    max_len = max(fresh_len) + steps + 1
    paged = make_backend(model, "paged", MAX_BATCH, max_len, kernel=case.kernel)
    dense = make_backend(model, "sdpa", len(FRESH_IDS), max_len)
    step_fn, kernel = decode_fn(paged, compile=True), paged.kernel.name
    prompts = prompts_of(fresh_len, seed=1)
    run = lockstep(model, paged, dense, step_fn, FRESH_IDS, prompts, steps, bucket=4)
    checks += scenario_checks(case, kernel, "fresh", prompts, run, hfs)
    poisoned = poison_and_release(paged, FRESH_IDS)
    prompts = prompts_of(rows_len, seed=2)
    run = lockstep(model, paged, dense, step_fn, ROWS_IDS, prompts, steps, bucket=4)
    used = {pg for s in ROWS_IDS for pg in paged.pm.pages_of(s)}
    reused = f"{len(used & poisoned)}/{len(used)} pages reused from NaN-filled ones"
    if not used & poisoned:
        raise AssertionError(f"the NaN scenario is vacuous: {reused}")
    scen = f"nan-reuse, rows {','.join(map(str, ROWS_IDS))}"
    checks += [dict(c, note=reused) for c in scenario_checks(case, kernel, scen, prompts, run, hfs)]


def failed_case(case: Case, e: BaseException, name: str = "case raised") -> dict[str, Any]:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
    return check(name, case, "?", "error", float("nan"), 0.0, "a check must run to pass", error=text)


def run_logged(case: Case, device: torch.device, steps: int, log: Callable[[str], None]) -> list:
    """`run_case`'s checks, then a failed check with the error if it raised; one progress line."""
    t, got = time.perf_counter(), []
    try:
        run_case(case, device, steps, got)
    except Exception as e:  # noqa: BLE001 - recorded as a failed check, the stage goes on
        got.append(failed_case(case, e))
    bad = [c["name"] for c in got if not c["passed"]]
    log(f"{case.dtype:8s} {case.model:8s} P={case.page:<3d} {got[0]['kernel']:6s} "
        f"{len(got) - len(bad)}/{len(got)} checks passed ({time.perf_counter() - t:.1f} s)"
        + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return got


def run(device: torch.device, tiny: bool, log: Callable[[str], None] = print, *,
        dtypes: tuple[str, ...] | None = None, deadline_s: float | None = None) -> dict[str, Any]:
    """Every case of the matrix (TINY or FULL; only `dtypes` if given) -> {"passed", "checks",
    "seconds", ...}. A case that raises, or that would start too late to end by `deadline_s`
    (seconds from now; gpu-check passes its stage's; default: none), or that is interrupted
    (SIGINT: the stage's budget ran out), is a failed check; the others run or are kept."""
    cases = [c for c in (TINY if tiny else FULL) if dtypes is None or c.dtype in dtypes]
    steps, checks, t0, last = (8 if tiny else 16), [], time.perf_counter(), 0.0
    deadline = float("inf") if deadline_s is None else deadline_s
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32: no TF32 (restored below)
    try:
        for case in cases:
            t = time.perf_counter()
            if t - t0 + last > deadline:  # it would likely end past the deadline
                why = f"not run: {t - t0:.0f} s spent + {last:.0f} s (the last case) > {deadline:.0f} s"
                checks.append(failed_case(case, TimeoutError(why), "case not run"))
                log(f"{case.dtype:8s} {case.model:8s} P={case.page:<3d} {why}")
                continue
            try:
                checks += run_logged(case, device, steps, log)
            except KeyboardInterrupt:  # the driver's budget ran out: keep what was checked
                checks.append(failed_case(case, TimeoutError("interrupted: the stage's budget ran out"),
                                          "case interrupted"))
                break
            last = time.perf_counter() - t
    finally:
        torch.set_float32_matmul_precision(precision)
    return {"stage": "exactness", "device": str(device), "tiny": tiny, "decode_steps": steps,
            "passed": bool(checks) and all(c["passed"] for c in checks), "checks": checks,
            "seconds": time.perf_counter() - t0}


def markdown(result: dict[str, Any]) -> str:
    """A markdown section: heading, verdict, one table row per check."""
    verdict = "passed" if result["passed"] else "FAILED"
    lines = [f"## Exactness ({result['device']}{', tiny' if result.get('tiny') else ''}): {verdict}",
             "", f"{len(result['checks'])} checks, {result.get('decode_steps')} compiled decode steps "
             f"per scenario, {result.get('seconds', 0):.0f} s. rel = max |logit error| / max |reference "
             "logit|; u = unit roundoff.", "",
             "| check | dtype | model | page | kernel | metric | value | tolerance | why | pass |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["checks"]:
        why = c["why"] + (f" ({c['note']})" if c.get("note") else "") + (
            f" ERROR: {c['error'].splitlines()[-1]}" if c.get("error") else "")
        value = "NaN" if c["value"] is None else f"{c['value']:.3g}"
        cells = [c["name"], c["dtype"], c["model"], c["page_size"], c["kernel"], c["metric"], value,
                 f"{c['tolerance']:.3g}", why.replace("|", "/"), "yes" if c["passed"] else "**NO**"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"
