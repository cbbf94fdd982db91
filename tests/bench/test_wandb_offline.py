"""`--wandb` without an API key: an offline run directory under the results folder holding the
logged metrics (read back from the run's own log file); without wandb installed: a clear error."""

import json
import sys

import pytest

from fms_paged.bench import cli
from fms_paged.bench.wandb_log import read_offline_history


def test_offline_run_holds_the_logged_metrics(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key either
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    argv = [
        "--variant",
        "micro",
        "--scale",
        "0.005",
        "--new-tokens",
        "5",
        "--no-compile",
        "--scenario",
        "single",
        "--no-memory",
        "--no-ppl",
        "--wandb",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["wandb"]["mode"] == "offline"
    runs = list((out / "wandb_runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    history = read_offline_history(runs[0])
    for impl in ("sdpa", "paged"):
        r = res["scenarios"]["single"][impl]
        assert history[f"single/{impl}/tokens_generated"] == r["tokens_generated"] == 5
        assert history[f"single/{impl}/kv_waste_pct"] == pytest.approx(r["kv"]["kv_waste_pct"])
        assert history[f"single/{impl}/per_token_mean_ms"] == pytest.approx(r["per_token"]["mean_ms"])
    assert history["single/paged_over_dense/kv_held"] == pytest.approx(res["compare"]["single"]["kv_held"])
    assert res["wandb"]["metrics_logged"] >= 30


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    rc = cli.main(["--variant", "micro", "--wandb", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "wandb" in capsys.readouterr().err and not (tmp_path / "x").exists()
