"""8-bit KV pages on the test device (`--device`): what a GPU run (`make gpu-check`, which runs the
tests that take the `device` fixture) adds to tests/kv/test_kv_quant.py, whose CPU-only tests never
see CUDA. The kernel "auto" picks for 8-bit pages on the device (the cpp kernel for int8 on the CPU;
elsewhere, and for fp8, the gather path: flex refuses 8-bit pages) reads them as the float64
definition of attention over the pages' dequantized keys and values does, and greedy decoding with
8-bit pages stays close to 16/32-bit pages, with the bounds test_kv_quant.py states.
"""

import pytest
import torch

from fms_paged import Engine, SamplingParams, get_model, native
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.quant import storage_dtype
from tests.kv.test_kv_quant import EIGHT_BIT, attends_as_reference


# fp32 round-off of softmax-weighted sums of a few dozen terms of magnitude ~1 (test_kv_quant.py's
# 1e-5); on CUDA, SDPA's fp32 kernels sum in blocks of another order and TF32 may serve the
# gather's products: 1e-3 there, still far below a misread page's O(1) error
def tolerance(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-3


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_auto_kernel_on_8bit_pages_matches_float64_of_dequantized(name, device):
    """A prefill of two sequences (13 and 70 tokens: page boundaries, part pages), then a decode
    row each, through the kernel "auto" picks on the device: its attention outputs against the
    float64 reference over the same pages (test_kv_quant.attends_as_reference)."""
    model = get_model(variant="micro", attn_impl="paged", device=device, dtype=torch.float32, nlayers=1,
                      page_size=8, kv_cache_dtype=name).eval()
    cache = PagedCache(model, 2, 128, kernel="auto", kv_cache_dtype=name)
    v = cache.backend.view
    assert v.k_pools[0].dtype == storage_dtype(name, torch.float32) and v.k_scales[0] is not None
    own = device.type == "cpu" and name == "int8" and native.compiler() is not None
    assert cache.kernel.name == ("cpp" if own else "gather"), cache.kernel.name
    attends_as_reference(cache, torch.float32, tolerance(device), 0.0)


@pytest.mark.parametrize("name,share", [("int8", 0.9), ("fp8_e4m3", 0.5)])
def test_engine_greedy_on_8bit_pages_close_to_32bit_pages(name, share, device):
    """Greedy decoding of the default model on the device with 8-bit pages against fp32 pages (the
    kernel "auto" picks for each), 4 prompts x 24 tokens. Measure: the tokens each request generates
    before its first mismatch, summed, over all 96 (one near-tie flips the rest of a request, so
    this counts conservatively). int8 keeps >= 90%; fp8 e4m3 (3 mantissa bits: each key and value
    off by up to 2^-4 relative) >= 50% on this random-ish tiny model. Every page comes back at the
    end. The teacher-forced fidelity over real text (perplexity, top-1) is docs/benchmarks.md's
    measurement."""
    model = get_model(attn_impl="paged", device=device, dtype=torch.float32)
    prompts = [[1, 450, 996, 1354, 1701], [1, 432, 1204, 975, 278, 1366], [1, 1103, 13, 2981], [1, 306, 626]]
    outs = {}
    for kv in ("auto", name):
        eng = Engine(model, 4, 256, num_pages=64, kv_cache_dtype=kv)
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
        got = {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        outs[kv] = [got[i] for i in ids]
        eng.reset_prefix_cache()
        assert eng.pm.num_free_pages == eng.pm.num_pages - 1
    agree = sum(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(outs["auto"], outs[name]))
    assert agree >= share * 4 * 24, (agree, outs)
