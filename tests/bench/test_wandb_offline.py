"""`--wandb` without an API key: an offline run directory under the results folder holding the
logged metrics (read back from the run's own log file); without wandb installed: a clear error.
(wandb is optional: the offline run skips where it is not installed.)"""

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from fms_paged.bench import cli


def read_offline_history(run_dir: Path) -> dict:
    """Logged history values {key: value} of an offline run, read back from its `*.wandb` file (a
    LevelDB-style log of protobuf records: 7-byte file header, 32 KiB blocks, records with a
    crc32/length/type header, FULL=1 or FIRST/MIDDLE/LAST=2/3/4 fragments)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("*.wandb")
    buf, block, pos = path.read_bytes(), 32768, 7
    records, cur = [], b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        data, pos = buf[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:  # zero padding (a block the writer has not filled): next block
            pos += left - 7
            continue
        if kind == 1:
            records.append(data)
        elif kind == 2:
            cur = data
        elif kind == 3:
            cur += data
        elif kind == 4:
            records.append(cur + data)
    history = {}
    for data in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                history[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history


def test_offline_run_holds_the_logged_metrics(tmp_path, monkeypatch, device):
    pytest.importorskip("wandb", reason="wandb (the bench extra) is not installed")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key either
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    argv = ["--variant", "micro", "--scale", "0.005", "--new-tokens", "5", "--attn-impl", "both",
            "--scenario", "single", "--no-memory", "--no-ppl", "--wandb", "--device", str(device),
            "--out", str(out)]
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["wandb"]["mode"] == "offline"
    runs = list((out / "wandb_runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    keys = [f"single@{r['length']}/{r['attn_impl']}/tokens_generated" for r in res["runs"]]
    for _ in range(50):  # wandb's own process writes the log: wait (up to 10 s) for its last record
        history = read_offline_history(runs[0])
        if all(k in history for k in keys):
            break
        time.sleep(0.2)
    for r in res["runs"]:
        key = f"single@{r['length']}/{r['attn_impl']}"
        assert history[f"{key}/tokens_generated"] == r["tokens_generated"] == 5
        assert history[f"{key}/kv_waste_pct"] == pytest.approx(r["kv"]["kv_waste_pct"])
        assert history[f"{key}/per_token_p50_ms"] == pytest.approx(r["per_token"]["p50_ms"])
    assert res["wandb"]["metrics_logged"] >= 30


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    rc = cli.main(["--variant", "micro", "--wandb", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "wandb" in capsys.readouterr().err and not (tmp_path / "x").exists()
