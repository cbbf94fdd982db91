"""The project's native code (`fms_paged/csrc/`) from Python: build it, load it, and say whether the
C++ path can run now.

- `build`: the toolchain, the instruction set, the compile commands and the library cache (a
  library's key holds its sources and headers, flags, compiler, CPU or torch build);
- this module: the operators (`csrc/ops/`, `torch.ops.fms_paged.*`, loaded with
  `torch.ops.load_library`) and the kernels they call (`csrc/kernels/`, one library per ISA, dtype
  and head dim, handed to the operators by path: `register`), the background builds of a first
  start, the one readiness check (`ready`), and the kernel clock (`kernel_clock`);
- `fakes`: the operators' fake (meta) implementations, what torch.compile traces with;
- `gemm`: the rules by which `fms_paged::linear` picks its path, handed to the operators on load.

Eager mode, inductor's generated code and an AOT-compiled graph reach the kernels through the
dispatcher alone: no Python, no ctypes. The operators check each kernel library's argument struct
against their own (`csrc/kernels/kernels.h`, one field list for both sides) before calling it.

A first start on a machine builds them in background threads while a paged CPU model loads
(`prebuild_model`), and the model does not wait: while they compile it computes with torch's
operations, and takes the operators and kernels at its first call after (`deferred`;
`$FMS_PAGED_WAIT_FOR_BUILDS=1` waits instead). A compiled graph waits for them before it is traced
(`require_builds`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fms_paged.native import gemm
from fms_paged.native.build import (
    ATTENTION_SOURCE,
    ELEM_TYPES,
    GEMM_SOURCE,
    GEMV_SOURCE,
    ISAS,
    OPS_SOURCES,
    QGEMV_SOURCE,
    ROWS_SOURCE,
    build_library,
    cache_dir,
    compiler,
    cpu_flags,
    elem,
    import_cpp_extension,
    isa,
    kernel_isa,
    kernel_library,
    kernel_recipe,
    library_path,
    ops_recipe,
)
from fms_paged.native.fakes import register_fakes

__all__ = [
    "ATTENTION_SOURCE", "ELEM_TYPES", "GEMM_SOURCE", "GEMV_SOURCE", "HEAD_DIM_MULTIPLE", "ISAS",
    "PAGE_MULTIPLE",
    "ROWS_SOURCE", "build_all", "cache_dir", "compiler", "compiling", "configure", "cpu_flags", "deferred",
    "elem", "isa", "kernel_clock", "kernel_isa", "kernel_ready", "load_attention", "load_gemm", "load_gemv",
    "load_qgemv",
    "ops",
    "ops_loaded", "prebuild", "prebuild_attention", "prebuild_kernels", "prebuild_model", "ready", "register",
    "require_builds", "wait_for_builds", "yielding_to_builds",
]

# the attention kernel's tile sizes: 16 query rows per vector, 8 keys (of one page) per score tile
HEAD_DIM_MULTIPLE = 16
PAGE_MULTIPLE = 8

_OPS_LOCK = threading.Lock()
_OPS: list[str | None] = []  # [None] once loaded, [why not] once that failed


def ops() -> str | None:
    """Build (once per torch build and compiler) and load the operators (`csrc/ops/`) ->
    None, or why they cannot be had here (then `torch.ops.fms_paged.*` do not exist)."""
    with _OPS_LOCK:
        if not _OPS:
            _OPS.append(_load_ops())
        return _OPS[0]


def ops_loaded() -> bool:
    """Whether the operators are loaded in this process (without building them)."""
    return _OPS == [None]


def _load_ops() -> str | None:
    recipe = ops_recipe()
    if isinstance(recipe, str):
        return recipe
    command, made_from = recipe
    path, why = build_library("native_ops", command, made_from, OPS_SOURCES)
    if path is None:
        return why
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        return f"loading {path} failed: {e}"
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
    import_cpp_extension()
    return _BUILDS.submit(fn, *args, **kwargs)


_FUTURES: dict[tuple, concurrent.futures.Future] = {}  # each kernel's build, once per cache dir
_FUTURES_LOCK = threading.Lock()
# the background builds this process started that compile (their library was not in the cache
# when they started), until they are done: see `compiling`
_COMPILING: list[concurrent.futures.Future] = []


def _building(source: Path, dtype: torch.dtype, **defines: int | str) -> concurrent.futures.Future:
    """The build of kernel `source` for `dtype` and `isa()` (`kernel_library`), started now unless it was."""
    which, cache, defines = isa(), cache_dir(), dict(defines, FMS_ELEM=elem(dtype))
    key = (source, which, str(cache), tuple(sorted(defines.items())))
    with _FUTURES_LOCK:
        if key not in _FUTURES:  # (the cache dir of now: the build may run after it changes)
            _FUTURES[key] = _submit(kernel_library, source, which, cache, **defines)
            recipe = kernel_recipe(source, which, **defines)
            if not isinstance(recipe, str) and not library_path(recipe[0], recipe[2], cache).exists():
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
    `$FMS_PAGED_WAIT_FOR_BUILDS` is set. The first tokens then come in seconds (`ready` says no
    meanwhile), and the model takes the operators and kernels at its
    first call after the builds are done. Where every library was found built this is False from
    the start, and with the variable set a first start waits: a model's every call takes one path."""
    # (no build compiling: False without the lock, what a step after a first start costs)
    return bool(_COMPILING) and compiling() and not os.environ.get("FMS_PAGED_WAIT_FOR_BUILDS")


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
    """Build (for `isa()`, once per machine) the `kind` kernel ("attention", "gemv", "gemm", "rows",
    or "attention_i8": attention over int8 pools) for `dtype`
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


def prebuild_kernels(dtype: torch.dtype) -> None:
    """Start the background builds of the GEMV and rows kernels for `dtype` (`prebuild`), and the
    GEMM kernel's where the projections take it (`gemm.GEMM == "own"`): what a paged CPU model's
    blocks load at their first forward."""
    for source in (GEMV_SOURCE, ROWS_SOURCE, *((GEMM_SOURCE,) if gemm.GEMM == "own" else ())):
        prebuild(source, dtype)


def prebuild_model(device: torch.device, dtype: torch.dtype | None, head_dim: int, attn_impl: str) -> None:
    """Start building, in the background, what a paged model on the CPU loads at its first forward
    (the operators; the attention kernel for its dtype and head dim, the GEMV and rows kernels), so
    that a first start compiles while the checkpoint loads rather than after. Nothing for another
    device, dtype or attention; what is built already is only found."""
    if attn_impl != "paged" or device.type != "cpu" or dtype not in ELEM_TYPES or compiler() is None:
        return
    if not _OPS:  # (a build that fails is reported where the operators are first asked for)
        future, recipe = _submit(ops), ops_recipe()
        if not isinstance(recipe, str) and not library_path("native_ops", recipe[1]).exists():
            with _FUTURES_LOCK:
                _COMPILING.append(future)
    prebuild_kernels(dtype)
    if head_dim % HEAD_DIM_MULTIPLE == 0 and not os.environ.get("FMS_PAGED_FORCE_GATHER"):
        prebuild(ATTENTION_SOURCE, dtype, HEAD_DIM=head_dim)


def configure() -> str | None:
    """Load the operators (`ops`) and hand them the path rules of `fms_paged::linear` (`gemm`:
    the thresholds, `PACK_DTYPES`, probed here on first use) -> None, or why there are no
    operators here. Called again after changing them."""
    why = ops()
    if why is None:
        if gemm.GEMM == "own":  # the GEMM kernel of every dtype loaded so far (a later one: load_gemv)
            for dt in list(_READY):
                load_gemm(dt)
        pack = [gemm.PACK_DTYPES[dt] for dt in ELEM_TYPES] if gemm.ONEDNN else []
        own_rows = [gemm.OWN_GEMV_MAX_ROWS.get(dt, gemm.GEMV_MAX_ROWS) for dt in ELEM_TYPES]
        torch.ops.fms_paged._configure_linear(gemm.GEMV_MAX_ROWS, gemm.PACK_MIN_WEIGHT, gemm.PACK_MIN_ROWS,
                                              pack, gemm.GEMM == "own", own_rows)
    return why


# dtype -> the operators and its GEMV and rows kernels were tried (`load_gemv`), with the head dims
# (None: no attention asked for) that `ready` found the C++ path for: nothing unloads, so a path
# found ready stays ready for the process and a later ask costs two lookups
_READY: dict[torch.dtype, set[int | None]] = {}


def load_gemv(dtype: torch.dtype) -> str | None:
    """Load the operators and the GEMV and rows kernels for `dtype` (built for `isa()` once per
    machine), and the GEMM kernel where the projections take it (`gemm.GEMM == "own"`) -> None, or
    why not (the operator then computes its few-row products with ATen)."""
    prebuild_kernels(dtype)  # all at once
    why = ((configure() if not _READY else ops()) or register("gemv", GEMV_SOURCE, dtype)
           or register("rows", ROWS_SOURCE, dtype) or (load_gemm(dtype) if gemm.GEMM == "own" else None))
    _READY.setdefault(dtype, set())  # tried: the operators take it from here
    return why


def load_gemm(dtype: torch.dtype) -> str | None:
    """Load the GEMM kernel for `dtype` (built for `isa()` once per machine) into the operators
    (`fms_paged::gemm`; `linear` past the GEMV's rows where `gemm.GEMM == "own"`) -> None, or why
    not (`fms_paged::gemm` then computes with ATen, and `linear` with oneDNN)."""
    return register("gemm", GEMM_SOURCE, dtype)


def load_qgemv(dtype: torch.dtype) -> str | None:
    """Load the operators and the kernel of products with GGUF blocks (Q8_0 ... Q6_K) for activations
    of `dtype` (`csrc/kernels/qgemv.cpp`, built for `isa()` once per machine) -> None, or why not
    (`fms_paged::qlinear` and a stack holding blocks then refuse to run)."""
    if dtype not in ELEM_TYPES:
        return f"the qgemv kernel takes {', '.join(map(str, ELEM_TYPES))}, not {dtype}"
    return load_gemv(dtype) or register("qgemv", QGEMV_SOURCE, dtype)


def load_attention(head_dim: int, dtype: torch.dtype = torch.float32, kv_int8: bool = False) -> str | None:
    """Build (for `isa()`, once per machine) and load the attention kernel for `head_dim` and
    `dtype` into the operators -> None, or why it cannot be had here. `kv_int8`: the build that
    reads int8 pools with their row scales (8-bit KV pages; kind "attention_i8")."""
    if kv_int8:
        return register("attention_i8", ATTENTION_SOURCE, dtype, head_dim, HEAD_DIM=head_dim, FMS_KV_INT8=1)
    return register("attention", ATTENTION_SOURCE, dtype, head_dim, HEAD_DIM=head_dim)


def prebuild_attention(dtype: torch.dtype, head_dim: int, kv_int8: bool = False) -> None:
    """Start the background builds of the attention kernel for `dtype` and `head_dim` (`kv_int8`:
    its build over int8 pools), and of the GEMV and rows kernels a model's blocks need beside it."""
    prebuild_kernels(dtype)
    prebuild(ATTENTION_SOURCE, dtype, HEAD_DIM=head_dim, **({"FMS_KV_INT8": 1} if kv_int8 else {}))


_WARNED: set[tuple[int, torch.dtype, bool]] = set()


def ready(dtype: torch.dtype, head_dim: int | None = None, kv_int8: bool = False) -> bool:
    """Whether the C++ path runs now for `dtype`: the one check of it, which every caller makes.

    True where the operators are loaded, the GEMV and rows kernels for `dtype` tried (one that could
    not be built leaves its operator to ATen), and, given `head_dim`, the attention kernel for it
    loaded. Loads (building if need be) on the first ask for a dtype and head dim, then costs a
    dict lookup. False for a dtype the kernels lack, while a first start's builds compile
    (`deferred`: torch's operations meanwhile), and where the operators or the attention kernel
    could not be had (the latter warned once: the cpp kernel's steps then attend by GATHER + SDPA).
    Once True for a dtype and head dim, True for good (noted in `_READY`): a step asks once.
    `kv_int8`: the attention kernel over int8 pools (8-bit KV pages) instead."""
    want = ("i8", head_dim) if kv_int8 and head_dim is not None else head_dim
    found = _READY.get(dtype)
    if found is not None and want in found:
        return True
    if dtype not in ELEM_TYPES:
        return False
    if found is None:
        if deferred():
            return False
        load_gemv(dtype)
    if not ops_loaded():
        return False
    kind = "attention_i8" if kv_int8 else "attention"
    if head_dim is not None and not kernel_ready(kind, dtype, head_dim):
        if deferred():
            return False
        why = load_attention(head_dim, dtype, kv_int8)
        if why is not None:
            if (head_dim, dtype, kv_int8) not in _WARNED:
                _WARNED.add((head_dim, dtype, kv_int8))
                warnings.warn(f"fms_paged: the CPU attention kernel could not be had ({why}); the cpp "
                              "kernel's steps attend by GATHER + SDPA", stacklevel=2)
            return False
    _READY.setdefault(dtype, set()).add(want)
    return True


def require_builds(dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """What a graph traced now needs: wait for this process's background builds (`wait_for_builds`),
    then load the operators and kernels for `dtype` (and `head_dim`) -> `ready`. A graph traced
    before would call torch's fallbacks (or operators not yet registered) for good."""
    wait_for_builds()
    return ready(dtype, head_dim)


@contextlib.contextmanager
def kernel_clock() -> Iterator[Callable[[], int]]:
    """The nanoseconds spent inside the C++ kernels (every call of every thread) while inside:
    `with kernel_clock() as elapsed_ns: ...; elapsed_ns()`. Turns the operators' kernel clock on
    (off by default: a clock read around every kernel call costs every step) and back to what it
    was on leaving. Without operators here, `elapsed_ns()` is 0."""
    if ops() is not None:
        yield lambda: 0
        return
    was_on = torch.ops.fms_paged._kernel_clock(True)
    start = torch.ops.fms_paged._kernel_ns()
    try:
        yield lambda: torch.ops.fms_paged._kernel_ns() - start
    finally:
        torch.ops.fms_paged._kernel_clock(was_on)


def build_all(dtypes: tuple[torch.dtype, ...] = tuple(ELEM_TYPES), head_dims: tuple[int, ...] = (64, 128),
              log=print) -> bool:
    """Build the operators and this CPU's kernels for `dtypes` and `head_dims` into the cache (what
    `fms-paged build-kernels` does at install time), so that a first model starts without a
    compiler run -> whether everything built."""
    for dt in dtypes:  # every kernel's build at once, beside the operators'
        prebuild_kernels(dt)
        for d in head_dims:
            prebuild(ATTENTION_SOURCE, dt, HEAD_DIM=d)
    why = ops()
    log(f"operators (csrc/ops/ops.cpp, layer.cpp): {why or 'built'}")
    ok = why is None
    for dt in dtypes:
        why = load_gemv(dt)
        log(f"GEMV and rows kernels {dt}: {why or 'built'}")
        ok &= why is None
        for d in head_dims:
            why = load_attention(d, dt)
            log(f"attention kernel {dt} head_dim={d}: {why or 'built'}")
            ok &= why is None
    return ok
