"""Build and load the project's C++ CPU kernels (`fms_paged/kv/cpu_attention.cpp`,
`fms_paged/modules/cpu_gemv.cpp`).

A kernel source is compiled on first use with the machine's C++ compiler (`$CXX`, else g++ / c++:
the one inductor needs for compiled FlexAttention as well) into a shared library kept in
`$FMS_PAGED_CACHE_DIR` (default `~/.cache/fms_paged/kernels`), keyed by the source, the flags,
the compiler and the CPU, so later processes load it at once. The sources include no torch headers
(a build takes about a second) and use OpenMP from the runtime torch has loaded already; they are
called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401 - loaded first: the kernels' OpenMP resolves to the runtime torch uses


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _flags() -> list[str]:
    arch = "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"
    return ["-O3", arch, "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else the machine."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.split(":")[0].strip() in keep))


def cache_dir() -> Path:
    root = os.environ.get("FMS_PAGED_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fms_paged" / "kernels"


@functools.cache
def load(source: Path, **defines: int) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built from `source` with `-DNAME=value` for each define (built now, or found
    built) -> (library, None), or (None, why not)."""
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, g++ or c++)"
    flags = _flags() + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    key = hashlib.sha256("\n".join([source.read_text(), " ".join(flags), version, _cpu_id()]).encode())
    tag = "".join(f"_{k.lower()}{v}" for k, v in sorted(defines.items()))
    path = cache_dir() / f"{source.stem}{tag}_{key.hexdigest()[:16]}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: atomic
                out = Path(tmp) / path.name
                run = subprocess.run([cxx, *flags, str(source), "-o", str(out)], capture_output=True,
                                     text=True, timeout=600)
                if run.returncode:
                    return None, f"building {source.name} failed: {(run.stderr or run.stdout)[-600:]}"
                os.replace(out, path)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {source.name} failed: {e}"
    try:
        return ctypes.CDLL(str(path)), None
    except OSError as e:
        return None, f"loading {path} failed: {e}"
