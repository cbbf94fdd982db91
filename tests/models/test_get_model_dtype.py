"""`get_model(variant, dtype=)` casts on the meta device, before any weight exists on the device (an
8B model in bf16 is never built in fp32 first): its weights are still those of the fp32 model cast
to the dtype, and its RoPE tables stay fp32."""

import pytest
import torch

from fms_paged import get_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_variant_equals_the_fp32_one_cast(dtype):
    half = get_model(variant="micro", device="cpu", dtype=dtype, seed=0)
    ref = get_model(variant="micro", device="cpu", seed=0).to(dtype)
    for (name, a), b in zip(half.named_parameters(), ref.parameters()):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), name
    assert {b.dtype for b in half.buffers()} == {torch.float32}  # cos/sin tables
