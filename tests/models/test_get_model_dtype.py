"""`get_model(variant, dtype=)` casts on the meta device, before any weight exists on the device (an
8B model in bf16 is never built in fp32 first), so its random weights are drawn in the dtype itself:
the same initialization as the fp32 variant's (the draws themselves may differ between torch builds:
torch 2.13's CPU build draws the fp32 values rounded, 2.11's does not), with RoPE tables in fp32."""

import pytest
import torch

from fms_paged import get_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_variant_is_drawn_in_its_dtype_like_the_fp32_one(dtype, device):
    half = get_model(variant="micro", device=device, dtype=dtype, seed=0)
    ref = get_model(variant="micro", device=device, seed=0)
    for (name, a), b in zip(half.named_parameters(), ref.parameters()):
        assert a.dtype == dtype and a.shape == b.shape, name
        a, b = a.detach().float(), b.detach()
        if b.std() == 0:  # a constant init (norm weights of ones)
            assert torch.equal(a, b.to(dtype).float()), name
        else:  # the same distribution: mean and spread agree to sampling error
            assert abs(a.std() / b.std() - 1) < 0.1 and abs(a.mean() - b.mean()) < 0.1 * b.std(), name
    assert {b.dtype for b in half.buffers()} == {torch.float32}  # cos/sin tables
