"""Device and dtype selection shared by the model factory, the CLI and the benchmarks."""

from __future__ import annotations

import ctypes

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`"auto"` picks cuda > mps > cpu; anything else is checked to be usable."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a valid torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} requested but MPS is not available on this machine")
    return dev


# Tokens per KV page when none is asked for, by device type. CPU: 64, chosen from a page-size sweep
# (docs/benchmarks.md, "Settled experiments"): with the cpp kernel, which reads keys in blocks of 64
# whatever the page, speed was the same from 16 to 128 tokens per page; 64 keeps the page table 4x
# smaller than 16, while 128 loses more KV to partly filled last pages and most prefix-cache hits.
# Elsewhere 16, vLLM's GPU default (not measured in this project: no GPU has run it).
DEFAULT_PAGE_SIZE = {"cpu": 64}


def default_page_size(device: str | torch.device) -> int:
    return DEFAULT_PAGE_SIZE.get(torch.device(device).type, 16)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}; expected one of {sorted(_DTYPES)}") from None


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_cpu_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back
    to the OS: activations of up to 32 MiB come from the heap, and the heap is not trimmed below
    1 GiB of free space. Without it, each prefill step's buffers are fresh pages again, each a
    page fault on first touch (docs/benchmarks.md has the counts). vLLM's CPU backend gets the
    same from tcmalloc, which its users preload.

    Process-wide and not undone (the process keeps its peak heap), so the library never calls it
    on its own: `fms-paged generate` and the serving benchmark do, and a serving process may.
    -> whether it applied (glibc only)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
