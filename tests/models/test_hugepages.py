"""The loader places CPU weights in memory advised for transparent huge pages
(fms_paged/models/hugepages.py): same values, tied weights still tied, each parameter its own
storage (so saving works), and, on Linux with THP not `never`, every weight inside a mapping the
kernel reports as THP-eligible (/proc/self/smaps)."""

import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fms_paged import get_model
from fms_paged.models import hugepages
from fms_paged.models.hf import load_hf, save_hf_llama

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODE = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else None
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or MODE in (None, "never") or not hugepages.available(),
    reason="transparent huge pages are not on here: the weights are ordinary memory",
)
# a micro model whose weights fill more than one huge page (in bf16 too: embedding 8192 x 128)
BIG = dict(variant="micro", src_vocab_size=8192, emb_dim=128, device="cpu", seed=0)


def thp_eligible(ptr: int) -> bool:
    """Whether the mapping holding address `ptr` is THP-eligible, as /proc/self/smaps says."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {ptr:#x}")


@linux_thp
def test_a_variant_s_weights_are_placed_in_huge_pages_with_the_same_values(monkeypatch):
    placed = get_model(**BIG)
    monkeypatch.setenv("FMS_PAGED_HUGE_PAGES", "0")
    plain = get_model(**BIG)
    assert sum(p.nbytes for p in placed.parameters()) > hugepages.HUGE_PAGE
    for (name, a), b in zip(placed.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
        assert a.is_contiguous() and a.data_ptr() % 64 == 0, name
        assert thp_eligible(a.data_ptr()), name
        if MODE == "madvise":  # (under `always` every anonymous mapping is eligible)
            assert not thp_eligible(b.data_ptr()), name
    # each parameter its own storage, none overlapping
    storages = [p.untyped_storage() for p in placed.parameters()]
    spans = sorted((s.data_ptr(), s.nbytes()) for s in storages)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


@linux_thp
def test_a_checkpoint_loads_into_huge_pages_and_saves_back(tmp_path):
    ref = get_model(**BIG, tie_heads=True)
    save_hf_llama(ref, tmp_path / "a")
    for dtype in (None, torch.bfloat16):  # the checkpoint's fp32, and a cast as it loads
        ours = load_hf(tmp_path / "a", dtype=dtype)
        assert ours.head.weight is ours.embedding.weight
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(a, b.to(dtype or b.dtype)), name
            assert thp_eligible(a.data_ptr()), name
    save_hf_llama(ours, tmp_path / "b")  # safetensors refuses tensors that share a storage
    saved = load_file(tmp_path / "b" / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], ours.embedding.weight)


def test_place_in_huge_pages_moves_values_in_place():
    lin = torch.nn.Linear(1024, 600)  # 2.4 MB of fp32 weight
    before = lin.weight.detach().clone(), lin.bias.detach().clone()
    moved = hugepages.place_in_huge_pages(lin)
    assert moved == (lin.weight.nbytes + lin.bias.nbytes if hugepages.available() else 0)
    assert torch.equal(lin.weight, before[0]) and torch.equal(lin.bias, before[1])
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.requires_grad
    assert hugepages.place_in_huge_pages(torch.nn.Linear(4, 4)) == 0  # under one huge page: left as it is


@pytest.mark.skipif(not hugepages.available(), reason="no MADV_HUGEPAGE here")
def test_arena_hands_out_aligned_tensors_until_full():
    with pytest.raises(ValueError, match="nbytes must be positive, got 0"):
        hugepages.HugePageArena(0)
    arena = hugepages.HugePageArena(1000)
    a = arena.empty((3, 5), torch.float32)
    b = arena.empty((100,), torch.bfloat16)
    assert a.shape == (3, 5) and b.dtype == torch.bfloat16
    assert a.data_ptr() % hugepages.HUGE_PAGE == 0 and b.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + a.nbytes
    a.fill_(1.0), b.fill_(2.0)
    assert a.sum().item() == 15 and b.float().sum().item() == 200
    assert arena.empty((1000,), torch.float32) is None  # past its end
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)
