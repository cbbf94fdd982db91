"""`make gpu-check`'s dry run: the script a GPU session runs, end to end on the CPU with a tiny model,
so that it cannot rot between GPU draws; and the pieces that read its stages' results."""

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from scripts.gpu_check import check as gpu_check

REPO = Path(__file__).resolve().parents[2]

# gpu-check's CPU dry run: on a GPU, `make gpu-check` runs the stages themselves
pytestmark = pytest.mark.usefixtures("cpu_only")


def test_dry_run_passes_every_stage_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), str(out), "--device", "cpu", "--tiny"],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for stage in ("tests", "exact", "kernels", "bench", "tp", "report"):  # a progress line per stage
        assert f": {stage} " in run.stdout or f": {stage} ->" in run.stdout, stage
    result = json.loads((out / "gpu_check.json").read_text())
    assert list(result["stages"]) == list(gpu_check.STAGES)
    assert all(r["passed"] and not r.get("error") for r in result["stages"].values()), result["stages"]
    assert result["stages"]["tests"]["tests"] > 0 and not result["stages"]["tests"]["failures"]
    tp = result["stages"]["tp"]  # the dry run splits over 2 CPU ranks (gloo): fp32 tokens equal
    assert tp["size"] == 2 and all(c["first_difference"] is None for c in tp["checks"]) and tp["checks"]
    md = (out / "gpu_check.md").read_text()
    for heading in ("# gpu-check (dry run, tiny)", "## Test suite", "## Kernels and recompiles"):
        assert heading in md
    assert (out / "tests.xml").is_file() and (out / "tests.log").is_file()


def test_junit_summary_counts_a_real_run(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_skipped(): pass\n")
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(tmp_path / "test_x.py"), f"--junitxml={xml}", "--rootdir", str(tmp_path),
                    "-c", os.devnull], capture_output=True)
    s = gpu_check.junit_summary(xml)
    assert (s["tests"], s["failed"], s["errors"], s["skipped"]) == (3, 1, 0, 1)
    assert len(s["failures"]) == 1 and "test_bad" in s["failures"][0] and "one is not two" in s["failures"][0]
    assert gpu_check.junit_summary(tmp_path / "missing.xml")["failures"] == []


def test_a_stage_that_hangs_is_recorded_and_the_check_fails(tmp_path):
    args = types.SimpleNamespace(device="cpu", tiny=True)
    r = gpu_check.run_stage_process(args, "bench", budget=0.5)
    assert r["timed_out"] and not r["passed"] and "timed out" in r["error"]


def test_a_test_run_past_its_budget_is_interrupted_and_keeps_what_ran(tmp_path):
    """Also where this process ignores SIGINT (a background job's children inherit that): the
    child pytest gets it back (`_interruptible`)."""
    (tmp_path / "test_y.py").write_text(
        "import time\n"
        "def test_a_quick_one(): pass\n"
        "def test_z_hangs(): time.sleep(600)\n")
    xml, log = tmp_path / "r.xml", tmp_path / "r.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_y.py"),
           f"--junitxml={xml}", "--rootdir", str(tmp_path), "-c", os.devnull]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        s = gpu_check.run_pytest(cmd, xml, log, budget=8)
    finally:
        signal.signal(signal.SIGINT, before)
    assert s["timed_out"] and not s["passed"] and "interrupted" in s["error"]
    assert s["tests"] >= 1 and s["failed"] == 0  # the quick test's result was written
