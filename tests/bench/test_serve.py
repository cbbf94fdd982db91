"""`make bench-serve` on a tiny run: every figure is written and consistent with the requests sent,
and a peer in its own process (dense static waves) gives the engine's greedy tokens. The engine runs
on the test device (`--device`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import peers, vs_vllm
from fms_paged import generate, get_model
from fms_paged.bench import cli, serve
from fms_paged.models.hf import save_hf_llama


def test_tiny_serve_run_is_consistent(tmp_path, device):
    out = tmp_path / "serve"
    rc = cli.main(["--scenario", "serve", "--variant", "micro", "--workloads",
                   "mix,shared_prefix,multi_turn,parallel", "--scale", "0.03", "--prefix-scale", "0.05",
                   "--prefix-requests", "8", "--num-requests", "6", "--rate-fractions", "0.5",
                   "--max-num-seqs", "4", "--page-size", "16", "--max-num-batched-tokens", "128",
                   "--max-model-len", "512", "--compile", "false", "--device", str(device),
                   "--peers", "dense", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert md.count("| mix |") == 2 and "Wall time of each part" in md
    assert (out / "serve_timeline.png").stat().st_size > 0 and (out / "serve_rate.png").exists()
    assert (out / "results.csv").read_text().count("\nmix/") == 2
    vocab = 256
    w = res["workloads"]
    sent = {  # requests (completions) and output tokens each run must account for
        "mix": serve.workload("mix", 0.03, vocab, 0, 6),
        "shared_prefix": serve.workload("shared_prefix", 0.05, vocab, 0, 8),
        "multi_turn": serve.workload("multi_turn", 0.03, vocab, 0),
    }
    for name, specs in sent.items():
        turns = [1 + len(s.next_turns) for s in specs]
        for run, r in w[name].items():
            if not isinstance(r, dict) or "completed" not in r:
                continue
            assert r["completed"] == sum(turns) and r["failed"] == 0, (name, run)
            expect = sum(s.max_new_tokens * t for s, t in zip(specs, turns))
            assert r["output_tokens"] == expect == sum(map(len, r["tokens"])), (name, run)
            for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
                assert 0 <= r[key]["p50"] <= r[key]["p99"], (name, run, key)
            assert r["ttft_s"]["p99"] <= r["e2el_s"]["p99"]
            assert r["output_tok_s"] <= r["total_tok_s"]
            assert 0 < r["peak_kv_pages"] <= r["kv_pages_total"]
        assert w[name]["tokens_equal"], name
    assert w["mix"]["alone"]["count"] == 6
    assert [r["rate"] for r in w["mix"].values() if isinstance(r, dict) and "rate" in r] == [
        None, 0.5 * w["mix"]["offline"]["request_throughput"]]
    mt, sp, par = w["multi_turn"], w["shared_prefix"], w["parallel"]
    assert mt["cache on"]["prompt_tokens_computed"] < mt["cache off"]["prompt_tokens_computed"]
    assert mt["cache off"]["prompt_tokens_computed"] >= mt["new_prompt_tokens"]
    assert sp["cache on"]["prefix_cache_hits"] > 0 and "prefix_cache_hits" not in sp["cache off"]
    assert sp["cache on"]["peak_prefix_pages"] < sp["cache off"]["peak_prefix_pages"]
    assert par["n=8"]["completed"] == par["8 separate"]["completed"] == 8
    assert par["n=8"]["prompt_tokens_computed"] < par["8 separate"]["prompt_tokens_computed"]
    assert par["tokens_equal"]
    assert set(res["phase_s"]) == {"warm-up", "mix", "shared_prefix", "multi_turn", "parallel", "peers"}
    assert all(t >= 0 for t in res["phase_s"].values())
    dense = res["peers"]["dense"]  # static waves, in a process of its own: the same greedy tokens
    assert dense["output_tokens"] == w["mix"]["offline"]["output_tokens"]
    assert "- peer dense, offline mix: " in md and "greedy tokens equal" in md
    assert dense["tokens_equal_engine"]  # on the engine's device


def test_capacity_counts_requests_running_at_once(device):
    """The engine under a dense cache's KV budget runs more requests at once than the dense cache
    has rows (these requests are far shorter than max_len), and finishes all of them."""
    model = get_model(variant="micro", device=device, seed=0, attn_impl="paged")
    args = SimpleNamespace(scale=0.05, seed=0, max_num_batched_tokens=256)
    c = serve.capacity(model, args, 2048)
    assert c["dense_concurrency"] == 4 and c["kv_budget_bytes"] == 4 * 2048 * 2 * 2 * 2 * 16 * 4
    assert c["completed"] == c["requests"] and 4 < c["engine_peak_running"] <= c["requests"]
    assert c["ratio"] == c["engine_peak_running"] / 4


def test_engine_offline_runs_account_for_every_token(device):
    """The engine side of the vLLM comparison (`offline_engine`, `offline_runs`, `median_run`):
    every request makes its tokens (dense generate()'s greedy tokens), the median run is reported
    with every run's rate, and the one-request decode rate is a rate; the table says when vLLM did
    not run."""
    dense = get_model(variant="micro", device=device, seed=0)
    paged = get_model(variant="micro", device=device, seed=0, attn_impl="paged")
    prompts = [[5, 6, 7], list(range(3, 40))]
    eng, warm = peers.offline_engine(paged, 4, 64, False, 64)
    runs = vs_vllm.offline_runs(eng, prompts, 6, 3) + vs_vllm.offline_runs(eng, prompts, 6, 2)
    e = {"compile": False, "warmup_s": warm, **vs_vllm.median_run(runs)}
    assert e["tokens"] == [generate(dense, [p], 6, eos_id=None)[0] for p in prompts]
    assert e["tokens_equal_runs"] and len(e["output_tok_s_runs"]) == 5
    assert e["output_tok_s"] == sorted(e["output_tok_s_runs"])[2] == 2 * 6 / e["duration_s"]
    assert e["decode_steps_s"] > 0
    vs = {"read_bandwidth_gbs": 20.0, "workloads": {"w": {"bfloat16": {
        "roofline_steps_s": 100.0, "engine": e, "vllm": {"error": "no venv\nnot found"}}}}}
    table = "\n".join(vs_vllm.vs_vllm_markdown(vs))
    assert "| w | bfloat16 | engine compile=False | " in table
    assert "| w | bfloat16 | vLLM CPU | did not run: not found" in table


def test_vs_vllm_targets_are_judged_from_the_runs():
    """Each half-precision target is reported with what was measured: ratios of the engine's bf16
    rate to vLLM's bf16 rate, the one-request decode's share of its roofline, and the warm starts."""
    def run(tok_s, tokens, steps=None):
        return {"output_tok_s": tok_s, "tokens": tokens, "decode_steps_s": steps}

    one, many = [[1] * 4], [[1] * 4, [2] * 4]
    vs = {"workloads": {
        "decode": {"bfloat16": {"roofline_steps_s": 100.0, "engine": run(150.0, one, 85.0),
                                "vllm": run(100.0, one)}},
        vs_vllm.DEFAULT_WORKLOAD: {"bfloat16": {"roofline_steps_s": 10.0, "engine": run(90.0, many),
                                                "vllm": run(100.0, many)}}},
        "warm_start_s": {"bfloat16": {"start_s": 11.0}, "float32": {"start_s": 10.0}}}
    got = {r["target"].split(" (")[0]: (r["measured"], r["met"]) for r in vs_vllm.vs_vllm_targets(vs)}
    assert got["bf16 output tok/s >= 1.0x vLLM bf16 on every workload"] == ("1.50x, 0.90x", "no")
    assert got["bf16 >= 1.3x vLLM bf16 on the decode workloads"] == ("1.50x", "yes")
    assert got["one-request bf16 decode >= 80% of the read roofline"] == ("85%", "yes")
    assert got["bf16 engine's warm start <= 1.2x fp32's"] == ("1.10x", "yes")


def test_warm_start_job_times_each_part_of_a_start(tmp_path):
    """`python -m benchmarks.peers warm`: a checkpoint loaded in the job's dtype, its engine built
    and warmed up, each part timed, the parts adding up to the start."""
    save_hf_llama(get_model(variant="micro", seed=0), tmp_path / "ckpt")
    job = {"model_path": str(tmp_path / "ckpt"), "dtype": "bfloat16", "device": "cpu", "max_num_seqs": 2,
           "max_num_batched_tokens": 32, "max_model_len": 64, "compile": False, "requests": []}
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert peers.peer_main("warm", str(tmp_path / "job.json"), str(tmp_path / "out.json")) == 0
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["kernel"] == "cpp" and min(got["load_s"], got["engine_s"], got["warmup_s"]) >= 0
    assert abs(got["load_s"] + got["engine_s"] + got["warmup_s"] - got["start_s"]) < 1e-6


def test_peer_workloads_come_from_the_checkout_and_a_wheel_without_them_says_so(monkeypatch):
    """The peer drivers (`benchmarks/`, not in the wheel) back `vs_vllm`, `vs_native` and `--peers`:
    from the checkout they are the defaults and import as themselves; where they are absent (an
    installed wheel, simulated by a package name nothing provides) the defaults leave them out and
    asking for one exits, before any engine runs, with where they live and the checkout's command."""
    assert serve.peer_driver("peers") is peers and serve.peer_driver("vs_vllm") is vs_vllm
    assert serve.default_workloads().split(",")[-2:] == ["vs_vllm", "vs_native"]
    assert serve.default_peers() == ["dense", "hf", "vllm"]
    monkeypatch.setattr(serve, "PEER_DRIVERS", "fms_paged_test_absent_drivers")
    assert serve.default_workloads() == "mix,shared_prefix,multi_turn,parallel,capacity"
    assert serve.default_peers() == []
    args = SimpleNamespace(workloads="mix,vs_vllm", peers=[])
    with pytest.raises(SystemExit, match=r"vs_vllm .*make bench-serve"):
        serve.run(args, model=None, spec={}, res={})
    with pytest.raises(SystemExit, match=r"peers .*make bench-serve"):
        serve.run(SimpleNamespace(workloads="mix", peers=["dense"]), model=None, spec={}, res={})
