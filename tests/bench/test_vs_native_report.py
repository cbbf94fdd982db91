"""bench-native's reading of one-request rates per GB/s of each process's own read bandwidth
(`vs_native_report.per_bandwidth`): each side's best rate per GB/s, which need not be its best
tok/s, and no rate for a run that did not read its bandwidth."""

import pytest

from benchmarks.vs_native import pool_processes
from benchmarks.vs_native_cases import ENGINE, ONE_REQUEST
from benchmarks.vs_native_engine import step_anatomy
from benchmarks.vs_native_report import markdown, per_bandwidth, roofline_shares, targets
from fms_paged import Engine, get_model, native


def run(tok_s: float, gbs: float | None) -> dict:
    r = {"output_tok_s": tok_s}
    if gbs is not None:
        r["process_read_gbs"] = gbs
    return r


def test_per_bandwidth_compares_each_sides_best_rate_per_gbs():
    res = {
        "environment": {"cpu_model": "cpu", "cpu_count": 2, "time": "2026-11-26T00:00"},
        "repeats": 3,
        "read_bandwidth_gbs": 40.0,
        "workloads": {ONE_REQUEST: {
            # bf16 is the faster run, fp16 the better one per GB/s (its process read more slowly)
            ENGINE: {"bfloat16": run(150.0, 75.0), "float16": run(120.0, 40.0), "float32": run(90.0, None)},
            "llama.cpp": {"bfloat16": run(130.0, 50.0), "float16": run(100.0, 45.0)},
        }},
    }
    got = per_bandwidth(res)
    assert got["ours"] == ("float16", 120.0 / 40.0)
    assert got["best_peer"] == ("llama.cpp", "bfloat16", 130.0 / 50.0)
    assert got["ratio"] == (120.0 / 40.0) / (130.0 / 50.0)
    assert "float32" not in got["tok_s_per_gbs"][ENGINE]  # no bandwidth read: no rate
    res["one_request_per_gbs"], res["targets"] = got, targets(res)
    assert "One request per GB/s read in each system's own process: 1.15x" in markdown(res)


def test_pool_processes_takes_the_median_of_every_rounds_runs():
    """A system's processes (one a round) -> the median of all their timed runs, the other figures
    from the process whose own median is nearest it, each process kept; a failed process fails
    the system's result rather than leaving it to the others."""
    def proc(rates, start, gbs):
        rates = sorted(rates)
        return {"output_tok_s": rates[len(rates) // 2], "output_tok_s_runs": rates, "start_s": start,
                "read_bandwidth_gbs": gbs, "tokens": [[1, 2]], "tokens_equal_runs": True}

    slow, fast = proc([90.0, 100.0, 95.0], 1.0, 48.0), proc([120.0, 118.0, 121.0], 2.0, 78.0)
    got = pool_processes([slow, fast])
    assert got["output_tok_s"] == (100.0 + 118.0) / 2  # runs 90 95 100 | 118 120 121
    assert sorted(got["output_tok_s_runs"]) == [90.0, 95.0, 100.0, 118.0, 120.0, 121.0]
    assert got["read_bandwidth_gbs"] == 78.0 and got["start_s"] == 2.0  # 120 is nearer 109 than 95 is
    assert [p["output_tok_s"] for p in got["processes"]] == [95.0, 120.0] and got["tokens_equal_runs"]
    assert not pool_processes([slow, dict(fast, tokens=[[1, 3]])])["tokens_equal_runs"]
    assert pool_processes([slow, {"error": "exit 1"}]) == {"error": "exit 1"}


def test_roofline_share_is_each_processes_own_and_the_target_takes_their_median():
    """Each one-request process's decode over the roofline of the bandwidth it read itself; the
    target compares a dtype's median share, and lists each process's where there are several."""
    one = {"decode_steps_s": 80.0, "read_bandwidth_gbs": 50.0}
    res = {
        "repeats": 3, "rounds": 2, "roofline_bytes_per_step": {"bfloat16": 5e8},
        "workloads": {ONE_REQUEST: {ENGINE: {"bfloat16": {
            **one, "output_tok_s": 80.0,
            "processes": [one, {"decode_steps_s": 120.0, "read_bandwidth_gbs": 80.0}]}}}},
    }
    assert roofline_shares(res) == {"bfloat16": [(0.8, 50.0), (0.75, 80.0)]}  # 80/100, 120/160
    (row,) = [r for r in targets(res) if "roofline" in r["target"]]
    assert row["measured"] == "bfloat16 78% (80% at 50 GB/s, 75% at 80 GB/s)" and row["met"] == "no"


@pytest.mark.skipif(not hasattr(native, "kernel_clock"), reason="needs the library's native.kernel_clock")
def test_step_anatomy_times_the_decode_steps_through_the_public_hooks():
    """bench-native's step anatomy on a micro model: one-request decode steps timed whole, their
    forwards through the runner's `forward_hook` and their C++ time through `native.kernel_clock`;
    the hook is unset and the engine's lookahead restored afterwards."""
    eng = Engine(get_model(variant="micro", attn_impl="paged", device="cpu"), max_num_seqs=2,
                 max_num_batched_tokens=64, compile=False, decode_steps=4)
    a = step_anatomy(eng, {"prompt": list(range(3, 19)), "max_new_tokens": 6})
    assert 0 < a["forward"] <= a["step"] and 0 <= a["kernels"] <= a["step"]
    assert a["host"] == pytest.approx(a["step"] - a["kernels"])
    assert a["host_outside_forward"] == pytest.approx(a["step"] - a["forward"])
    assert eng.runner.forward_hook is None and eng.decode_steps == 4 and not eng.has_unfinished()
