"""`get_model`'s random init is seeded without touching the caller's RNG: the weights for a seed are
those drawn right after `torch.manual_seed(seed)` (what get_model did before it scoped its seeding),
and the global RNG's state is the same after the call as before it. On the test device (`--device`)."""

import pytest
import torch

from fms_paged import get_model


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_init_equals_manual_seed_and_leaves_the_global_rng(seed, device):
    torch.manual_seed(seed)  # the reference: the global RNG seeded by hand, drawn as it stands
    ref = get_model(variant="micro", device=device, seed=None)
    torch.manual_seed(1234)
    cpu_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    model = get_model(variant="micro", device=device, seed=seed)
    assert torch.equal(torch.random.get_rng_state(), cpu_state)  # the caller's RNG, untouched
    if cuda_state is not None:
        assert torch.equal(torch.cuda.get_rng_state(device), cuda_state)
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    other = get_model(variant="micro", device=device, seed=seed + 1)
    assert not torch.equal(next(other.parameters()), next(model.parameters()))
