"""Peer drivers: the benchmarks that run another engine (vLLM, llama.cpp, OpenVINO GenAI, Hugging Face)
beside ours. They live in the checkout, not in the wheel: run them from the repository root, e.g.
`python -m benchmarks.vs_native --out results/bench-native` (`make bench-native`), `python -m
benchmarks.http` (`make bench-http`); `fms-paged bench --scenario serve` runs the peer workloads from here
when this folder is importable.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with the checkout first on PYTHONPATH, so that a
    child's `python -m benchmarks.<module>` finds this folder whatever its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env
