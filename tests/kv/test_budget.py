"""Memory budget: pages that fit = (free * fraction - reserve) // page bytes, page bytes from shapes."""

import pytest
import torch

from fms_paged import get_model
from fms_paged.kv import budget as budget_mod
from fms_paged.kv.budget import memory_budget, page_bytes


def test_page_bytes_7b_fp16():
    # K and V, 32 layers, 32 kv heads, head_dim 128, 16 tokens, 2 bytes: 8 MiB per page
    assert page_bytes(32, 32, 128, 16, torch.float16) == 2 * 32 * 32 * 128 * 16 * 2 == 8 << 20


def test_budget_counts_pages(monkeypatch):
    model = get_model(variant="micro", device="cpu")
    monkeypatch.setattr(budget_mod, "free_memory_bytes", lambda device: 1 << 30)
    b = memory_budget(model, fraction=0.5, reserve_bytes=1 << 20)
    c = model.config
    per_page = 2 * c.nlayers * c.kvheads * c.head_dim * c.page_size * 4
    assert b.page_bytes == per_page
    assert b.num_pages == ((1 << 29) - (1 << 20)) // per_page
    assert b.tokens == b.num_pages * c.page_size


def test_budget_never_negative(monkeypatch):
    model = get_model(variant="micro", device="cpu")
    monkeypatch.setattr(budget_mod, "free_memory_bytes", lambda device: 10)
    assert memory_budget(model).num_pages == 0
    with pytest.raises(ValueError, match="fraction"):
        memory_budget(model, fraction=1.5)
