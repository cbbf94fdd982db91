"""Half-precision fidelity (fms_paged/bench/fidelity.py, scripts/fidelity.py) on a small text: the first
2 windows of 128 tokens of the stdlib docs, through the default model, on the CPU (the benchmark runs
every forward there, whatever `--device` says).

Tolerances, in units of the dtype's unit roundoff u (2^-8 bf16, 2^-11 fp16) and the position's logit
scale |z|max (the fp32 reference's largest |logit| there):
- Logit error budget: our forward rounds each layer's activations to the dtype about 8 times (normed
  input, q/k/v, attention output, its projection plus residual, normed input, gated-MLP product, its
  projection plus residual), and the embedding, final norm and head once each: R = 8 L + 3 roundings
  (L = 4 layers: R = 35). To first order each moves a logit by at most about u |z|max, so at every
  position max_i |z_sys,i - z_ref,i| <= R u |z|max. (A cache that loses context moves logits by
  O(|z|max), far past this: `test_the_budget_catches_lost_context` checks it does.)
- Top-1 agreement: each logit moves by at most the budget, so the argmax can only change where the
  reference's top-1/top-2 margin is below twice the budget; agreement >= the fraction of positions
  whose margin is larger.
- KL: KL(p || softmax(z + d)) ~= Var_p(d) / 2 for a small logit error d; R independent roundings add
  in quadrature, sqrt(R) u |z|max, so mean KL <= R u^2 mean(|z|max^2) / 2.
- The same error per u in both dtypes: rounding error scales with u and KL with its square, so mean
  KL / u^2 is about the same in bf16 and fp16 (both round to nearest; this model's activations are far
  inside fp16's range). An error that is not rounding (a wrong cache read) is the same size in both
  and would make the fp16 ratio (u_bf16 / u_fp16)^2 = 64 times the bf16 one. Held within a factor 4
  (a logit error within 2x per u).
- Paged vs dense: both run the same weights, schedule and dtype and differ only in the attention
  kernel, as HF's sdpa and eager do; our pair's KL <= 4 x HF's pair's KL, KL being quadratic in the
  logit error: our attention's rounding may perturb the logits up to twice as much as HF's does.
- fp32 paths (HF, ours paged) differ from the reference only in summation order: at most about n u
  (Higham's gamma_n) of the logit scale for dot products of n <= the MLP width (512) terms.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fms_paged.bench import fidelity
from fms_paged.bench.perplexity import perplexity
from fms_paged.kv import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
WINDOW, N_WINDOWS, CHUNK, CHARS = 128, 2, 32, 2_000  # 2000 characters encode to > 2 windows
HALF = fidelity.HALF_DTYPES
OURS = ("ours paged", "ours dense")
KL_SCALE_FACTOR = 4.0  # mean KL / u^2 of bf16 and fp16 within this factor of each other
PAIR_FACTOR = 4.0  # our paged-vs-dense KL <= this x HF's sdpa-vs-eager KL


def _roundings(model: torch.nn.Module) -> int:
    """R = 8 L + 3: the dtype roundings on the way to the logits (see the module docstring)."""
    return 8 * model.config.nlayers + 3


def _kl(ref: torch.Tensor, sys: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_ref || p_sys) in float64, through F.kl_div: [N, V], [N, V] -> [N]."""
    return F.kl_div(sys.double().log_softmax(-1), ref.double().log_softmax(-1), log_target=True,
                    reduction="none").sum(-1)


@pytest.fixture(scope="module")
def run() -> SimpleNamespace:
    """The fp32 reference's and every system's logits at the predicted positions of 2 windows."""
    windows, _ = fidelity.doc_windows(CHARS, WINDOW)
    windows = windows[:N_WINDOWS]
    assert [len(w) for w in windows] == [WINDOW] * N_WINDOWS
    ref_model = fidelity.with_config(fidelity.load_ours("float32"), attn_impl="sdpa")
    ref = torch.cat([fidelity.full_logits(ref_model, w)[:-1] for w in windows])  # [N, V], N = 2 (W - 1)
    logits, paths = {}, {}
    for dtype in ("float32", *HALF):
        names = fidelity.FP32_CHECKS if dtype == "float32" else fidelity.SYSTEMS
        for name, s in fidelity.build_systems(dtype, WINDOW, CHUNK, names).items():
            logits[dtype, name] = torch.cat([s.logits(w)[:-1] for w in windows]).float()  # [N, V]
            paths[dtype, name] = s.path
    targets = torch.cat([torch.tensor(w[1:]) for w in windows])  # [N]
    return SimpleNamespace(windows=windows, ref=ref, targets=targets, logits=logits, paths=paths,
                           ref_model=ref_model, zmax=ref.double().abs().amax(-1))  # zmax: [N]


@pytest.mark.parametrize("dtype", HALF)
def test_paged_runs_the_cpp_kernel_where_it_builds(run, dtype) -> None:
    c = run.ref_model.config
    reason = cpu_kernel.unavailable_reason(torch.device("cpu"), getattr(torch, dtype), c.head_dim,
                                           c.page_size)
    if reason is not None:
        pytest.skip(f"the cpp kernel cannot serve the model here: {reason}")
    assert "kernel cpp" in run.paths[dtype, "ours paged"]
    assert "decode step" in run.paths[dtype, "ours paged"]


@pytest.mark.parametrize("name", OURS)
@pytest.mark.parametrize("dtype", HALF)
def test_logit_error_within_roundoff_budget(run, dtype, name) -> None:
    u, r = fidelity.unit_roundoff(getattr(torch, dtype)), _roundings(run.ref_model)
    err = (run.logits[dtype, name].double() - run.ref.double()).abs().amax(-1)  # [N]
    ratio = err / (u * run.zmax)
    assert float(ratio.max()) <= r, f"{name} {dtype}: logit error {float(ratio.max()):.1f} u |z|max > {r}"


@pytest.mark.parametrize("name", OURS)
@pytest.mark.parametrize("dtype", HALF)
def test_top1_agreement_and_kl_bounds(run, dtype, name) -> None:
    u, r = fidelity.unit_roundoff(getattr(torch, dtype)), _roundings(run.ref_model)
    ref = run.ref.double()
    top2 = ref.topk(2, -1).values  # [N, 2]
    safe = (top2[:, 0] - top2[:, 1]) > 2 * r * u * run.zmax  # [N] argmax cannot flip here
    tally = fidelity.Tally()
    tally.add(run.ref, run.logits[dtype, name], run.targets)
    got = tally.summary()
    assert got["agreement"] >= float(safe.double().mean())
    same = run.logits[dtype, name].double().argmax(-1) == ref.argmax(-1)
    assert bool(same[safe].all()), f"{name} {dtype}: top-1 changed where the margin exceeds the budget"
    kl_bound = r * u**2 * float((run.zmax**2).mean()) / 2
    assert 0 <= got["kl"] <= kl_bound, f"{name} {dtype}: mean KL {got['kl']:.3g} > {kl_bound:.3g}"


@pytest.mark.parametrize("name", OURS)
def test_error_per_unit_roundoff_is_the_same_in_both_dtypes(run, name) -> None:
    u = {d: fidelity.unit_roundoff(getattr(torch, d)) for d in HALF}
    per_u2 = {d: float(_kl(run.ref, run.logits[d, name]).mean()) / u[d] ** 2 for d in HALF}
    a, b = per_u2.values()
    assert 1 / KL_SCALE_FACTOR <= a / b <= KL_SCALE_FACTOR, f"{name}: mean KL / u^2 by dtype {per_u2}"


@pytest.mark.parametrize("dtype", HALF)
def test_paged_vs_dense_no_worse_than_hf_sdpa_vs_eager(run, dtype) -> None:
    ours = float(_kl(run.logits[dtype, "ours dense"], run.logits[dtype, "ours paged"]).mean())
    hf = float(_kl(run.logits[dtype, "hf eager"], run.logits[dtype, "hf sdpa"]).mean())
    assert hf > 0, f"HF sdpa and eager agree exactly in {dtype}: no scale to compare with"
    assert ours <= PAIR_FACTOR * hf, f"{dtype}: paged-vs-dense KL {ours:.3g} > {PAIR_FACTOR} x {hf:.3g}"


@pytest.mark.parametrize("name", fidelity.FP32_CHECKS)
def test_fp32_paths_match_the_reference(run, name) -> None:
    n, u = run.ref_model.config.hidden_dim, fidelity.unit_roundoff(torch.float32)
    err = (run.logits["float32", name].double() - run.ref.double()).abs().amax(-1)  # [N]
    assert bool((err <= n * u * run.zmax).all()), f"{name} fp32: {float(err.max()):.3g}"


def test_the_budget_catches_lost_context(run) -> None:
    """Guard: a cache that lost the prefilled half (the second half scored on its own) breaks the
    bf16 budget, so the budget tests above could not miss such a bug."""
    dtype, ids = "bfloat16", run.windows[0]
    split = len(ids) // 2
    model = fidelity.with_config(fidelity.load_ours(dtype), attn_impl="sdpa")
    lost = fidelity.full_logits(model, ids[split:])[:-1].double()  # [W - 1 - split, V]
    err = (lost - run.ref[split : WINDOW - 1].double()).abs().amax(-1)
    u = fidelity.unit_roundoff(torch.bfloat16)
    assert float((err / (u * run.zmax[split : WINDOW - 1])).max()) > _roundings(run.ref_model)


def test_tally_matches_an_independent_computation(run) -> None:
    sys = run.logits["bfloat16", "ours paged"]
    tally = fidelity.Tally()
    tally.add(run.ref, sys, run.targets)
    got = tally.summary()
    nll = F.cross_entropy(sys.double(), run.targets).item()
    assert got["positions"] == len(run.targets) == N_WINDOWS * (WINDOW - 1)
    assert got["kl"] == pytest.approx(float(_kl(run.ref, sys).mean()), rel=1e-9)
    assert got["nll"] == pytest.approx(nll, rel=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(nll), rel=1e-12)
    agree = float((sys.argmax(-1) == run.ref.argmax(-1)).double().mean())
    assert got["agreement"] == agree
    ref_ppl = perplexity(run.ref_model, [t for w in run.windows for t in w], window=WINDOW, use_cache=False)
    tally_ref = fidelity.Tally()
    tally_ref.add(run.ref, run.ref, run.targets)
    assert tally_ref.summary()["ppl"] == pytest.approx(ref_ppl["ppl"], rel=1e-9)


def test_paired_test_by_hand() -> None:
    """3 positions where only HF agrees, 1 where only ours does: n = 4 discordant positions, two-sided
    p = 2 * P(k <= 1 | n = 4, 1/2) = 2 * (1 + 4) / 16."""
    ours, hf = fidelity.Tally(), fidelity.Tally()
    ours.hits = [torch.tensor([True, False, False, False, True])]
    hf.hits = [torch.tensor([True, True, True, True, False])]
    assert fidelity.paired_test(ours, hf) == {"ours_only_miss": 3, "hf_only_miss": 1,
                                              "p_value": pytest.approx(2 * (1 + 4) / 16)}
    assert fidelity.paired_test(hf, hf)["p_value"] == 1.0


def test_windows_start_with_bos_and_cover_the_text() -> None:
    ids = list(range(10, 30))  # 20 text tokens
    windows = fidelity.bos_windows(ids, 8, bos_id=1)
    assert [w[0] for w in windows] == [1, 1, 1] and [len(w) for w in windows] == [8, 8, 7]
    assert [t for w in windows for t in w[1:]] == ids
    with pytest.raises(ValueError, match="window"):
        fidelity.bos_windows(ids, 1, bos_id=1)
    with pytest.raises(ValueError, match="no tokens"):
        fidelity.bos_windows([], 8, bos_id=1)


def test_script_writes_json_and_markdown(tmp_path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("fidelity_script", ROOT / "scripts" / "fidelity.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "fid"
    assert script.main(["--chars", "200", "--window", "64", "--chunk", "16", "--out", str(out)]) == 0
    res = json.loads((out / "fidelity.json").read_text())
    md = (out / "fidelity.md").read_text()
    assert md in capsys.readouterr().out
    assert res["text"]["windows"] >= 1 and res["config"]["window"] == 64
    assert res["reference"]["ppl"] == pytest.approx(res["reference"]["ppl_perplexity_py"], rel=1e-9)
    for d in HALF:
        assert set(res["systems"][d]) == set(fidelity.SYSTEMS)
        for name, row in res["systems"][d].items():
            assert f"| {name} | {d} |" in md
            assert 0 <= row["agreement"] <= 1 and row["kl"] >= 0
            assert row["abs_ppl_diff"] == pytest.approx(abs(row["ppl"] - res["reference"]["ppl"]))
        assert set(res["pairs"][d]) == {"ours paged vs ours dense", "hf sdpa vs hf eager"}
    for c in res["criteria"]:  # the verdicts follow from the numbers
        better = c["ours"] >= c["hf"] if ">=" in c["criterion"] else c["ours"] <= c["hf"]
        assert c["met"] == better
    assert len(res["criteria"]) == 4 * len(HALF)
    assert md.count("| met |") + md.count("| MISSED |") == len(res["criteria"])
    assert res["all_met"] == all(c["met"] for c in res["criteria"])
