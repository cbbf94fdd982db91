"""`make bench-structured` (fms_paged/bench/structured.py), tiny: one pair of rounds on the embedded
model; each round decodes its whole budget on every request (the schema cannot end within it), the
JSON rounds fill bitmasks and the free ones none, and the report is written."""

from __future__ import annotations

import json

import pytest

from fms_paged.bench import structured

pytest.importorskip("xgrammar")


def test_rounds_pair_free_and_json(tmp_path):
    assert structured.main(["--out", str(tmp_path), "--rounds", "1", "--batch", "4", "--new-tokens", "10",
                            "--prompt-len", "16", "--compile", "false"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    (m,) = res["models"]
    free, js = m["rounds"]
    assert (free["kind"], js["kind"]) == ("free", "json")
    assert free["steps"] == js["steps"] == 8  # 10 tokens: a prefill step, 8 full decodes, the last
    assert free["fill_ms_per_step"] == 0 and js["fill_ms_per_step"] > 0
    assert m["ratio"] == pytest.approx(js["step_ms"] / free["step_ms"])
    assert "JSON / free" in (tmp_path / "results.md").read_text()
