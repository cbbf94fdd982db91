"""The benchmark script at a tiny scale on the micro model: every scenario runs and the JSON's figures
are internally consistent and agree with independent recomputations."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fms_paged.bench.latency import load_model
from fms_paged.bench.memory import measure_peak

ROOT = Path(__file__).resolve().parents[2]
NEW = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "benchmark_inference.py"),
        "--variant",
        "micro",
        "--scale",
        "0.01",
        "--new-tokens",
        str(NEW),
        "--warmup",
        "1",
        "--no-compile",
        "--scenario",
        "all,decode",
        "--decode-steps",
        "3",
        "--no-memory",
        "--ppl-chars",
        "1500",
        "--ppl-window",
        "128",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**__import__("os").environ, "TQDM_DISABLE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def test_counts_and_rates_are_consistent(run):
    _, res, _ = run
    for name, by in res["scenarios"].items():
        plan = res["plans"][name]
        turns = len(plan.get("turns", [None]))
        for r in by.values():
            B = len(plan["prompt_lengths"]) if name != "chat" else 1
            assert r["batch"] == B
            assert r["tokens_generated"] == sum(len(o) for o in r["outputs"]) == B * NEW * turns
            assert r["decode_steps"] == (NEW - 1) * turns
            assert r["per_token"]["n"] == (NEW - 1 - 1) * turns  # one warm-up step left out per turn
            assert r["tokens_per_s"] == pytest.approx(
                r["tokens_generated"] / (r["prefill_s"] + r["decode_s"])
            )
            p = r["per_token"]
            assert p["p50_ms"] <= p["p90_ms"] and p["mean_ms"] > 0
            # tokens in the cache at the end: every prompt + all generated tokens but the last
            stored = (
                (sum(plan["turns"]) + turns * NEW - 1)
                if name == "chat"
                else sum(plan["prompt_lengths"]) + B * (NEW - 1)
            )
            assert r["kv"]["tokens_stored"] == sum(r["final_lengths"]) == stored


def test_kv_waste_matches_an_independent_computation(run):
    _, res, _ = run
    c = res["model"]["config"]
    per_token = 2 * c["nlayers"] * c["kvheads"] * c["head_dim"] * 4  # fp32
    P = c["page_size"]
    for name, by in res["scenarios"].items():
        lens = by["paged"]["final_lengths"]
        needed = per_token * sum(lens)
        paged_held = per_token * P * sum(math.ceil(n / P) for n in lens)
        dense_held = per_token * len(lens) * (max(lens) + 1)  # rows preallocated to the longest
        for impl, held in (("paged", paged_held), ("sdpa", dense_held)):
            kv = by[impl]["kv"]
            assert kv["kv_bytes_needed"] == needed
            assert kv["kv_bytes_held"] == held, (name, impl)
            assert kv["kv_waste_pct"] == pytest.approx(100 * (held - needed) / held)
        cmp = res["compare"][name]
        assert cmp["kv_held"] == pytest.approx(paged_held / dense_held)
        assert cmp["outputs_match"] is True  # greedy tokens identical on both backends
    mixed = res["scenarios"]["mixed"]
    assert mixed["paged"]["kv"]["kv_waste_pct"] < mixed["sdpa"]["kv"]["kv_waste_pct"]


def test_perplexity_agrees_across_backends_and_with_no_cache(run):
    _, res, _ = run
    ppl = res["perplexity"]
    by = ppl["by_backend"]
    assert abs(by["paged"]["ppl"] - by["sdpa"]["ppl"]) / by["sdpa"]["ppl"] <= 1e-5
    assert by["paged"]["tokens"] == by["sdpa"]["tokens"] == ppl["tokens"]
    # independent: the same bytes, the model run with plain causal attention, windows of 128
    from fms_paged.data.stdlib_corpus import heldout_text

    model = load_model({"variant": "micro", "device": "cpu"})
    ids = [b % 256 for b in heldout_text(1500)[:1500].encode("utf-8")]
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(ids), 128):
            w = torch.tensor(ids[i : i + 128])
            if len(w) < 2:
                continue
            logits = model(w[None])[0]
            total += F.cross_entropy(logits[:-1].double(), w[1:], reduction="sum").item()
            count += len(w) - 1
    assert count == ppl["tokens"]
    for impl in ("sdpa", "paged", "no-cache"):
        assert by[impl]["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_decode_rows_and_report_files(run):
    out, res, stdout = run
    rows = res["decode"]
    assert {(r["mode"], r["case"], r["batch"]) for r in rows} == {
        (m, c, b) for m in ("eager", "compiled") for c, b in (("single", 1), ("mixed", 8))
    }
    for r in rows:
        assert r["ratio_paged_dense"] == pytest.approx(r["paged_ms"] / r["dense_ms"])
        lo, mid, hi = r["ratio_quartiles"]  # of the 3 paired step ratios
        assert r["steps"] == 3 and 0 < lo <= mid <= hi
        assert 0 < r["paged_meta_share"] < 1
    with (out / "results.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 6
    first = res["scenarios"][csv_rows[0]["scenario"]][csv_rows[0]["attn_impl"]]
    assert float(csv_rows[0]["ttft_ms"]) == pytest.approx(first["ttft_ms"])
    assert "| scenario | backend |" in stdout and "paged/dense" in stdout
    for png in ("latency_vs_length.png", "memory_vs_length.png", "kv_held_vs_needed.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    env = res["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] >= 1 and res["bandwidth_gbs"] > 0


def test_peak_memory_subprocess_reports_rss_and_kv():
    plan = {"name": "single", "scale": 1.0, "new_tokens": 3, "prompt_lengths": [40]}
    cfg = {
        "model": {"variant": "micro", "device": "cpu", "page_size": 16},
        "attn_impl": "paged",
        "kernel": "gather",
        "plan": plan,
    }
    m = measure_peak(cfg, torch.device("cpu"), timeout=120)
    assert "error" not in m, m
    assert 0 < m["rss_before_load_bytes"] <= m["rss_after_load_bytes"] <= m["rss_after_run_bytes"]
    assert m["peak_bytes"] == m["rss_after_run_bytes"]
    assert m["kv"]["tokens_stored"] == 42 and m["kv"]["pages_held"] == math.ceil(42 / 16)


@pytest.mark.slow
def test_compiled_paged_matches_dense(tmp_path):
    from fms_paged.bench import cli

    out = tmp_path / "c"
    argv = [
        "--variant",
        "micro",
        "--scale",
        "0.01",
        "--new-tokens",
        "4",
        "--compile",
        "--scenario",
        "single",
        "--no-memory",
        "--no-ppl",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["scenarios"]["single"]["paged"]["kernel"] == "flex"
    assert res["compare"]["single"]["outputs_match"] is True
