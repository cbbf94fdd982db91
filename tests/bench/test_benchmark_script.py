"""The benchmark script at a small scale on the micro model: every scenario runs on every backend, and
the JSON's figures are internally consistent and agree with independent recomputations; the memory
plot draws figures that mean something (the 0-MiB bug: every run peak was 0). The script runs on the
test device (`--device`)."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fms_paged.bench import inference
from fms_paged.bench.environment import peak_meter
from fms_paged.bench.latency import load_model

ROOT = Path(__file__).resolve().parents[2]
NEW, WARMUP = 6, 1


@pytest.fixture(scope="module")
def run(tmp_path_factory, device):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_inference.py"), "--variant", "micro",
           "--scale", "0.05", "--new-tokens", str(NEW), "--warmup", str(WARMUP), "--attn-impl", "all",
           "--scenario", "all", "--ppl-chars", "1500", "--ppl-window", "128", "--device", str(device),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def _runs(res, scenario, impl=None):
    return [r for r in res["runs"] if r["scenario"] == scenario and impl in (None, r["attn_impl"])]


def test_every_scenario_runs_a_length_sweep_on_every_backend(run):
    _, res, _ = run
    assert {(r["scenario"], r["attn_impl"]) for r in res["runs"]} == {
        (s, i) for s in ("single", "mixed", "chat") for i in ("no-cache", "sdpa", "paged")}
    for s in ("single", "mixed"):
        assert [r["length"] for r in _runs(res, s, "paged")] == [50, 100, 200, 400]  # 8000 x 0.05 x SWEEP
    assert [len(r["prompt_lengths"]) for r in _runs(res, "mixed", "sdpa")] == [16] * 4


def test_counts_and_rates_are_consistent(run):
    _, res, _ = run
    for r in res["runs"]:
        turns = len(r["turns"]) or 1
        n = r["new_tokens"]  # no cache makes fewer outside chat: its step is a whole forward
        assert n == (NEW if r["attn_impl"] != "no-cache" or r["scenario"] == "chat" else min(NEW, WARMUP + 5))
        assert r["tokens_generated"] == sum(map(len, r["outputs"])) == r["batch"] * n * turns
        assert r["decode_steps"] == (n - 1) * turns
        assert r["per_token"]["n"] == (n - 1 - WARMUP) * turns  # warm-up steps left out of each turn
        assert r["tokens_per_s"] == pytest.approx(r["tokens_generated"] / (r["prefill_s"] + r["decode_s"]))
        p = r["per_token"]
        assert 0 < p["p50_ms"] <= p["p90_ms"] and p["mean_ms"] > 0
        # tokens in the cache at the end: every prompt and generated token but the last of each
        # sequence (chat: each later turn starts with the last reply token)
        plan = next(p for p in res["plans"] if (p["name"], p["length"]) == (r["scenario"], r["length"]))
        stored = sum(plan.get("turns", plan["prompt_lengths"])) + r["batch"] * (n * turns - 1)
        assert r["kv"]["tokens_stored"] == sum(r["final_lengths"]) == stored


def test_kv_held_matches_an_independent_computation(run):
    _, res, _ = run
    c = res["model"]["config"]
    per_token = 2 * c["nlayers"] * c["kvheads"] * c["head_dim"] * 4  # fp32
    P = c["page_size"]
    for r in res["runs"]:
        lens, kv = r["final_lengths"], r["kv"]
        held = {"paged": P * sum(math.ceil(n / P) for n in lens),  # whole pages
                "sdpa": len(lens) * (max(lens) + 1),  # rows preallocated to the longest
                "no-cache": 0}[r["attn_impl"]]
        assert kv["kv_bytes_needed"] == per_token * sum(lens)
        assert kv["kv_bytes_held"] == per_token * held, (r["scenario"], r["length"], r["attn_impl"])
        if held:
            assert kv["kv_waste_pct"] == pytest.approx(100 * (held - sum(lens)) / held)
    for c in res["compare"]:  # greedy tokens identical on every backend, with and without a cache
        assert c["outputs_match"] is True, c
    longest = _runs(res, "mixed")[-3:]
    by = {r["attn_impl"]: r["kv"] for r in longest}
    assert by["paged"]["kv_waste_pct"] < by["sdpa"]["kv_waste_pct"]


def test_memory_figures_mean_something(run):
    """The bug: `run_peak_bytes` was 0 for every run (a forked child's ru_maxrss is its parent's), so
    the plot drew 0 MiB for everything. Every plotted figure is now positive, and at the longest
    length the paged cache holds fewer KV bytes and peaks lower than the dense one."""
    _, res, _ = run
    assert "memory_error" not in res
    for r in _runs(res, "single") + _runs(res, "mixed"):  # measured (a tiny run may add nothing)
        assert 0 <= r["run_peak_bytes"] < r["process_peak_bytes"], r
    panels = inference.figures(res)["memory_vs_length.png"]
    # dense, paged, needed | no cache, dense, paged | per layer group (one: full): held, needed
    assert [len(p["series"]) for p in panels] == [3, 3, 2]
    held, needed = panels[2]["series"]
    assert all(h >= n for h, n in zip(held["y"], needed["y"]))
    for p in panels:
        for s in p["series"]:
            assert len(s["y"]) == 4 and all(y > 0 for y in s["y"]), (p["title"], s["label"])
    by = {r["attn_impl"]: r for r in _runs(res, "mixed") if r["length"] == 400}
    assert by["paged"]["kv"]["kv_bytes_held"] < by["sdpa"]["kv"]["kv_bytes_held"]
    assert by["paged"]["run_peak_bytes"] < by["sdpa"]["run_peak_bytes"]


def test_peak_meter_sees_an_allocation(device):
    meter = peak_meter(device)
    if meter is None:
        pytest.skip(f"no resettable peak memory counter on {device} here (CPU: Linux only)")
    start, peak = meter
    base = start()
    x = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB, touched; freed before peak() is read
    del x
    assert peak() - base >= 60 * 2**20


def test_perplexity_agrees_across_backends_and_with_no_cache(run, device):
    _, res, _ = run
    ppl = res["perplexity"]
    by = ppl["by_backend"]
    assert abs(by["paged"]["ppl"] - by["sdpa"]["ppl"]) / by["sdpa"]["ppl"] <= 1e-5
    assert by["paged"]["tokens"] == by["sdpa"]["tokens"] == ppl["tokens"]
    # independent: the same bytes, the model run with plain causal attention, windows of 128
    from fms_paged.data.stdlib_corpus import heldout_text

    model = load_model({"variant": "micro", "device": str(device)})
    ids = [b % 256 for b in heldout_text(1500)[:1500].encode("utf-8")]
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(ids), 128):
            w = torch.tensor(ids[i : i + 128], device=device)
            if len(w) < 2:
                continue
            logits = model(w[None])[0]
            total += F.cross_entropy(logits[:-1].double(), w[1:], reduction="sum").item()
            count += len(w) - 1
    assert count == ppl["tokens"]
    for impl in ("sdpa", "paged", "no-cache"):
        assert by[impl]["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_report_files(run):
    out, res, stdout = run
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(res["runs"]) == 27  # (4 + 4 + 1) plans x 3 backends
    key = lambda r: f"{r['scenario']}@{r['length']}/{r['attn_impl']}"
    first = next(r for r in res["runs"] if key(r) == rows[0]["run"])
    assert float(rows[0]["ttft_ms"]) == pytest.approx(first["ttft_ms"])
    assert "| scenario | length | backend |" in stdout and "against the dense cache" in stdout
    assert (out / "results.md").read_text() in stdout
    for png in ("latency_vs_length.png", "memory_vs_length.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    env = res["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] >= 1


def test_usage_errors_exit_2_with_one_line():
    from fms_paged.bench import cli

    for argv, name in ((["--attn-impl", "flash"], "--attn-impl"), (["--scenario", "decode"], "--scenario"),
                       (["--scenario", "serve,single"], "--scenario"),
                       (["--kernel", "flex-eager"], "--kernel")):
        proc = subprocess.run([sys.executable, "-m", "fms_paged.bench.cli", *argv], capture_output=True,
                              text=True, cwd=ROOT)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and name in lines[0], proc.stderr
    assert cli.build_parser().parse_args(["--compile", "false"]).compile is False


@pytest.mark.slow
def test_compiled_flex_step_matches_dense(tmp_path):
    from fms_paged.bench import cli

    argv = ["--variant", "micro", "--scale", "0.01", "--new-tokens", "4", "--kernel", "flex", "--compile",
            "true", "--attn-impl", "both", "--scenario", "single", "--no-memory", "--no-ppl",
            "--out", str(tmp_path / "c")]
    assert cli.main(argv) == 0
    res = json.loads((tmp_path / "c" / "results.json").read_text())
    assert {r["kernel"] for r in res["runs"] if r["attn_impl"] == "paged"} == {"flex"}
    assert all(c["outputs_match"] for c in res["compare"])
