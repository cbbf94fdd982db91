"""`make gpu-check`: prove the CUDA path on a lent GPU in under ten minutes.

    bash scripts/gpu_check.sh OUTDIR [--device cpu --tiny]   (installs the package, then this)
    python -m scripts.gpu_check.check OUTDIR [--device cuda] [--tiny] [--stages tests,exact,...]
                                             (from the repository root)

Stages, each in a process of its own with a time budget (a crash or a hang in one is recorded and
the next one runs):
  1. tests   the default test suite with `--device cuda`, plus the `gpu`-marked tests; the suite's
             conftest turns FlexAttention's eager-fallback warning and Dynamo's recompile-limit
             fallback into errors there
  2. exact   paged vs dense SDPA vs `transformers` in bf16, fp16 and fp32 (`exact`)
  3. kernels decode runs FlexAttention's decoding kernel; 500 engine steps recompile nothing
             (`kernels`)
  4. bench   an 8B-shaped model in bf16: batch-1 decode against the bandwidth roofline, the mixed
             batch and the growing chat paged vs dense, the engine against HF (`perf`)
  5. tp      the engine split over every GPU against one GPU, when there are several (`tp`;
             skipped, saying so, on one)
  6. report  OUTDIR/gpu_check.json and OUTDIR/gpu_check.md (plus tests.log and tests.xml)
`--device cpu --tiny` runs the same stages on a tiny model with short lengths and a few test files:
CI's dry run, so the script cannot rot between GPU draws. Exit status 0 when every stage passed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from fms_paged.bench.environment import environment_info
from fms_paged.bench.report import table

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: the stages run as `-m scripts.gpu_check.*`

# stage -> (module with run/markdown, seconds on a GPU, seconds in the CPU dry run)
# (each stage module's `run(device, tiny, log, deadline_s=)` starts no part past its deadline, which
# is the budget less the process's start, so a slow stage still returns what it measured)
# (the dry run's exact stage compiles a decode step per dtype from cold caches on a fresh machine:
# 30-60 s each on a slow 2-core VM)
# (on a GPU, weights from a cold H100: the device tests ran 357 in 130 s on 8 workers and had not
# finished; the exactness cover's first case took 37 s of five; the kernel checks did not finish in
# 100 s; the bench's batch-1 decode section alone took 175 s. The whole check is more than one
# ten-minute call: docs/gpu-check.md says how to split it)
STAGES = {
    "tests": (None, 330, 150),
    "exact": ("scripts.gpu_check.exact", 150, 240),
    "kernels": ("scripts.gpu_check.kernels", 120, 120),
    "bench": ("scripts.gpu_check.perf", 250, 150),
    "tp": ("scripts.gpu_check.tp", 40, 60),  # passes at once, skipped, on a one-GPU machine
}
STARTUP_S = 20  # a stage process's imports and CUDA start, before its deadline clock runs
# the dry run's tests: two quick files (the point is the stage's plumbing; CI runs them all anyway)
TINY_TESTS = ["tests/engine/test_cuda_graphs.py", "tests/kv/test_geometry.py"]
WALL_BUDGET_S = 575  # the whole check, install included, stays inside ten minutes


def _log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for gpu_check.json, gpu_check.md, tests.log, tests.xml")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, short lengths, a few test files")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {list(STAGES)}")
    p.add_argument("--budget-s", type=float, default=WALL_BUDGET_S, help="wall-clock budget of all stages")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    p.add_argument("--deadline-s", type=float, help=argparse.SUPPRESS)  # internal: the stage's deadline
    return p


def _tests_command(device: str, tiny: bool, xml: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", device,
           "-m", "not slow and not docker", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    if tiny:
        return cmd + TINY_TESTS
    # the tests whose results depend on the device (those taking the `device` fixture) and the
    # gpu-marked ones: the rest run the same on every machine, and CI runs them
    cmd.append("--device-tests-only")
    if importlib.util.find_spec("xdist"):  # a GPU machine has 16 cores: spread the files over workers
        cmd += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2))), "--dist", "loadfile"]
    if importlib.util.find_spec("pytest_timeout"):  # one hung test must not take the stage
        cmd += ["--timeout", "150"]
    return cmd


def junit_summary(xml: Path) -> dict[str, Any]:
    """Counts and the first failures of a pytest junit file."""
    if not xml.is_file():
        return {"tests": 0, "failures": [], "note": "no junit file (pytest did not finish)"}
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = lambda attr: sum(int(s.get(attr, 0)) for s in suites)
    failures = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.get("message") or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {msg[0][:300] if msg else ''}")
    return {"tests": count("tests"), "failed": count("failures"), "errors": count("errors"),
            "skipped": count("skipped"), "failures": failures[:40]}


def run_pytest(cmd: list[str], xml: Path, log: Path, budget: float) -> dict[str, Any]:
    """Run a pytest command (writing `xml`) with its output in `log`; past `budget` seconds it is
    interrupted as Ctrl-C does (pytest then reports the tests that ran and writes its xml), and
    killed 30 s later if still running -> `junit_summary` + returncode (None: timed out), passed."""
    with open(log, "w") as f:
        rc = _wait_or_interrupt(subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                                 preexec_fn=_interruptible), budget)
    summary = junit_summary(xml)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
    summary.update(returncode=rc, last_line=tail[0] if tail else "", timed_out=rc is None)
    if rc is None:
        summary["error"] = f"interrupted after {budget:.0f} s"
    summary["passed"] = rc == 0
    return summary


def run_tests(args, budget: float) -> dict[str, Any]:
    xml, log = args.out / "tests.xml", args.out / "tests.log"
    cmd = _tests_command(args.device, args.tiny, xml)
    _log(f"  {' '.join(cmd[2:])}")
    return run_pytest(cmd, xml, log, budget)


def _interruptible() -> None:
    """In a child before it runs: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt there even when this process was started with SIGINT ignored (a shell's
    background job, nohup), which children inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_or_interrupt(proc: subprocess.Popen, budget: float) -> int | None:
    """Wait for `proc`; past `budget` seconds interrupt it as Ctrl-C does (so it can still report
    what it did) and kill it 30 s later if it is still running -> its exit code, None if interrupted."""
    try:
        return proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def run_stage_process(args, stage: str, budget: float) -> dict[str, Any]:
    """Run `stage` in a child process (this module with --stage) -> its result (partial if it ran
    out of time: the stage modules stop at the interrupt and report what they did), or why none."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "scripts.gpu_check.check", tmp, "--stage", stage,
               "--device", args.device, "--deadline-s", str(max(1.0, 0.9 * budget - STARTUP_S))]
        cmd += ["--tiny"] if args.tiny else []
        rc = _wait_or_interrupt(subprocess.Popen(cmd, cwd=REPO_ROOT, preexec_fn=_interruptible), budget)
        path = Path(tmp) / f"{stage}.json"
        wrote = path.is_file()
        result = json.loads(path.read_text()) if wrote else {"passed": False}
    if rc is None:
        result.update(passed=False, timed_out=True, error=f"timed out after {budget:.0f} s"
                      + ("; its results so far are below" if wrote else ""))
    elif not wrote:
        result["error"] = f"the stage's process exited {rc} with no result"
    return result


def stage_main(args) -> int:
    """In the child: run one stage's module and write its result."""
    module = importlib.import_module(STAGES[args.stage][0])
    result = module.run(torch.device(args.device), args.tiny,
                        lambda m: print(f"[gpu-check]   {m}", flush=True), deadline_s=args.deadline_s)
    result["markdown"] = module.markdown(result)
    (args.out / f"{args.stage}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def tests_markdown(r: dict[str, Any]) -> str:
    lines = ["## Test suite", "", f"{r.get('tests', 0)} tests: {r.get('failed', 0)} failed, "
             f"{r.get('errors', 0)} errors, {r.get('skipped', 0)} skipped ({r.get('last_line', '')})."]
    if r.get("timed_out"):
        lines.append("**Timed out** before the suite finished.")
    lines += [f"- `{f}`" for f in r.get("failures", [])]
    return "\n".join(lines)


def report(out: Path, env: dict[str, Any], results: dict[str, dict[str, Any]], tiny: bool) -> str:
    rows = [{"stage": s, "passed": r.get("passed"), "seconds": r.get("seconds"),
             "note": r.get("error") or ""} for s, r in results.items()]
    md = [f"# gpu-check{' (dry run, tiny)' if tiny else ''}", "",
          f"{env['device_name']} ({env['device']}), torch {env['torch']}, CUDA {env.get('cuda')}, "
          f"triton {env.get('triton')}, {env['time']}.", "",
          table(rows, [("stage", "stage", ""), ("passed", "passed", ""), ("seconds", "seconds", ".0f"),
                       ("note", "note", "")]), ""]
    for stage, r in results.items():
        section = tests_markdown(r) if stage == "tests" else r.get("markdown")
        md += [section or f"## {stage}\n\nNo result: {r.get('error')}", ""]
    text = "\n".join(md)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({"environment": env, "tiny": tiny, "stages": results},
                                                   indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return stage_main(args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"gpu_check: unknown stages {unknown}; expected a subset of {list(STAGES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no CUDA device (use --device cpu --tiny)")
    env = environment_info(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    t_start, results = time.perf_counter(), {}
    col = 2 if args.tiny else 1
    # each stage gets the time left in proportion to its weight among the stages still to run: a
    # subset (one device call of several) shares the whole budget, and what a stage leaves unused
    # goes to the next ones
    for i, stage in enumerate(stages, 1):
        left = args.budget_s - (time.perf_counter() - t_start)
        weight = STAGES[stage][col] / sum(STAGES[s][col] for s in stages[i - 1:])
        budget = max(10.0, left * weight)
        _log(f"stage {i}/{len(stages) + 1}: {stage} (budget {budget:.0f} s)")
        t0 = time.perf_counter()
        r = run_tests(args, budget) if stage == "tests" else run_stage_process(args, stage, budget)
        r["seconds"] = time.perf_counter() - t0
        results[stage] = r
        _log(f"stage {stage}: {'passed' if r.get('passed') else 'FAILED'} in {r['seconds']:.0f} s"
             + (f" ({r['error']})" if r.get("error") else ""))
    _log(f"stage {len(stages) + 1}/{len(stages) + 1}: report -> {args.out}/gpu_check.md, gpu_check.json")
    report(args.out, env, results, args.tiny)
    ok = all(r.get("passed") for r in results.values())
    failed = [s for s, r in results.items() if not r.get("passed")]
    _log(f"{'FAILED: ' + ', '.join(failed) if failed else 'all stages passed'} "
         f"in {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
