"""Guards for the oldest torch the GPU machines run (2.11; this project pins 2.13 on the CPU)."""

import pytest
import torch
import torch._dynamo

from fms_paged.kv import kernels
from fms_paged.kv.kernels import flex


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


@pytest.mark.parametrize("per_call_limit", [True, False], ids=["compile-argument", "raised-around-calls"])
def test_a_step_compiles_past_eight_shapes_and_the_process_limits_stay(monkeypatch, per_call_limit):
    """`compile_shape_variants` lets one compiled function take 12 shapes (Dynamo's default allows
    8; it is told to fail, not fall back to eager, at its limit), through torch.compile's own
    `recompile_limit` (torch 2.13) or, on a torch without it, limits raised around each call and
    restored. Either way a function compiled plainly still meets the default limit."""
    if per_call_limit and not flex._PER_CALL_LIMIT:
        pytest.skip("this torch.compile has no recompile_limit argument")
    monkeypatch.setattr(flex, "_PER_CALL_LIMIT", per_call_limit)
    seen = []

    def double(x):
        return x * 2

    def twice(x):  # the function compiled plainly: the process's default limit
        return x * 2

    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=True):
        step = flex.compile_shape_variants(double, fullgraph=True, dynamic=False, backend="eager")
        for n in range(1, 13):  # 12 static shapes: 12 graphs
            assert torch.equal(step(torch.ones(n)), torch.full((n,), 2.0))
            config = torch._dynamo.config
            seen.append((config.recompile_limit, config.accumulated_recompile_limit))
        assert set(seen) == {(8, 256)}  # between calls: the process's limits
        plain = torch.compile(twice, fullgraph=True, dynamic=False, backend="eager")
        with pytest.raises(Exception, match="recompile_limit"):
            for n in range(1, 13):
                plain(torch.ones(n))
