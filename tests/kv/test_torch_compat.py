"""Guards for the oldest torch the GPU machines run (2.11; this project pins 2.13 on the CPU)."""

import torch

from fms_paged.kv import kernels


def test_flex_probe_gives_query_key_value_separate_buffers(monkeypatch):
    """torch 2.11's inductor lowers CPU flex_attention only when q, k and v are different buffers
    ("Unsupported for now if query, key, value are the same buffer"): a probe passing one tensor
    three times reported flex unavailable there, and "auto" fell back to gather."""
    seen = []

    def fake_compile(fn, **kw):
        def call(q, k, v, **kwargs):
            seen.append({t.untyped_storage().data_ptr() for t in (q, k, v)})
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return call

    monkeypatch.setattr(kernels.torch, "compile", fake_compile)
    assert kernels.probe_compiled_flex(torch.device("cpu")) is None
    assert seen and len(seen[0]) == 3
