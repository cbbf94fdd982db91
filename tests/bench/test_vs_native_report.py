"""bench-native's reading of one-request rates per GB/s of each process's own read bandwidth
(`vs_native_report.per_bandwidth`): each side's best rate per GB/s, which need not be its best
tok/s, and no rate for a run that did not read its bandwidth."""

from fms_paged.bench.vs_native import ENGINE, ONE_REQUEST
from fms_paged.bench.vs_native_report import markdown, per_bandwidth, targets


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
