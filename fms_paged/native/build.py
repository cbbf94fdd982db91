"""How the C++ of `fms_paged/csrc/` is built: the toolchain, the instruction set, the compile
commands, and the library cache under a key of what made each library.

Two kinds of library, both kept in `$FMS_PAGED_CACHE_DIR` (default `~/.cache/fms_paged/kernels`)
under a key of what made them (sources, headers, flags, compiler; and the CPU, or the torch build),
so a later process loads them at once and a changed source or header is built again:

- the kernels (`csrc/kernels/`: attention.cpp, gemv.cpp, gemm.cpp, rows.cpp): no torch header, built in a few
  seconds with the machine's C++ compiler (`$CXX`, else g++ / c++: the one inductor needs as
  well), one library per instruction set, storage type (fp32, bf16, fp16: `ELEM_TYPES`) and head
  dim. A kernel's key holds its own headers (`<source stem>*.h`: attention_decode.h) and the
  shared ones (`KERNEL_HEADERS`);
- the operators (`csrc/ops/`: ops.cpp, layer.cpp): `TORCH_LIBRARY` schemas and CPU implementations,
  built against the running torch's headers and libraries once per torch build.

The instruction set is chosen on the machine: by default a kernel is built for the CPU it runs on
(`-march=native`), so its vectors are that CPU's widest (AVX-512, else AVX2; NEON on Arm) and its
half-precision loads use the conversion instructions that CPU has (F16C for fp16; bf16 needs only a
shift). `$FMS_PAGED_CPU_ISA` builds for less than the CPU has (`ISAS`): what another machine runs,
tested on this one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).parent.parent / "csrc"
KERNELS_DIR = CSRC / "kernels"  # torch-free: one library per kernel, ISA, dtype (and head dim)
OPS_DIR = CSRC / "ops"  # the TORCH_LIBRARY operators that call the kernels
# the kernels' sources
ATTENTION_SOURCE = KERNELS_DIR / "attention.cpp"
GEMV_SOURCE = KERNELS_DIR / "gemv.cpp"
# products of many rows (prefill) over the same plain weights: loaded with the GEMV kernel
GEMM_SOURCE = KERNELS_DIR / "gemm.cpp"
# the row-wise ops of a decoder block (norms, RoPE and ASSIGN, activations, residuals) that
# `fms_paged::decoder_stack` runs between its projections: loaded with the GEMV kernel
ROWS_SOURCE = KERNELS_DIR / "rows.cpp"
# products with weights held as GGUF blocks (Q8_0 ... Q6_K) (fms_paged::qlinear, and the blocks of a
# GGUF model's one-call forward)
QGEMV_SOURCE = KERNELS_DIR / "qgemv.cpp"
# the kernels' calling convention (argument structs, their field lists and layouts), their vector
# loads and stores, the page geometry (slot of a position), and the panels' driver and tiles (the
# products of many rows: gemm.cpp, qgemv.cpp), included by each
KERNEL_HEADERS = tuple(KERNELS_DIR / h for h in ("args.h", "kernels.h", "vec.h", "geometry.h", "panels.h"))
# the operators: the registry, paged_attention, gemv and linear; decoder_layer; what both include
OPS_SOURCES = (OPS_DIR / "ops.cpp", OPS_DIR / "layer.cpp", OPS_DIR / "qlinear.cpp")
OPS_HEADERS = (OPS_DIR / "ops.h", OPS_DIR / "stack.h", KERNELS_DIR / "qgemv_blocks.h")

# the tensor dtypes the kernels read and write -> the C++ type a kernel is built for with
# -DFMS_ELEM=... (csrc/kernels/args.h)
ELEM_TYPES = {torch.float32: "float", torch.bfloat16: "fms_bf16", torch.float16: "fms_f16"}


def elem(dtype: torch.dtype) -> str:
    """The C++ storage type of a kernel's tensors of `dtype`; ValueError for a dtype the kernels lack."""
    if dtype not in ELEM_TYPES:
        raise ValueError(f"the CPU kernels take {', '.join(str(d) for d in ELEM_TYPES)}, not {dtype}")
    return ELEM_TYPES[dtype]


# what `$FMS_PAGED_CPU_ISA` may ask the kernels to be built for: this CPU's own ISA, or less
ISAS = ("native", "avx2", "baseline")
_MARCH = {  # (x86-64, Arm) flags of each
    "native": ("-march=native", "-mcpu=native"),
    # AVX2, FMA, F16C: a CPU without AVX-512 (AMD Zen 3, Intel before Skylake-X)
    "avx2": ("-march=x86-64-v3", None),
    "baseline": ("-march=x86-64", "-march=armv8-a"),  # SSE2 (no F16C, no FMA) / plain Armv8
}


def _arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def isa() -> str:
    """The instruction set the kernels are built for: `$FMS_PAGED_CPU_ISA`, by default "native" (this
    CPU's own). "avx2" (x86-64-v3: AVX2, FMA and F16C, 8-lane vectors) and "baseline" (x86-64:
    SSE2, fp16 converted lane by lane; armv8-a on Arm) build for less than the CPU has: the paths
    of CPUs without AVX-512 or F16C, tested on one that has them. ValueError for another value."""
    value = os.environ.get("FMS_PAGED_CPU_ISA") or "native"
    if value not in ISAS or _MARCH[value][_arm()] is None:
        usable = [i for i in ISAS if _MARCH[i][_arm()] is not None]
        raise ValueError(f"FMS_PAGED_CPU_ISA={value!r}; expected one of {usable} on {platform.machine()}")
    return value


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags this CPU reports (Linux /proc/cpuinfo: x86 `flags`, Arm `Features`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for ln in lines:
        key, _, value = ln.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def kernel_isa(which: str | None = None) -> str:
    """What the kernels built for `which` (default: `isa()`) use here: vector width, FMA, and how
    they convert fp16, e.g. "AVX-512 (16-lane vectors, F16C)"."""
    which = which or isa()
    flags = cpu_flags()
    if which == "baseline" or (_arm() and which == "native"):
        return ("NEON (8-lane vectors" if _arm() else "SSE2 (8-lane vectors, no FMA") + \
            ", fp16 converted lane by lane)"
    if which == "native" and "avx512f" in flags:
        return "AVX-512 (16-lane vectors, F16C)"
    if which == "avx2" or "avx2" in flags:
        return "AVX2 (8-lane vectors, FMA, " + ("F16C)" if "f16c" in flags else "fp16 lane by lane)")
    return "the compiler's generic vectors (8 lanes)"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _flags(which: str) -> list[str]:
    return ["-O3", _MARCH[which][_arm()], "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-psabi"]


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


def library_path(name: str, made_from: list[str], cache: Path | None = None) -> Path:
    """Where the library `name` made from `made_from` is kept: `name`_<hash of made_from>.so."""
    key = hashlib.sha256("\n".join(made_from).encode()).hexdigest()[:16]
    return (cache or cache_dir()) / f"{name}_{key}.so"


def build_library(name: str, command: list[str], made_from: list[str],
           sources: tuple[Path, ...] = (), cache: Path | None = None) -> tuple[Path | None, str | None]:
    """The library `name` made from `made_from` (`library_path`): found, or built aside and renamed
    into place (atomic: another process building the same library at once does no harm) ->
    (path, None), or (None, why not). Built by `command` with the output path appended; with
    `sources`, `command` compiles each of them (`-c`) at once in processes of their own, and the
    objects are linked by `command`'s link flags (those after `-L`)."""
    path = library_path(name, made_from, cache)
    if path.exists():
        return path, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            steps = [[*command, "-o", str(out)]]
            if sources:
                link = next(i for i, a in enumerate(command) if a.startswith("-L"))
                objs = [str(Path(tmp) / f"{src.stem}.o") for src in sources]
                compiles = [subprocess.Popen([*command[:link], "-c", str(src), "-o", obj], text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                            for src, obj in zip(sources, objs)]
                for proc in compiles:
                    log, _ = proc.communicate(timeout=600)
                    if proc.returncode:
                        return None, f"building {name} failed: {log[-600:]}"
                steps = [[command[0], "-shared", *objs, *command[link:], "-o", str(out)]]
            for step in steps:
                run = subprocess.run(step, capture_output=True, text=True, timeout=600)
                if run.returncode:
                    return None, f"building {name} failed: {(run.stderr or run.stdout)[-600:]}"
            os.replace(out, path)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {name} failed: {e}"
    return path, None


@functools.cache
def _compiler_version(cxx: str) -> str | None:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def load(source: Path, **defines: int | str) -> tuple[Path | None, str | None]:
    """The kernel library built from `source` for `isa()` with `-DNAME=value` for each define (an
    int, or a C++ name such as `FMS_ELEM=fms_bf16`; built now, or found built) -> (path, None), or
    (None, why not)."""
    return kernel_library(source, isa(), cache_dir(), **defines)


@functools.cache
def kernel_library(source: Path, which: str, cache: Path,
                   **defines: int | str) -> tuple[Path | None, str | None]:
    """`load` for the ISA `which` and the cache dir `cache` (once per process and arguments)."""
    recipe = kernel_recipe(source, which, **defines)
    if isinstance(recipe, str):
        return None, recipe
    name, command, made_from = recipe
    return build_library(name, command, made_from, cache=cache)


def _toolchain() -> tuple[str, str] | str:
    """(the C++ compiler, its version line), or why there is none to build with."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, g++ or c++)"
    version = _compiler_version(cxx)
    if version is None:
        return f"{cxx} --version failed"
    return cxx, version


def kernel_recipe(source: Path, which: str, **defines: int | str) -> tuple[str, list[str], list[str]] | str:
    """(name, compile command, what it is made from) of the kernel library `kernel_library`
    builds, or why it cannot be built here."""
    toolchain = _toolchain()
    if isinstance(toolchain, str):
        return toolchain
    cxx, version = toolchain
    flags = _flags(which) + [f"-I{KERNELS_DIR}"] + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    parts = sorted(source.parent.glob(source.stem + "*.h"))  # the kernel's own headers
    made_from = [source.read_text(), *(h.read_text() for h in (*parts, *KERNEL_HEADERS)), " ".join(flags),
                 version, _cpu_id()]
    tag = "".join(f"_{k.lower()}{v}" for k, v in sorted(defines.items()))
    tag += "" if which == "native" else f"_{which}"
    return source.stem + tag, [cxx, *flags, str(source)], made_from


def import_cpp_extension():
    """torch.utils.cpp_extension, imported without its warning that a CUDA_HOME has no CUDA runtime
    (these builds are for the CPU; a first start's model load would print it, from a background
    build)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def _ops_command(cxx: str) -> list[str]:
    """How the operators (`OPS_SOURCES`) are compiled against the running torch: its headers, its
    C++ ABI, its libraries (as `torch.utils.cpp_extension` builds an extension); no -march: one
    build for every CPU with the CPU's F16C where it has it (fp16 converted by one instruction, not
    c10::Half's bit arithmetic: a decode step converts ~10^5 values; the flag is part of the build's
    key, so a CPU without it builds its own). -ffp-contract=off: products and sums rounded one by
    one, as ATen's vectorized CPU ops do. -O1: the operators are glue around the kernels (built
    -O3); a decode step's host work is the same as at -O2, and each source compiles ~1.2 s sooner
    (a cold start waits for them). The link flags come last, from -L on."""
    cpp_extension = import_cpp_extension()

    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    f16c = ["-mf16c"] if not _arm() and "f16c" in cpu_flags() else []
    return [cxx, "-O1", *f16c, "-fPIC", "-std=c++17", "-ffp-contract=off", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{OPS_DIR}", *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-I{sysconfig.get_paths()['include']}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]


def ops_recipe() -> tuple[list[str], list[str]] | str:
    """(compile command, what it is made from) of the operators' library, or why it cannot be
    built here."""
    toolchain = _toolchain()
    if isinstance(toolchain, str):
        return toolchain
    cxx, version = toolchain
    command = _ops_command(cxx)
    sources = (*OPS_SOURCES, *OPS_HEADERS, *KERNEL_HEADERS)
    return command, [*(f.read_text() for f in sources), " ".join(command), version, torch.__version__,
                     str(torch.version.git_version), sys.version]


