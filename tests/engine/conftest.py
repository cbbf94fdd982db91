"""The engine tests' models: dense and paged `micro` on the same weights (page size 16), on the test
device (`--device`)."""

import pytest

from fms_paged import get_model


@pytest.fixture(scope="module")
def models(device):
    dense = get_model(variant="micro", device=device, seed=0)
    paged = get_model(variant="micro", device=device, seed=0, attn_impl="paged", page_size=16)
    return dense, paged
