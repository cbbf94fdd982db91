"""gpu-check's exactness stage (`scripts.gpu_check.exact`) in its CPU dry run (tiny mode): it
passes on a correct paged path, covers every dtype, and fails, without raising, on a broken one:
keys written to the pool 1% off (fp32: rel error ~1e-2 against a tolerance of 2^10 u = 6e-5), NaN
left in reused pages (a backend that skips zeroing the pages it hands out, read whole by the flex
kernel's decode), and a case that raises."""

from __future__ import annotations

import json

import pytest
import torch

from fms_paged.kv.kernels import base as steps
from fms_paged.kv.paged import PagedBackend
from scripts.gpu_check import exact as gpu_exact

CPU = torch.device("cpu")
FIELDS = {"name", "dtype", "model", "page_size", "kernel", "metric", "value", "tolerance", "why", "passed"}

# gpu-check's CPU dry run: on a GPU, `make gpu-check` runs the stages themselves
pytestmark = pytest.mark.usefixtures("cpu_only")


@pytest.fixture(scope="module")
def tiny_result():
    lines: list[str] = []
    result = gpu_exact.run(CPU, True, lines.append)
    return result, lines


def failed(result) -> list[str]:
    return [f"{c['dtype']} {c['name']}: {c['value']} > {c['tolerance']} {c.get('error', '')}"
            for c in result["checks"] if not c["passed"]]


def test_tiny_mode_passes_and_covers_every_dtype(tiny_result):
    result, lines = tiny_result
    assert result["passed"], failed(result)
    checks = result["checks"]
    assert all(FIELDS <= set(c) for c in checks)
    assert {c["dtype"] for c in checks} == {"float32", "bfloat16", "float16"}
    for dtype in ("float32", "bfloat16", "float16"):  # both scenarios, against dense and HF
        names = {c["name"] for c in checks if c["dtype"] == dtype}
        assert any(n.startswith("nan-reuse, rows 5,2,7: paged vs dense") for n in names), names
        assert any("HF" in n for n in names), names
    assert any(c["metric"] == "mismatches" for c in checks)  # fp32 greedy tokens
    assert len(lines) == len(gpu_exact.TINY)  # one progress line per case
    text = gpu_exact.markdown(result)
    assert text.startswith("## Exactness") and text.count("\n| ") == len(checks) + 1
    json.dumps(result, allow_nan=False)  # strict JSON


def test_keys_written_off_by_one_percent_fail(monkeypatch):
    write = steps.write_slots

    def off(kp, vp, slots, k, v, *scales):  # every kernel's ASSIGN, eager and compiled
        return write(kp, vp, slots, k * 1.01, v, *scales)

    monkeypatch.setattr(steps, "write_slots", off)
    result = gpu_exact.run(CPU, True, lambda m: None, dtypes=("float32",))
    assert not result["passed"]
    bad = {c["name"] for c in result["checks"] if not c["passed"]}
    assert "fresh: paged vs dense" in bad and "fresh: paged vs HF" in bad, bad
    assert not any("error" in c for c in result["checks"])  # failed by measure, not by raising


def test_nan_left_in_reused_pages_fails(monkeypatch):
    def no_zeroing(self, reservation):  # the pages a RESERVE hands out are no longer zeroed
        self.pm.apply_copies(reservation, *self._storage())

    monkeypatch.setattr(PagedBackend, "prepare_pages", no_zeroing)
    result = gpu_exact.run(CPU, True, lambda m: None, dtypes=("bfloat16",))  # flex: reads whole pages
    reuse = [c for c in result["checks"] if c["name"].startswith("nan-reuse")]
    assert reuse and all(not c["passed"] and c["value"] is None for c in reuse), reuse
    assert not result["passed"]  # (fresh pages, torch.empty, may hold anything too)
    json.dumps(result, allow_nan=False)


def test_a_case_that_raises_is_recorded(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no model today")

    monkeypatch.setattr(gpu_exact, "get_model", broken)
    result = gpu_exact.run(CPU, True, lambda m: None, dtypes=("float16",))
    assert not result["passed"]
    (c,) = result["checks"]
    assert c["name"] == "case raised" and "no model today" in c["error"]
    assert "no model today" in gpu_exact.markdown(result)


def test_a_case_past_the_deadline_is_not_run():
    result = gpu_exact.run(CPU, True, lambda m: None, dtypes=("float16",), deadline_s=1e-9)
    (c,) = result["checks"]
    assert not result["passed"] and c["name"] == "case not run" and "not run" in c["error"]
