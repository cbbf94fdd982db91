"""generate(): cache use, per-sequence EOS and lengths, seeded sampling, streaming (on the test
device, `--device`)."""

import pytest
import torch

from fms_paged import generate, get_model
from fms_paged.generation.sampling import sample


@pytest.fixture(scope="module")
def micro(device):
    return get_model(variant="micro", device=device, seed=0)


def _greedy_no_cache(model, prompt, n):
    """Independent reference: re-run the whole sequence each step, no KV cache."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq], device=model.device))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_cached_greedy_equals_no_cache_reference(micro):
    prompts = [[5, 6, 7], list(range(10, 40)), [9]]
    got = generate(micro, prompts, max_new_tokens=12, eos_id=None)
    assert got == [_greedy_no_cache(micro, p, 12) for p in prompts]


def test_per_sequence_eos(micro):
    prompts = [[5, 6, 7], list(range(10, 40))]
    free = generate(micro, prompts, max_new_tokens=10, eos_id=None)
    eos = free[0][3]  # a token the first sequence emits at step 4
    got = generate(micro, prompts, max_new_tokens=10, eos_id=eos)
    assert got[0] == free[0][: free[0].index(eos) + 1]
    stop1 = free[1].index(eos) + 1 if eos in free[1] else 10
    assert got[1] == free[1][:stop1]


def test_only_new_tokens_returned(micro):
    out = generate(micro, [[1, 2, 3, 4]], max_new_tokens=5, eos_id=None)
    assert len(out) == 1 and len(out[0]) == 5


def test_sampling_is_seeded(micro):
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(micro, prompts, 16, temperature=1.0, top_k=50, top_p=0.9, seed=7, eos_id=None)
    b = generate(micro, prompts, 16, temperature=1.0, top_k=50, top_p=0.9, seed=7, eos_id=None)
    c = generate(micro, prompts, 16, temperature=1.0, top_k=50, top_p=0.9, seed=8, eos_id=None)
    assert a == b
    assert a != c


def test_streaming_callback(micro):
    seen = []
    out = generate(micro, [[1, 2], [3, 4, 5]], 6, eos_id=None, on_token=lambda i, t: seen.append((i, t)))
    for i in range(2):
        assert [t for j, t in seen if j == i] == out[i]


def test_top_k_one_is_greedy(device):
    logits = torch.randn(4, 100, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    assert torch.equal(sample(logits, temperature=0.7, top_k=1, generator=g), logits.argmax(-1))


def test_top_p_keeps_only_nucleus(device):
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]], device=device))
    g = torch.Generator(device=device).manual_seed(0)
    draws = {int(sample(logits, 1.0, top_p=0.8, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
