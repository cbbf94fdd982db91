"""Build and load the project's C++ CPU kernels (`fms_paged/kv/cpu_attention.cpp`,
`fms_paged/modules/cpu_gemv.cpp`), and say which CPU paths they and the GEMMs take here.

A kernel source is compiled on first use with the machine's C++ compiler (`$CXX`, else g++ / c++:
the one inductor needs for compiled FlexAttention as well) into a shared library kept in
`$FMS_PAGED_CACHE_DIR` (default `~/.cache/fms_paged/kernels`), keyed by the source, the flags,
the compiler and the CPU, so later processes load it at once (and a changed source is built
again). The sources include no torch headers (a build stays quick) and use OpenMP from the runtime
torch has loaded already; they are called through ctypes, which releases the GIL.

The instruction set is chosen on the machine, when a kernel is first used: by default a kernel is
built for the CPU it runs on (`-march=native`), so its vectors are that CPU's widest (AVX-512,
else AVX2; NEON on Arm) and its half-precision loads use the conversion instructions that CPU has
(F16C for fp16; bf16 needs only a shift). `$FMS_PAGED_CPU_ISA` builds for less than the CPU has
(`ISAS`): what another machine runs, tested on this one. The storage type of a kernel's tensors
(fp32, bf16 or fp16: `ELEM_TYPES`) is a define of its build: one library per type used.

Calling convention: each kernel takes one argument, a pointer to an `extern "C"` struct of named
fields, mirrored in Python by a `ctypes.Structure` subclass with the same fields (a field set by
name, with its type checked by ctypes: no positional list in which two swapped arguments of one
type would pass unnoticed). The library also exports `<kernel>_layout()`, a string naming the
struct, its size and every field's name, kind and offset; `bind` compares it with the one `layout`
spells for the Python mirror and refuses the library (`LayoutMismatch`) when they differ.
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

# the kernels' calling convention (argument structs and their layout functions) and their vector
# loads and stores, included by each
HEADERS = (Path(__file__).with_name("native_args.h"), Path(__file__).with_name("native_vec.h"))


class LayoutMismatch(RuntimeError):
    """A kernel library whose argument struct is not laid out as its Python mirror."""


class Pointer(ctypes.c_void_p):
    """A struct field holding an address (set from an int: `tensor.data_ptr()`); its subclasses
    name what it points to, for the layout check (`pointer`)."""

    _kind_ = "void*"


@functools.cache
def pointer(pointee: str) -> type[Pointer]:
    """The field type of a pointer to `pointee` (a kind: "f32", "i64", "f32*", ...): kind `pointee*`."""
    name = f"Pointer_{pointee.replace('*', 'p')}"
    return type(name, (Pointer,), {"_kind_": pointee + "*", "__slots__": ()})


_SCALAR_KINDS = {ctypes.c_int32: "i32", ctypes.c_int64: "i64", ctypes.c_float: "f32"}

# the tensor dtypes the kernels read and write: dtype -> (the C++ type a build is made for with
# -DFMS_ELEM=..., its kind in a layout: `pointer(kind)`); declared in native_args.h
ELEM_TYPES = {torch.float32: ("float", "f32"), torch.bfloat16: ("fms_bf16", "bf16"),
              torch.float16: ("fms_f16", "f16")}


def elem(dtype: torch.dtype) -> tuple[str, str]:
    """(C++ type, kind) of a kernel's tensors of `dtype`; ValueError for a dtype the kernels lack."""
    if dtype not in ELEM_TYPES:
        raise ValueError(f"the CPU kernels take {', '.join(str(d) for d in ELEM_TYPES)}, not {dtype}")
    return ELEM_TYPES[dtype]


def layout(struct: type[ctypes.Structure]) -> str:
    """`struct`'s layout as a kernel library's `<kernel>_layout()` spells it:
    "Name size: field:kind@offset ..." (kinds i32, i64, f32; a pointer's is its pointee's + "*",
    pointees also bf16 and f16)."""
    fields = []
    for name, ctype in struct._fields_:
        kind = ctype._kind_ if issubclass(ctype, Pointer) else _SCALAR_KINDS.get(ctype)
        if kind is None:
            raise TypeError(f"{struct.__name__}.{name}: a {ctype.__name__} field; the kernels' structs hold "
                            f"{', '.join(t.__name__ for t in _SCALAR_KINDS)} and native.pointer(...) fields")
        fields.append(f" {name}:{kind}@{getattr(struct, name).offset}")
    return f"{struct.__name__} {ctypes.sizeof(struct)}:{''.join(fields)}"


def bind(lib: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> ctypes._CFuncPtr:
    """`lib.<name>`, a kernel taking `const struct*` and returning an int, once the library's
    `<name>_layout()` equals `layout(struct)`; raises `LayoutMismatch` naming the first field that
    differs otherwise (the C++ struct and its Python mirror were changed apart)."""
    layout_fn = getattr(lib, f"{name}_layout", None)
    if layout_fn is None:
        raise LayoutMismatch(f"{lib._name} exports no {name}_layout(): built from a source older than "
                             f"{struct.__name__}'s typed calling convention")
    layout_fn.argtypes, layout_fn.restype = [], ctypes.c_char_p
    built, expected = layout_fn().decode(), layout(struct)
    if built != expected:
        b, e = built.split(), expected.split()
        i = next((i for i, (x, y) in enumerate(zip(b, e)) if x != y), min(len(b), len(e)))
        got, want = (b[i] if i < len(b) else "nothing"), (e[i] if i < len(e) else "nothing")
        raise LayoutMismatch(
            f"{lib._name}: the kernel's argument struct is laid out as {built!r}, its Python mirror as "
            f"{expected!r} (first difference: {got!r} where {want!r} was expected); the C++ struct and "
            f"the ctypes.Structure must declare the same fields in the same order")
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [ctypes.POINTER(struct)], ctypes.c_int
    return fn


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


def load(source: Path, **defines: int | str) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built from `source` for `isa()` with `-DNAME=value` for each define (an int, or
    a C++ name such as `FMS_ELEM="fms_bf16"`; built now, or found built) -> (library, None), or
    (None, why not)."""
    return _load(source, isa(), **defines)


@functools.cache
def _load(source: Path, which: str, **defines: int | str) -> tuple[ctypes.CDLL | None, str | None]:
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, g++ or c++)"
    flags = _flags(which) + [f"-I{HEADERS[0].parent}"] + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    made_from = [source.read_text(), *(h.read_text() for h in HEADERS), " ".join(flags), version, _cpu_id()]
    key = hashlib.sha256("\n".join(made_from).encode())
    tag = "".join(f"_{k.lower()}{v}" for k, v in sorted(defines.items()))
    tag += "" if which == "native" else f"_{which}"
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
