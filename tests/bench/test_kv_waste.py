"""KV waste from the page table (paged) and from the preallocated rows (dense) against an independent
computation from the sequence lengths alone; no cache holds nothing. On the test device (`--device`)."""

import math

import pytest
import torch

from fms_paged.bench.environment import kv_accounting, min_pages
from fms_paged.bench.latency import load_model, make_backend, random_prompts


@pytest.fixture(scope="module")
def model(device):
    return load_model({"variant": "micro", "device": str(device)})


def _expected(lengths, slots_held, c, dtype_bytes=4):
    per_token = 2 * c.nlayers * c.kvheads * c.head_dim * dtype_bytes  # K and V, every layer
    needed = per_token * sum(lengths)
    held = per_token * slots_held
    return needed, held, 100.0 * (held - needed) / held


@pytest.mark.parametrize("lengths", [[1], [16], [17, 5, 33], [40, 3, 16, 31, 2]])
def test_paged_waste_matches_lengths(model, lengths):
    c = model.config
    P = c.page_size
    cache = make_backend(model, "paged", len(lengths), 64, kernel="gather", num_pages=64)
    prompts = random_prompts(lengths, c.src_vocab_size)
    ids = list(range(len(lengths)))
    with torch.inference_mode():
        tokens, positions, step, _ = cache.prefill(ids, prompts)
        model(tokens, positions, step)
    kv = kv_accounting(cache, lengths, c, model.dtype)
    pages = sum(math.ceil(n / P) for n in lengths)  # independent of the page table
    needed, held, waste = _expected(lengths, pages * P, c)
    assert kv["pages_held"] == pages == min_pages(lengths, P)
    assert kv["kv_bytes_needed"] == needed
    assert kv["kv_bytes_held"] == held
    assert kv["kv_waste_pct"] == pytest.approx(waste, abs=1e-12)
    # the host bookkeeping agrees too: pages listed per sequence
    assert sum(len(cache.pm.pages_of(s)) for s in ids) == pages
    # releasing one sequence returns exactly its pages
    cache.release([0])
    kv2 = kv_accounting(cache, lengths[1:], c, model.dtype)
    assert kv2["pages_held"] == pages - math.ceil(lengths[0] / P)


def test_dense_waste_is_the_padding_of_preallocated_rows(model):
    c = model.config
    lengths, max_len = [10, 50, 30], 64
    cache = make_backend(model, "sdpa", len(lengths), max_len)
    kv = kv_accounting(cache, lengths, c, model.dtype)
    needed, held, waste = _expected(lengths, len(lengths) * max_len, c)
    assert (kv["kv_bytes_needed"], kv["kv_bytes_held"]) == (needed, held)
    assert kv["kv_waste_pct"] == pytest.approx(waste)
    assert kv["kv_pool_bytes"] == cache.cache.nbytes == held


def test_no_cache_holds_nothing_and_feeds_the_whole_history(model):
    """No cache: every step runs each sequence's whole history (right-padded; `last` picks each row's
    last token), so its logits equal a plain forward over that history."""
    c = model.config
    cache = make_backend(model, "no-cache", 2, 64)
    prompts = random_prompts([5, 9], c.src_vocab_size)
    with torch.inference_mode():
        tokens, positions, step, last = cache.prefill([0, 1], prompts)
        assert tokens.shape == (2, 9) and positions is None and step is None
        new = torch.tensor([7, 8], device=model.device)
        tokens, _, last = cache.decode([0, 1], new, [5, 9], [True, True])
        got = cache.decode_step(model, tokens, None, last)  # [2, V]
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p + [7 + b]], device=model.device))[0, -1]
            torch.testing.assert_close(got[b], ref, rtol=1e-5, atol=1e-5)
    kv = kv_accounting(cache, [6, 10], c, model.dtype)
    assert (kv["kv_bytes_held"], kv["kv_pool_bytes"]) == (0, 0) and kv["tokens_stored"] == 16
