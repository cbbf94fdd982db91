"""The engine's pool size: KV bytes // page bytes, page bytes from shapes, the KV bytes from the
CPU KV space (env, fraction of RAM, default) with the host's free memory pinned by the test, and on
the test device (`--device`) from its free memory (pinned) less a measured activation peak.

The CPU KV space is the CPU's alone: those tests build their model on the CPU whatever the device."""

import pytest
import torch

from fms_paged import get_model
from fms_paged.kv import budget as budget_mod
from fms_paged.kv.budget import CPU_KV_SPACE_ENV, KVBudgetError, kv_cache_budget, page_bytes
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.kernels import flex_max_pages
from tests.conftest import gemm_kind


def test_page_bytes_7b_fp16():
    # K and V, 32 layers, 32 kv heads, head_dim 128, 16 tokens, 2 bytes: 8 MiB per page
    assert page_bytes(32, 32, 128, 16, torch.float16) == 2 * 32 * 32 * 128 * 16 * 2 == 8 << 20


@pytest.fixture
def micro(monkeypatch):
    monkeypatch.delenv(CPU_KV_SPACE_ENV, raising=False)
    monkeypatch.setattr(budget_mod, "free_memory_bytes", lambda device: 3 << 30)
    # linear_impl="torch": no packed weight copies to leave room for (tested below)
    model = get_model(variant="micro", device="cpu", page_size=16, linear_impl="torch")
    c = model.config
    return model, 2 * c.nlayers * c.kvheads * c.head_dim * c.page_size * 4


def test_cpu_kv_space_sources(micro, monkeypatch):
    model, per_page = micro
    b = kv_cache_budget(model, 64, 256)  # default: 4 GiB, at most half the free 3 GiB
    assert b.page_bytes == per_page and b.num_pages == (3 << 29) // per_page
    assert kv_cache_budget(model, 64, 256, kv_memory_fraction=0.25).num_pages == (3 << 28) // per_page


@pytest.mark.parametrize("kind", ["packed", "own"])
def test_cpu_budget_leaves_room_for_packed_weights(kind, monkeypatch):
    """Packed CPU weight copies (`fms_paged.modules.linear`) are made on first use, after the pool
    is sized: the budget counts the RAM they will take as used until they exist. With the GEMM
    kernel on the plain weights ("own") there are none to leave room for."""
    monkeypatch.delenv(CPU_KV_SPACE_ENV, raising=False)
    free = 1 << 30
    monkeypatch.setattr(budget_mod, "free_memory_bytes", lambda device: free)
    model = get_model(variant="micro", device="cpu", page_size=16)
    c = model.config
    per_page = 2 * c.nlayers * c.kvheads * c.head_dim * c.page_size * 4
    # every projection and the LM head (the embedding is not a Linear), fp32
    proj = sum(p.numel() * 4 for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    with gemm_kind(kind):
        unpacked = proj if kind == "packed" else 0
        b = kv_cache_budget(model, 64, 256, kv_memory_fraction=0.5)
        assert b.num_pages == (free - unpacked) // 2 // per_page
        with torch.no_grad():
            model(torch.randint(0, c.src_vocab_size, (1, 300)))  # 300 rows: every projection packs (packed)
        assert kv_cache_budget(model, 64, 256, kv_memory_fraction=0.5).num_pages == free // 2 // per_page
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "0.5")
    b = kv_cache_budget(model, 64, 256, kv_memory_fraction=0.25)  # the environment wins
    assert b.num_pages == (1 << 29) // per_page and CPU_KV_SPACE_ENV in b.source


def test_budget_on_the_test_device(device, monkeypatch):
    """CPU: the default KV space (4 GiB, at most half the free RAM), no activation term. CUDA / MPS:
    `kv_memory_fraction` (default 0.9) of the free memory less the activation peak of a forward at
    max_num_batched_tokens, measured (> 0), on CUDA at most the pages Triton's flex kernels
    address; a budget below one sequence is refused, naming the fraction to raise."""
    monkeypatch.delenv(CPU_KV_SPACE_ENV, raising=False)
    free = 3 << 30
    monkeypatch.setattr(budget_mod, "free_memory_bytes", lambda dev: free)
    model = get_model(variant="micro", device=device, page_size=16, linear_impl="torch")
    c = model.config
    per_page = 2 * c.nlayers * c.kvheads * c.head_dim * c.page_size * 4
    b = kv_cache_budget(model, 64, 256)
    assert b.page_bytes == per_page and b.device == str(model.device)
    if device.type == "cpu":
        assert b.activation_bytes == 0 and b.num_pages == min(4 << 30, free // 2) // per_page
        return
    assert b.activation_bytes > 0
    assert b.num_pages == (int(free * 0.9) - b.activation_bytes) // per_page
    half = kv_cache_budget(model, 64, 256, kv_memory_fraction=0.5)
    assert half.num_pages == (int(free * 0.5) - half.activation_bytes) // per_page
    if device.type == "cuda":  # a pool past 2**31 elements a layer: capped (budget), refused (given)
        most = flex_max_pages(c.kvheads, c.head_dim, c.page_size)
        free = (most + 10) * per_page * 2
        capped = kv_cache_budget(model, 64, 256)
        assert capped.num_pages == most and "capped" in capped.source
        paged = get_model(variant="micro", device=device, page_size=16, attn_impl="paged")
        with pytest.raises(ValueError, match=f"num_pages={most + 1}; expected at most {most}"):
            PagedCache(paged, 2, 64, num_pages=most + 1, kernel="flex")
        free = 3 << 30
    free = half.activation_bytes // 2  # less than the activation peak alone
    with pytest.raises(KVBudgetError, match="raise kv_memory_fraction"):
        kv_cache_budget(model, 64, 256, kv_memory_fraction=1.0)


def test_bad_values_and_refusal(micro, monkeypatch):
    model, per_page = micro
    with pytest.raises(ValueError, match="kv_memory_fraction=1.5"):
        kv_cache_budget(model, 64, 256, kv_memory_fraction=1.5)
    monkeypatch.setenv(CPU_KV_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match="FMS_PAGED_CPU_KV_SPACE='lots'"):
        kv_cache_budget(model, 64, 256)
    monkeypatch.setenv(CPU_KV_SPACE_ENV, str(10 * per_page / 2**30))  # 10 pages: 144 tokens
    with pytest.raises(KVBudgetError, match="max_model_len<=144"):
        kv_cache_budget(model, 64, 256)
    assert kv_cache_budget(model, 64, 144).num_pages == 10
