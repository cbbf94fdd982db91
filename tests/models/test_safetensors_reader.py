"""The loader's safetensors reader against safetensors' own: the same values, converted as `.to`
converts them, whatever the chunk boundaries; headers that do not describe their data refused."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from fms_paged.models.safetensors_reader import ChunkReader, HeaderError, read_header


@pytest.fixture
def tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    ts = {
        "a": torch.randn(37, 13, generator=g),  # (sizes that are not multiples of a chunk)
        "b": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "c": torch.randn(101, generator=g).to(torch.float16),
        "d": torch.randint(-9, 9, (3, 4), generator=g),
        "e": torch.randn(0, 4, generator=g),
    }
    path = tmp_path / "x.safetensors"
    save_file(ts, path)
    return path


@pytest.mark.parametrize("chunk", [64, 104, 1 << 20])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_reads_what_safetensors_reads(tensors, chunk, dtype):
    ref = load_file(tensors)
    entries = {e.name: e for e in read_header(tensors)}
    assert set(entries) == set(ref)
    reader = ChunkReader(chunk)
    with open(tensors, "rb", buffering=0) as f:
        for name, want in ref.items():
            e = entries[name]
            assert (e.dtype, e.shape) == (want.dtype, tuple(want.shape))
            to = want.dtype if dtype is None or not want.is_floating_point() else dtype
            got = torch.full(want.shape, 7, dtype=to)
            reader.read_into(f, e, got)
            assert torch.equal(got, want.to(to)), name  # bit for bit: the same rounding as .to


def _write(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_bad_headers(tmp_path):
    f = tmp_path / "bad.safetensors"
    _write(f, b"{not json")
    with pytest.raises(HeaderError, match="not JSON"):
        read_header(f)
    _write(f, json.dumps({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 2]}}).encode(), b"xx")
    with pytest.raises(HeaderError, match="'w' has dtype 'Q9'"):
        read_header(f)
    _write(f, json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(), b"x" * 8)
    with pytest.raises(HeaderError, match=r"'w' F32 \[2\] needs 8 bytes"):
        read_header(f)
    _write(f, json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"x" * 4)
    with pytest.raises(HeaderError, match="in 4 bytes of data"):
        read_header(f)
    f.write_bytes(b"\x01")
    with pytest.raises(HeaderError, match="too short"):
        read_header(f)
