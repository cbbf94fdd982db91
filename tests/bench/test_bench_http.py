"""`make bench-http` (benchmarks/http.py, http_report.py) without vLLM: argument checks, vLLM's
result JSON read back (one built here the way vLLM's `calculate_metrics` builds it, checked against
statistics computed independently), the /metrics deltas (Prometheus text made by prometheus_client
itself), the targets, the report, a server's start / health wait / stop (a stand-in server in the
stdlib), and the in-process run. One slow test runs the whole benchmark, tiny, against `fms-paged
serve` and vLLM's server with vLLM's client (skipped without .venv-vllm)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks import http, http_report
from fms_paged.models import default_model_path

DEFAULT_MODEL = default_model_path()
needs_default_model = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                         reason="the embedded default model is missing")


# ---------------------------------------------------------------- arguments
@needs_default_model
def test_defaults_fit_the_model_len_and_keep_vllm_first():
    args = http.parse_args(["--servers", "ours,vllm"])
    assert args.servers == ["vllm", "ours"]  # vLLM's saturation sets the rates
    assert args.rate_fractions == [0.5, 0.25]
    # the longest request: 256 prompt tokens + a BOS + 128 output tokens
    assert 256 + 1 + 128 <= args.max_model_len


@needs_default_model
@pytest.mark.parametrize("argv, words", [
    (["--servers", "ours,tgi"], "--servers ours,tgi"),
    (["--rate-fractions", "0.5,x"], "--rate-fractions"),
    (["--rate-fractions", "1.5"], "(0, 1)"),
    (["--range-ratio", "1"], "--range-ratio"),
    (["--num-prompts", "0"], "--num-prompts 0"),
    (["--max-model-len", "300"], "needs 385 tokens"),
    (["--vllm-env", "KMP_BLOCKTIME"], "expected KEY=VALUE"),
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        http.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and err.count("\n") == 1, err


def test_a_model_dir_without_config_or_tokenizer_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        http.parse_args(["--model-dir", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        http.parse_args(["--model-dir", str(tmp_path)])
    assert "no tokenizer.model or tokenizer.json" in capsys.readouterr().err


def _pairs(cmd: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a command line (flags without a value map to '')."""
    out, i = {}, 0
    while i < len(cmd):
        if cmd[i].startswith("--"):
            has_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
            out[cmd[i]] = cmd[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return out


@needs_default_model
def test_both_servers_get_the_same_settings(tmp_path):
    args = http.parse_args(["--dtype", "bfloat16", "--max-num-seqs", "8", "--page-size", "32"])
    ours = http.server_command("ours", args, 1234, tmp_path / "runner.py")
    vllm = http.server_command("vllm", args, 1234, tmp_path / "runner.py")
    assert ours[1:5] == ["-m", "fms_paged.cli", "serve", str(DEFAULT_MODEL)]
    assert vllm[1:4] == [str(tmp_path / "runner.py"), "server", str(http.REPO_ROOT / "scripts")]
    o, v = _pairs(ours), _pairs(vllm)
    shared = ["--host", "--port", "--served-model-name", "--dtype", "--max-num-seqs",
              "--max-num-batched-tokens", "--max-model-len", "--no-enable-prefix-caching"]
    assert {k: o[k] for k in shared} == {k: v[k] for k in shared}
    assert o["--dtype"] == "bfloat16" and o["--max-num-seqs"] == "8" and o["--port"] == "1234"
    assert o["--page-size"] == "32" and v["--model"] == str(DEFAULT_MODEL)
    assert json.loads(vllm[5]) == {}  # the runner's environment over the vLLM peer's: none


@needs_default_model
def test_vllm_env_reaches_the_runner(tmp_path):
    args = http.parse_args(["--vllm-env", "KMP_BLOCKTIME=0", "--vllm-env", "X=a=b"])
    cmd = http.server_command("vllm", args, 1234, tmp_path / "runner.py")
    assert json.loads(cmd[5]) == {"KMP_BLOCKTIME": "0", "X": "a=b"}
    assert "os.environ.update(json.loads(sys.argv[4]))" in http.VLLM_RUNNER  # argv[0] is the runner


@needs_default_model
def test_client_arguments(tmp_path):
    args = http.parse_args([])
    res = tmp_path / "raw" / "ours_1.json"
    sat = _pairs(http.client_args(args, "http://127.0.0.1:9", None, 400, res))
    slow = _pairs(http.client_args(args, "http://127.0.0.1:9", 1 / 3, 400, res))
    assert sat["--request-rate"] == "inf" and float(slow["--request-rate"]) == 1 / 3  # repr: exact
    assert sat["--dataset-name"] == "random" and sat["--backend"] == "openai"
    assert sat["--tokenizer"] == str(DEFAULT_MODEL) and sat["--model"] == DEFAULT_MODEL.name
    assert "--ignore-eos" in sat and sat["--temperature"] == "0" and "--save-detailed" in sat
    assert set(sat["--percentile-metrics"].split(",")) == {"ttft", "tpot", "itl", "e2el"}
    assert sat["--metric-percentiles"] == "50,99"
    assert (sat["--result-dir"], sat["--result-filename"]) == (str(res.parent), res.name)


# ---------------------------------------------------------------- vLLM's result JSON
def vllm_result(reqs: list[dict], duration: float) -> dict:
    """A result JSON as vllm/benchmarks/serve.py (0.32) writes it for `--percentile-metrics
    ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-detailed`: per request ttft, itl, latency
    (s) and output_tokens; TPOT = (latency - ttft) / (output_tokens - 1); ms, numpy statistics."""
    ttfts = [r["ttft"] for r in reqs]
    itls = [x for r in reqs for x in r["itl"]]
    tpots = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in reqs if r["output_tokens"] > 1]
    e2els = [r["latency"] for r in reqs]
    out_lens = [r["output_tokens"] for r in reqs]
    res = {"date": "20260101-000000", "backend": "openai", "num_prompts": len(reqs), "request_rate": "inf",
           "duration": duration, "completed": len(reqs), "failed": 0,
           "total_input_tokens": sum(r["prompt_len"] for r in reqs), "total_output_tokens": sum(out_lens),
           "request_throughput": len(reqs) / duration, "output_throughput": sum(out_lens) / duration,
           "input_lens": [r["prompt_len"] for r in reqs], "output_lens": out_lens, "ttfts": ttfts,
           "itls": [r["itl"] for r in reqs], "latencies": e2els}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res[f"mean_{name}_ms"] = np.mean(xs) * 1000
        res[f"median_{name}_ms"] = np.median(xs) * 1000
        res[f"std_{name}_ms"] = np.std(xs) * 1000
        res[f"p50_{name}_ms"] = np.percentile(xs, 50) * 1000
        res[f"p99_{name}_ms"] = np.percentile(xs, 99) * 1000
    return res


def _requests(n: int = 9) -> list[dict]:
    reqs = []
    for i in range(n):
        itl = [0.002 + 0.0001 * ((i * 7 + j) % 5) for j in range(3 + i % 4)]
        ttft = 0.01 * (1 + i % 3)
        reqs.append({"ttft": ttft, "itl": itl, "latency": ttft + sum(itl), "output_tokens": len(itl) + 1,
                     "prompt_len": 20 + i})
    return reqs


def test_summarize_reads_vllms_result_json():
    reqs = _requests()
    s = http.summarize(vllm_result(reqs, duration=2.0))
    ttfts, e2els = [r["ttft"] for r in reqs], [r["latency"] for r in reqs]
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * statistics.fmean(ttfts))
    assert s["ttft_ms"]["p50"] == pytest.approx(1000 * statistics.median(ttfts))
    assert s["e2el_ms"]["p50"] == pytest.approx(1000 * statistics.median(e2els))
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= 1000 * max(ttfts)
    itl = [x for r in reqs for x in r["itl"]]
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * statistics.fmean(itl))
    # TPOT: each request's decode time over its decoded tokens after the first
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in reqs]
    assert s["tpot_ms"]["p50"] == pytest.approx(1000 * statistics.median(tpot))
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert s["output_tok_s"] == pytest.approx(s["total_output_tokens"] / 2.0)
    assert s["request_throughput"] == pytest.approx(len(reqs) / 2.0)
    assert (s["completed"], s["failed"], s["duration_s"]) == (len(reqs), 0, 2.0)


# ---------------------------------------------------------------- /metrics deltas
class FakeServerMetrics:
    """The histograms and counters a server exports, under `prefix`, in a registry of their own."""

    def __init__(self, prefix: str, labels: dict[str, str]):
        r, names = CollectorRegistry(), list(labels)
        self.registry = r
        hist = lambda n: Histogram(prefix + n, n, names, registry=r).labels(**labels)
        self.ttft, self.e2e = hist("time_to_first_token_seconds"), hist("e2e_request_latency_seconds")
        self.itl = hist("inter_token_latency_seconds")
        self.gen = Counter(prefix + "generation_tokens", "g", names, registry=r).labels(**labels)
        self.prompt = Counter(prefix + "prompt_tokens", "p", names, registry=r).labels(**labels)

    def request(self, ttft: float, e2e: float, tokens: int, prompt: int) -> None:
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        self.gen.inc(tokens)
        self.prompt.inc(prompt)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


@pytest.mark.parametrize("kind, labels", [("ours", {"model_name": "m"}),
                                          ("vllm", {"model_name": "m", "engine": "0"})])
def test_engine_delta_is_the_mean_over_the_run_only(kind, labels):
    m = FakeServerMetrics(http.METRIC_PREFIX[kind], labels)
    m.request(ttft=5.0, e2e=9.0, tokens=100, prompt=50)  # before the run (the warm-up)
    before = http.engine_counters(m.text(), http.METRIC_PREFIX[kind])
    run = [(0.010, 0.50, 8, 30), (0.030, 0.70, 8, 31), (0.020, 0.60, 8, 29)]
    for ttft, e2e, tokens, prompt in run:
        m.request(ttft, e2e, tokens, prompt)
    d = http.engine_delta(before, http.engine_counters(m.text(), http.METRIC_PREFIX[kind]))
    assert d["requests"] == 3 and d["generation_tokens"] == 24 and d["prompt_tokens"] == 90
    assert d["ttft_mean_ms"] == pytest.approx(20.0) and d["e2el_mean_ms"] == pytest.approx(600.0)
    assert d["itl_mean_ms"] is None  # nothing observed


def test_engine_counters_sum_label_sets_and_ignore_other_prefixes():
    a, b = FakeServerMetrics("vllm:", {"engine": "0"}), FakeServerMetrics("vllm:", {"engine": "1"})
    other = FakeServerMetrics("fms_paged:", {"model_name": "m"})
    a.request(0.1, 1.0, 4, 10)
    b.request(0.3, 2.0, 6, 20)
    other.request(9.0, 9.0, 99, 99)
    c = http.engine_counters(a.text() + b.text() + other.text(), "vllm:")
    assert (c["ttft_count"], c["generation_tokens"], c["prompt_tokens"]) == (2, 10, 30)
    assert c["ttft_sum"] == pytest.approx(0.4)


def test_engine_delta_without_metrics_is_all_none():
    assert set(http.engine_delta(None, {}).values()) == {None}


# ---------------------------------------------------------------- targets and the report
def _run(tok_s: float, ttft_p50: float, delay: float | None, req_s: float = 10.0) -> dict:
    ms = {"mean": ttft_p50, "p50": ttft_p50, "p99": 2 * ttft_p50}
    return {"rate": None, "completed": 4, "failed": 0, "duration_s": 1.0, "request_throughput": req_s,
            "output_tok_s": tok_s, "total_input_tokens": 100, "total_output_tokens": 40, "ttft_ms": ms,
            "tpot_ms": ms, "itl_ms": ms, "e2el_ms": ms, "first_byte_delay_ms": delay,
            "engine": {"requests": 4, "generation_tokens": 40, "prompt_tokens": 100, "ttft_mean_ms": 1.0,
                       "e2el_mean_ms": 2.0, "itl_mean_ms": 0.5}}


def _res(inprocess: dict | None = None) -> dict:
    return {"servers": {
        "vllm": {"runs": {"saturation": _run(1000, 50, 1.0, 20), "0.5x saturation": _run(500, 10, 1.0, 10)}},
        "ours": {"runs": {"saturation": _run(1100, 60, 4.0, 22), "0.5x saturation": _run(500, 12, 6.0, 9)}}},
        "inprocess": inprocess or {"output_tok_s": 1300.0, "request_throughput": 25.0,
                                   "output_tok_s_runs": [1290.0, 1300.0, 1310.0], "warmup_s": 1.0}}


def test_targets_met_missed_and_not_measured():
    t = {x["target"].split(" at ")[0].split(" (")[0]: x for x in http_report.evaluate_targets(_res())}
    thr, ttft = t["fms-paged / vLLM output tok/s"], t["fms-paged / vLLM TTFT p50"]
    assert thr["value"] == pytest.approx(1.1) and thr["met"] is True
    assert ttft["value"] == pytest.approx(1.2) and ttft["met"] is False
    assert t["HTTP / in-process output tok/s"]["value"] == pytest.approx(1100 / 1300)
    assert t["HTTP / in-process output tok/s"]["met"] is False  # 0.846 < 0.90
    delay = t["first-byte delay"]
    assert delay["value"] == 6.0 and delay["met"] is False
    assert delay["per_load_ms"] == {"saturation": 4.0, "0.5x saturation": 6.0}
    alone = {"servers": {"ours": _res()["servers"]["ours"]}, "inprocess": {"error": "boom"}}
    met = [x["met"] for x in http_report.evaluate_targets(alone)]
    assert met == [None, None, None, False]


def test_report_files(tmp_path):
    res = {**_res(), "config": {"model_dir": "m", "dtype": "float32", "num_prompts": 4, "input_len": 8,
                                "output_len": 4, "range_ratio": 0.33, "max_num_seqs": 4,
                                "max_num_batched_tokens": 64, "max_model_len": 64},
           "environment": {"cpu_model": "Some CPU", "cpu_count": 2, "time": "2026-01-01T00:00:00+0000",
                           "torch": "2.x", "vllm": "0.32.0", "fastapi": "1", "uvicorn": "2"},
           "rates": {"basis": "0.5 x vLLM's saturation rate (20.00 req/s)"}}
    res["servers"]["ours"]["error"] = "ServerError: it stopped\nlog tail"
    res["targets"] = http_report.evaluate_targets(res)
    md = http_report.markdown(res)
    assert md.count("| vLLM |") == 2 and md.count("| fms-paged |") == 2
    assert "Some CPU (2 cores), 2026-01-01" in md and "vLLM 0.32.0" in md
    assert "| MISSED |" in md and "| met |" in md and "(saturation 4.0, 0.5x saturation 6.0)" in md
    assert "- fms-paged: ServerError: it stopped" in md and "1300 output tok/s" in md
    paths = http.write_report(tmp_path, res, markdown=md, rows=http_report.rows(res),
                              figures=http_report.figures(res))
    assert paths["http.png"].stat().st_size > 0
    csv = (tmp_path / "results.csv").read_text()
    assert "ours/0.5x saturation" in csv and "engine_ttft_mean_ms" in csv
    assert json.loads((tmp_path / "results.json").read_text())["targets"][0]["met"] is True


# ---------------------------------------------------------------- a server's life
STANDIN = """\
import http.server, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
mode, ready_after, calls = sys.argv[1], int(sys.argv[2]), [0]
if mode == "exit":
    sys.exit("boom: bad checkpoint")
# a Ctrl-C stops it, as it stops a server, even where this process was started with SIGINT ignored
# (a background job of a non-interactive shell: Python then installs no handler of its own)
signal.signal(signal.SIGINT, signal.SIG_IGN if mode == "stubborn" else signal.default_int_handler)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        calls[0] += 1
        self.send_response(200 if calls[0] > ready_after else 503)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
print("stand-in listening", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _standin(tmp_path: Path, mode: str, ready_after: int = 0) -> list[str]:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    return [sys.executable, str(script), mode, str(ready_after), "--port", str(http.free_port())]


def _closed(base: str) -> bool:
    try:
        http.http_get(base + "/health", timeout=1)
    except OSError:
        return True
    return False


def test_serving_waits_for_health_then_stops_the_server(tmp_path):
    cmd = _standin(tmp_path, "normal", ready_after=3)
    with http.serving(cmd, tmp_path / "s.log", timeout=30) as (base, t):
        assert t > 0 and http.http_get(base + "/health") == (200, "ok")
    assert _closed(base)


def test_a_server_that_exits_reports_its_log_tail(tmp_path):
    with pytest.raises(http.ServerError, match="(?s)exited with code 1 before /health.*boom: bad checkpoint"):
        with http.serving(_standin(tmp_path, "exit"), tmp_path / "s.log", timeout=30):
            pass


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path):
    cmd = _standin(tmp_path, "normal", ready_after=10**6)
    base = f"http://127.0.0.1:{cmd[-1]}"
    with pytest.raises(http.ServerError, match="(?s)not 200 after 1 s.*stand-in listening"):
        with http.serving(cmd, tmp_path / "s.log", timeout=1):
            pass
    assert _closed(base)


def test_a_server_ignoring_sigint_is_killed(tmp_path):
    t0 = time.monotonic()
    with http.serving(_standin(tmp_path, "stubborn"), tmp_path / "s.log", timeout=30, grace=1) as (base, _):
        pass
    assert _closed(base) and time.monotonic() - t0 < 20


def test_a_failed_client_run_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(http, "VLLM_PYTHON", Path(sys.executable))
    runner = tmp_path / "runner.py"
    runner.write_text("import sys\n"
                      "print('client: no server at', sys.argv[sys.argv.index('--base-url') + 1])\n"
                      "sys.exit(3)\n")
    args = SimpleNamespace(model_dir=DEFAULT_MODEL, seed=0, input_len=8, output_len=4, range_ratio=0.0,
                           client_timeout=30)
    with pytest.raises(http.ServerError, match="(?s)client ended with 3.*no server at http://127.0.0.1:9"):
        http.run_client(args, "http://127.0.0.1:9", None, 2, tmp_path / "r.json", runner)


# ---------------------------------------------------------------- in-process
@needs_default_model
def test_inprocess_runs_the_job_and_counts_its_tokens(tmp_path):
    job = {"model_dir": str(DEFAULT_MODEL), "dtype": "float32", "page_size": 16, "max_num_seqs": 2,
           "max_num_batched_tokens": 32, "max_model_len": 64, "compile": False, "seed": 0, "repeats": 2,
           "prompt_lens": [5, 17, 9], "output_lens": [3, 1, 6]}
    src, dst = tmp_path / "job.json", tmp_path / "out.json"
    src.write_text(json.dumps(job))
    assert http.main(["--inprocess", str(src), str(dst)]) == 0
    out = json.loads(dst.read_text())
    assert out["output_tokens"] == 10 and out["requests"] == 3 and len(out["output_tok_s_runs"]) == 2
    assert out["output_tok_s"] == pytest.approx(10 / out["duration_s"]) and out["warmup_s"] == 0.0


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
@needs_default_model
@pytest.mark.skipif(not http.VLLM_PYTHON.exists(), reason=f"{http.VLLM_PYTHON} missing: `make peer-vllm`")
def test_tiny_run_against_both_servers(tmp_path):
    out = tmp_path / "bench-http"
    rc = http.main(["--num-prompts", "6", "--input-len", "24", "--output-len", "8", "--rate-fractions", "0.5",
                    "--warmup-prompts", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
                    "--max-model-len", "64", "--inprocess-repeats", "1", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert rc == 0, {k: s.get("error") for k, s in res["servers"].items()}
    rates = res["rates"]["req_s"]
    assert rates == [pytest.approx(0.5 * res["servers"]["vllm"]["runs"]["saturation"]["request_throughput"])]
    for kind in ("vllm", "ours"):
        runs = res["servers"][kind]["runs"]
        assert list(runs) == ["saturation", "0.5x saturation"] and runs["0.5x saturation"]["rate"] == rates[0]
        for r in runs.values():
            assert (r["completed"], r["failed"]) == (6, 0)
            assert r["total_output_tokens"] == sum(r["output_lens"])
            assert all(5 <= n <= 11 for n in r["output_lens"])  # 8 +- 33%
            e = r["engine"]  # the server's own counters agree with what the client received
            assert e["requests"] == 6 and e["generation_tokens"] == r["total_output_tokens"]
            assert e["prompt_tokens"] == r["total_input_tokens"]
            assert 0 < e["ttft_mean_ms"] <= r["ttft_ms"]["mean"] and e["e2el_mean_ms"] <= r["e2el_ms"]["mean"]
            assert 0 <= r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2el_ms"]["p99"]
    ours = res["servers"]["ours"]["runs"]["saturation"]
    assert res["inprocess"]["output_tokens"] == ours["total_output_tokens"]
    assert [t["met"] is not None for t in res["targets"]] == [True] * 4
    assert (out / "http.png").stat().st_size > 0
    assert "| fms-paged | saturation |" in (out / "results.md").read_text()
