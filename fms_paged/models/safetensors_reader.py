"""Reading safetensors files tensor by tensor into tensors the caller already holds.

The loader (`fms_paged.models.hf.load_hf`) builds its model on the meta device, gives each
parameter its final storage, and fills it here: a tensor's bytes are read from the file in chunks
of at most `CHUNK_BYTES` into one reusable buffer and each chunk is converted into its place in the
destination (`copy_`: the same rounding as `.to(dtype)`). Nothing else holds the checkpoint's
values, whatever its dtype: an fp32 checkpoint loaded in bf16 costs the bf16 weights plus the
buffer.

Why not `safetensors.safe_open`: it maps the file, and every page of the mapping that a tensor's
read touches stays in the process's resident set (its peak, `VmHWM`) until the mapping is closed,
so loading a checkpoint through it peaks at the checkpoint's bytes on top of the converted weights
(an fp32 checkpoint into bf16: three times the weights). `read` into a buffer leaves the file's
pages in the page cache, which is not the process's memory.

The format (the safetensors spec): 8 bytes little-endian, the header's length N; N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, the offsets
counted from the end of the header; then the data, little-endian, row-major.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CHUNK_BYTES", "DTYPES", "ChunkReader", "HeaderError", "TensorEntry", "read_header"]

# the buffer a tensor is read through: about a millisecond of reading, small beside any weights
CHUNK_BYTES = 4 << 20
# the header of a safetensors file is bounded by the spec (100 MB)
_MAX_HEADER = 100_000_000

# the spec's dtype names -> torch's
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class HeaderError(ValueError):
    """A safetensors file whose header cannot be read or does not describe its data."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (`offset` from the file's start)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors `file` holds, in the order of their data; HeaderError naming the file and the
    tensor for a header that is not JSON, names a dtype we do not know, or whose offsets do not
    match a tensor's shape or lie outside the file."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{file}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise HeaderError(f"{file}: header length {n} past the file's {size} bytes or the spec's limit")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeaderError(f"{file}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{file}: header is a {type(header).__name__}, expected a JSON object")
    data_start, data_bytes = 8 + n, size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise HeaderError(f"{file}: tensor {name!r} has header {info!r}, expected dtype, shape and "
                              "data_offsets [begin, end]") from None
        if dtype_name not in DTYPES:
            raise HeaderError(f"{file}: tensor {name!r} has dtype {dtype_name!r}; we read {sorted(DTYPES)}")
        dtype = DTYPES[dtype_name]
        want = math.prod(shape) * dtype.itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes
                and end - begin == want):
            raise HeaderError(f"{file}: tensor {name!r} {dtype_name} {list(shape)} needs {want} bytes, its "
                              f"data_offsets are [{begin}, {end}] in {data_bytes} bytes of data")
        entries.append(TensorEntry(name, file, dtype, shape, data_start + begin, want))
    return sorted(entries, key=lambda e: e.offset)


class ChunkReader:
    """Reads tensors' bytes from their files into destination tensors through one reusable buffer
    of `chunk_bytes` (allocated on first use, kept until the reader is dropped)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes < 64:
            raise ValueError(f"ChunkReader: chunk_bytes={chunk_bytes}; expected at least 64")
        if sys.byteorder != "little":  # the format's data is little-endian
            raise RuntimeError("reading safetensors data needs a little-endian machine")
        self.chunk_bytes = chunk_bytes - chunk_bytes % 8  # a whole number of elements of any dtype
        self._buffer: torch.Tensor | None = None

    def scratch(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of scratch memory (uint8): the read buffer's while it is large enough (valid
        until the next read), else a tensor of its own."""
        if nbytes > self.chunk_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._buffer is None:
            self._buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def read_into(self, f, entry: TensorEntry, dst: torch.Tensor, progress=None) -> None:
        """Fill `dst` (contiguous, `entry`'s shape, any dtype and device) with the values of `entry`
        read from the open file `f` (unbuffered, `open(entry.file, "rb", buffering=0)`), converting
        chunk by chunk; `progress.update(n)` for each n bytes read."""
        if tuple(dst.shape) != entry.shape or not dst.is_contiguous():
            raise ValueError(f"read_into: {entry.name!r} is {list(entry.shape)}, destination "
                             f"{list(dst.shape)} (contiguous: {dst.is_contiguous()})")
        if self._buffer is None:
            self._buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        view = memoryview(self._buffer.numpy())
        flat = dst.view(-1)
        item = entry.dtype.itemsize
        per_chunk = self.chunk_bytes // item
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            nbytes = count * item
            _read_exactly(f, entry.offset + start * item, view[:nbytes], entry)
            flat[start:start + count].copy_(self._buffer[:nbytes].view(entry.dtype))
            if progress is not None:
                progress.update(nbytes)


def _read_exactly(f, offset: int, out: memoryview, entry: TensorEntry) -> None:
    f.seek(offset)
    done = 0
    while done < len(out):
        got = f.readinto(out[done:])
        if not got:
            raise HeaderError(f"{entry.file}: tensor {entry.name!r} ends past the end of the file")
        done += got
