"""Build and load the project's C++ CPU kernels and the PyTorch operators that call them, and say
which CPU paths they and the GEMMs take here.

Two kinds of library, both kept in `$FMS_PAGED_CACHE_DIR` (default `~/.cache/fms_paged/kernels`)
under a key of what made them (sources, flags, compiler; and the CPU, or the torch build), so a
later process loads them at once and a changed source is built again:

- the kernels (`fms_paged/kv/cpu_attention.cpp`, `fms_paged/modules/cpu_gemv.cpp`): no torch
  header, built in a few seconds with the machine's C++ compiler (`$CXX`, else g++ / c++: the one
  inductor needs as well) when first needed, one library per instruction set, storage type (fp32,
  bf16, fp16: `ELEM_TYPES`) and head dim;
- the operators (`fms_paged/native_ops.cpp`, `native_layer.cpp`): `TORCH_LIBRARY` schemas and CPU
  implementations of `torch.ops.fms_paged.{paged_attention, gemv, linear, decoder_stack}` and the
  class `torch.classes.fms_paged.DecoderStack`, built against the running torch's headers and
  libraries once per torch build (`fms-paged build-kernels` at install time, else on first use)
  and loaded with `torch.ops.load_library`.
  They load each kernel library by path (`register`) and check its argument struct against their
  own (`native_kernels.h`, one field list for both sides) before calling it. Eager mode,
  inductor's generated code and an AOT-compiled graph reach the kernels through the dispatcher
  alone: no Python, no ctypes.

A first start on a machine builds them in background threads while a paged CPU model loads
(`prebuild_model`), and the model does not wait: while they compile it computes with torch's
operations, and takes the operators and kernels at its first call after (`deferred`;
`$FMS_PAGED_WAIT_FOR_BUILDS=1` waits instead).

The instruction set is chosen on the machine, when a kernel is first used: by default a kernel is
built for the CPU it runs on (`-march=native`), so its vectors are that CPU's widest (AVX-512,
else AVX2; NEON on Arm) and its half-precision loads use the conversion instructions that CPU has
(F16C for fp16; bf16 needs only a shift). `$FMS_PAGED_CPU_ISA` builds for less than the CPU has
(`ISAS`): what another machine runs, tested on this one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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
import threading
from pathlib import Path

import torch

_HERE = Path(__file__).parent
# the kernels' calling convention (argument structs, their field lists and layouts) and their
# vector loads and stores, included by each
HEADERS = (_HERE / "native_args.h", _HERE / "native_kernels.h", _HERE / "native_vec.h")
# the operators: the registry, paged_attention, gemv and linear; decoder_layer; what both include
OPS_SOURCES = (_HERE / "native_ops.cpp", _HERE / "native_layer.cpp")
OPS_HEADER = _HERE / "native_ops.h"
STACK_HEADER = _HERE / "native_stack.h"  # (native_layer.cpp alone)

# the tensor dtypes the kernels read and write -> the C++ type a kernel is built for with
# -DFMS_ELEM=... (native_args.h)
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


def _library(name: str, made_from: list[str], cache: Path | None = None) -> Path:
    """Where the library `name` made from `made_from` is kept: `name`_<hash of made_from>.so."""
    key = hashlib.sha256("\n".join(made_from).encode()).hexdigest()[:16]
    return (cache or cache_dir()) / f"{name}_{key}.so"


def _build(name: str, command: list[str], made_from: list[str],
           sources: tuple[Path, ...] = (), cache: Path | None = None) -> tuple[Path | None, str | None]:
    """The library `name` made from `made_from` (`_library`): found, or built aside and renamed
    into place (atomic: another process building the same library at once does no harm) ->
    (path, None), or (None, why not). Built by `command` with the output path appended; with
    `sources`, `command` compiles each of them (`-c`) at once in processes of their own, and the
    objects are linked by `command`'s link flags (those after `-L`)."""
    path = _library(name, made_from, cache)
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
    return _load(source, isa(), cache_dir(), **defines)


@functools.cache
def _load(source: Path, which: str, cache: Path, **defines: int | str) -> tuple[Path | None, str | None]:
    recipe = _kernel_recipe(source, which, **defines)
    if isinstance(recipe, str):
        return None, recipe
    name, command, made_from = recipe
    return _build(name, command, made_from, cache=cache)


def _kernel_recipe(source: Path, which: str, **defines: int | str) -> tuple[str, list[str], list[str]] | str:
    """(name, compile command, what it is made from) of the kernel library `_load` builds, or why
    it cannot be built here."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, g++ or c++)"
    version = _compiler_version(cxx)
    if version is None:
        return f"{cxx} --version failed"
    flags = _flags(which) + [f"-I{_HERE}"] + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    parts = sorted(source.parent.glob(source.stem + "*.h"))  # the kernel's own headers
    made_from = [source.read_text(), *(h.read_text() for h in (*parts, *HEADERS)), " ".join(flags), version,
                 _cpu_id()]
    tag = "".join(f"_{k.lower()}{v}" for k, v in sorted(defines.items()))
    tag += "" if which == "native" else f"_{which}"
    return source.stem + tag, [cxx, *flags, str(source)], made_from


def _cpp_extension():
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
    cpp_extension = _cpp_extension()

    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    f16c = ["-mf16c"] if not _arm() and "f16c" in cpu_flags() else []
    return [cxx, "-O1", *f16c, "-fPIC", "-std=c++17", "-ffp-contract=off", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{_HERE}", *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-I{sysconfig.get_paths()['include']}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]


_OPS_LOCK = threading.Lock()
_OPS: list[str | None] = []  # [None] once loaded, [why not] once that failed


def ops() -> str | None:
    """Build (once per torch build and compiler) and load the operators of `native_ops.cpp` ->
    None, or why they cannot be had here (then `torch.ops.fms_paged.*` do not exist)."""
    with _OPS_LOCK:
        if not _OPS:
            _OPS.append(_load_ops())
        return _OPS[0]


def ops_loaded() -> bool:
    """Whether the operators are loaded in this process (without building them)."""
    return _OPS == [None]


def _ops_recipe() -> tuple[list[str], list[str]] | str:
    """(compile command, what it is made from) of the operators' library, or why it cannot be
    built here."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, g++ or c++)"
    version = _compiler_version(cxx)
    if version is None:
        return f"{cxx} --version failed"
    command = _ops_command(cxx)
    sources = (*OPS_SOURCES, OPS_HEADER, STACK_HEADER, *HEADERS)
    return command, [*(f.read_text() for f in sources), " ".join(command), version, torch.__version__,
                     str(torch.version.git_version), sys.version]


def _load_ops() -> str | None:
    recipe = _ops_recipe()
    if isinstance(recipe, str):
        return recipe
    command, made_from = recipe
    path, why = _build("native_ops", command, made_from, OPS_SOURCES)
    if path is None:
        return why
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        return f"loading {path} failed: {e}"
    from fms_paged.native_fakes import register_fakes

    register_fakes()
    return None


_REGISTERED: dict[tuple[str, torch.dtype, int], Path] = {}  # what the operators call, per kernel
# builds run beside each other (a first start builds the operators and two kernels at once)
_BUILDS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="fms-paged-build")


def _submit(fn, *args, **kwargs) -> concurrent.futures.Future:
    """`fn` on a build thread, once `torch.utils.cpp_extension` is imported on this one: it imports
    setuptools, whose import puts a finder at the head of `sys.meta_path` and takes it out again; done
    on a build thread while this thread imports a module, that can make Python's search skip the
    path finder (ModuleNotFoundError: No module named 'torch._dynamo', seen while a model was made
    beside its first builds)."""
    _cpp_extension()
    return _BUILDS.submit(fn, *args, **kwargs)


_FUTURES: dict[tuple, concurrent.futures.Future] = {}  # each kernel's build, once per cache dir
_FUTURES_LOCK = threading.Lock()
# the background builds this process started that compile (their library was not in the cache
# when they started), until they are done: see `compiling`
_COMPILING: list[concurrent.futures.Future] = []


def _building(source: Path, dtype: torch.dtype, **defines: int | str) -> concurrent.futures.Future:
    """The build of kernel `source` for `dtype` and `isa()` (`_load`), started now unless it was."""
    which, cache, defines = isa(), cache_dir(), dict(defines, FMS_ELEM=elem(dtype))
    key = (source, which, str(cache), tuple(sorted(defines.items())))
    with _FUTURES_LOCK:
        if key not in _FUTURES:  # (the cache dir of now: the build may run after it changes)
            _FUTURES[key] = _submit(_load, source, which, cache, **defines)
            recipe = _kernel_recipe(source, which, **defines)
            if not isinstance(recipe, str) and not _library(recipe[0], recipe[2], cache).exists():
                _COMPILING.append(_FUTURES[key])
        return _FUTURES[key]


def compiling() -> bool:
    """Whether a build this process started in the background (`prebuild_model`, `prebuild`) is
    still compiling: a first start on this machine, its libraries not in the cache yet."""
    with _FUTURES_LOCK:
        _COMPILING[:] = [f for f in _COMPILING if not f.done()]
        return bool(_COMPILING)


def deferred() -> bool:
    """Whether a paged CPU model computes with torch's operations now rather than wait for the
    operators and kernels: while this process's background builds compile (`compiling`), unless
    `$FMS_PAGED_WAIT_FOR_BUILDS` is set. The first tokens then come in seconds (`linear.serves`,
    `cpu_kernel.loaded` say no meanwhile), and the model takes the operators and kernels at its
    first call after the builds are done. Where every library was found built this is False from
    the start, and with the variable set a first start waits: a model's every call takes one path."""
    return compiling() and not os.environ.get("FMS_PAGED_WAIT_FOR_BUILDS")


@contextlib.contextmanager
def yielding_to_builds():
    """Torch's operations on one thread inside, while a model does not wait for this process's
    first builds (`deferred`; as they were otherwise): the steps that run meanwhile by torch's operations
    leave the other cores to the compilers. On two cores, two intra-op threads beside three
    compilers doubled the builds' time (their OpenMP threads spin between operations) and ran the
    steps no faster."""
    if not deferred():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def wait_for_builds() -> None:
    """Wait for the background builds this process started (`compiling`): what a compiled graph
    needs before it is traced, so that it calls the operators rather than torch's fallbacks."""
    with _FUTURES_LOCK:
        pending = list(_COMPILING)
    concurrent.futures.wait(pending)


def prebuild(source: Path, dtype: torch.dtype, **defines: int | str) -> None:
    """Start building the kernel `source` for `dtype` (for `isa()`) in the background, if it is not
    built yet: a later `register` of it finds it built, or waits for this build."""
    _building(source, dtype, **defines)


def register(kind: str, source: Path, dtype: torch.dtype, head_dim: int = 0,
             **defines: int | str) -> str | None:
    """Build (for `isa()`, once per machine) the `kind` kernel ("attention", "gemv" or "rows") for `dtype`
    (and `head_dim`) from `source`, and hand it to the operators, in place of the one of another
    ISA they may hold -> None, or why it cannot be had here."""
    kernel = _building(source, dtype, **defines)  # beside the operators'
    why = ops()
    path, why_kernel = kernel.result()
    if why is not None or path is None:
        return why or why_kernel
    key = (kind, dtype, head_dim)
    if _REGISTERED.get(key) != path:
        torch.ops.fms_paged._load_kernel(kind, str(path), dtype, head_dim)
        _REGISTERED[key] = path
    return None


def kernel_ready(kind: str, dtype: torch.dtype, head_dim: int = 0) -> bool:
    """Whether the operators hold the `kind` kernel for `dtype` (and `head_dim`) now: loaded by
    `register`, nothing built or loaded here (cheap enough for every call of a module)."""
    return (kind, dtype, head_dim) in _REGISTERED


def prebuild_model(device: torch.device, dtype: torch.dtype | None, head_dim: int, attn_impl: str) -> None:
    """Start building, in the background, what a paged model on the CPU loads at its first forward
    (the operators; the attention kernel for its dtype and head dim, the GEMV and rows kernels), so
    that a first start compiles while the checkpoint loads rather than after. Nothing for another
    device, dtype or attention; what is built already is only found."""
    from fms_paged.kv import cpu_kernel
    from fms_paged.modules import linear

    if attn_impl != "paged" or device.type != "cpu" or dtype not in ELEM_TYPES or compiler() is None:
        return
    if not _OPS:  # (a build that fails is reported where the operators are first asked for)
        future, recipe = _submit(ops), _ops_recipe()
        if not isinstance(recipe, str) and not _library("native_ops", recipe[1]).exists():
            with _FUTURES_LOCK:
                _COMPILING.append(future)
    linear.prebuild_kernels(dtype)
    if head_dim % cpu_kernel.HEAD_DIM_MULTIPLE == 0 and not os.environ.get("FMS_PAGED_FORCE_GATHER"):
        prebuild(cpu_kernel.SOURCE, dtype, HEAD_DIM=head_dim)


def build_all(dtypes: tuple[torch.dtype, ...] = tuple(ELEM_TYPES), head_dims: tuple[int, ...] = (64, 128),
              log=print) -> bool:
    """Build the operators and this CPU's kernels for `dtypes` and `head_dims` into the cache (what
    `fms-paged build-kernels` does at install time), so that a first model starts without a
    compiler run -> whether everything built."""
    from fms_paged.kv import cpu_kernel
    from fms_paged.modules import linear

    for dt in dtypes:  # every kernel's build at once, beside the operators'
        linear.prebuild_kernels(dt)
        for d in head_dims:
            prebuild(cpu_kernel.SOURCE, dt, HEAD_DIM=d)
    why = ops()
    log(f"operators (native_ops.cpp, native_layer.cpp): {why or 'built'}")
    ok = why is None
    for dt in dtypes:
        why = linear.load_gemv(dt)
        log(f"GEMV and rows kernels {dt}: {why or 'built'}")
        ok &= why is None
        for d in head_dims:
            why = cpu_kernel.load_attention(d, dt)
            log(f"attention kernel {dt} head_dim={d}: {why or 'built'}")
            ok &= why is None
    return ok
