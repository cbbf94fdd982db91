"""Build and load the project's C++ CPU kernels (`fms_paged/kv/cpu_attention.cpp`,
`fms_paged/modules/cpu_gemv.cpp`).

A kernel source is compiled on first use with the machine's C++ compiler (`$CXX`, else g++ / c++:
the one inductor needs for compiled FlexAttention as well) into a shared library kept in
`$FMS_PAGED_CACHE_DIR` (default `~/.cache/fms_paged/kernels`), keyed by the source, the flags,
the compiler and the CPU, so later processes load it at once (and a changed source is built
again). The sources include no torch headers (a build stays quick) and use OpenMP from the runtime
torch has loaded already; they are called through ctypes, which releases the GIL.

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

# the kernels' calling convention (argument structs and their layout functions), included by each
HEADER = Path(__file__).with_name("native_args.h")


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


def layout(struct: type[ctypes.Structure]) -> str:
    """`struct`'s layout as a kernel library's `<kernel>_layout()` spells it:
    "Name size: field:kind@offset ..." (kinds i32, i64, f32; a pointer's is its pointee's + "*")."""
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
    flags = _flags() + [f"-I{HEADER.parent}"] + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}"
    made_from = [source.read_text(), HEADER.read_text(), " ".join(flags), version, _cpu_id()]
    key = hashlib.sha256("\n".join(made_from).encode())
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
