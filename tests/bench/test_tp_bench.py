"""`make bench-tp`'s plumbing on a small batch: both sizes run, and the collectives counted per decode
step are the split model's: an all-reduce after each layer's attention output and MLP down
projection, and the logits gather."""

import json

import pytest

from fms_paged.bench import tp

pytestmark = pytest.mark.usefixtures("cpu_only")


def test_bench_tp_counts_the_collectives_of_a_step(tmp_path):
    assert tp.main(["--out", str(tmp_path), "--models", "default", "--pairs", "1", "--batch", "2",
                    "--prompt-len", "20", "--new", "4"]) == 0
    res = json.loads((tmp_path / "bench_tp.json").read_text())
    m = res["models"][0]
    one, two = m["sizes"]["1"], m["sizes"]["2"]
    assert one["collectives_per_step"] == 0 and one["collective_ms_per_step"] == 0
    assert two["collectives_per_step"] == 2 * m["layers"] + 1
    assert 0 < two["collective_ms_per_step"] < two["decode_step_ms"]
    assert "| default | 2 |" in (tmp_path / "bench_tp.md").read_text()
