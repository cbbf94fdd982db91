"""RoPE tables grown on demand (`fms_paged.modules.positions.RotaryEmbedding`): none at load on the
CPU, rows grown in whole blocks to the highest position a step reads, the values of a row the same
however the table grew, a position past `max_expected_seq_len` refused, and the cpp kernel's
operators refusing a position past a table's rows instead of reading past it."""

from __future__ import annotations

import math

import pytest
import torch

from fms_paged import native
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.modules.positions import RotaryEmbedding, rope_inv_freq

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 512}


@pytest.mark.parametrize("head_dim, theta, scaling",
                         [(64, 10_000.0, None), (80, 1e6, SCALING), (16, 500.0, None)])
def test_grown_tables_equal_one_growth_and_float64(head_dim, theta, scaling):
    """Rows grown step by step (first position 3, then 1500, then 2999) equal, bit for bit, the rows
    of a table grown once to the whole length (each block of rows is computed by itself, the same
    call whatever the growth), and a float64 reference of the same fp32 angles within 2 ulps of 1
    (fp32 cos / sin of an fp32 argument: both libraries' results are within an ulp of the true value)."""
    rope = RotaryEmbedding(head_dim, 3000, theta, scaling)
    rope.reset_buffers("cpu")
    assert rope.cos.shape == (0, head_dim)  # none at load
    for top in (3, 1500, 2999):
        cos, sin = rope(torch.tensor([[0, top]]))
        assert rope.cos.shape[0] > top and cos.shape == (1, 2, 1, head_dim)
    whole = RotaryEmbedding(head_dim, 3000, theta, scaling)
    whole.reset_buffers("cpu")
    whole.ensure(3000)
    assert torch.equal(rope.cos, whole.cos) and torch.equal(rope.sin, whole.sin)
    # the reference: the angle p * inv_freq rounded to fp32 (the tables' formula), then cos / sin in float64
    inv = rope_inv_freq(head_dim, theta, scaling)
    angle = torch.outer(torch.arange(3000).float(), inv).double()  # [L, D/2]
    ref_cos = angle.cos().repeat_interleave(2, dim=1)
    ref_sin = torch.stack([-angle.sin(), angle.sin()], dim=-1).flatten(1)
    tol = 2 * 2.0**-23
    assert (whole.cos.double() - ref_cos).abs().max() <= tol
    assert (whole.sin.double() - ref_sin).abs().max() <= tol


def test_growth_in_blocks_keeps_the_rows_held():
    """A growth computes only the new blocks: the rows held before are the same tensor values (a
    poisoned row stays poisoned), the table grows in whole blocks at least doubling, and never
    past max_seq_len."""
    B = RotaryEmbedding.BLOCK
    rope = RotaryEmbedding(32, 5 * B + 7, 10_000.0)
    rope.reset_buffers("cpu")
    rope.ensure(10)
    assert rope.cos.shape[0] == B
    rope.cos[5].fill_(float("nan"))  # not recomputed by a later growth
    rope.ensure(B + 1)
    assert rope.cos.shape[0] == 2 * B and rope.cos[5].isnan().all() and not rope.cos[6].isnan().any()
    rope.ensure(2 * B + 1)
    assert rope.cos.shape[0] == 4 * B  # doubling
    rope.ensure(4 * B + 1)
    assert rope.cos.shape[0] == 5 * B + 7  # capped
    with pytest.raises(IndexError, match=r"position 5127 is past the model's max_expected_seq_len=5127"):
        rope.ensure(5 * B + 8)


def test_model_has_no_tables_at_load_and_refuses_positions_past_its_length():
    model = LLaMA(LLaMAConfig(src_vocab_size=64, emb_dim=32, nheads=2, nlayers=1, multiple_of=16,
                              max_expected_seq_len=40, rope_local_theta=100.0,
                              layer_types=("sliding_attention",), sliding_window=8))
    model.reset_buffers()
    assert [r.cos.numel() + r.sin.numel() for r in model.ropes] == [0, 0]
    model(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 39]]))
    assert all(r.cos.shape[0] == 40 for r in model.ropes)  # a block, capped at the length
    with pytest.raises(IndexError):
        model(torch.tensor([[1]]), torch.tensor([[40]]))


def test_operators_refuse_a_position_past_the_tables():
    """decoder_logits and decode_greedy check the highest position they read against each table's
    rows (IndexError naming it) instead of reading past them, and decode_greedy before any step
    writes a key."""
    why = native.load_gemv(torch.float32) or native.load_attention(16, torch.float32)
    if why is not None:
        pytest.skip(f"no C++ operators here: {why}")
    torch.manual_seed(0)
    model = LLaMA(LLaMAConfig(src_vocab_size=64, emb_dim=32, nheads=2, nlayers=1, multiple_of=16,
                              max_expected_seq_len=4096)).eval()
    model.reset_buffers()
    stack = model.logits_stack()
    assert stack is not None
    cos, sin = model.rope_tables(10)
    assert cos[0].shape[0] == RotaryEmbedding.BLOCK
    P, pages = 16, 4
    pools = [torch.zeros(1, 2, pages * P * 2, 16)], [torch.zeros(1, 2, pages * P * 2, 16)]
    table = torch.arange(1, pages + 1, dtype=torch.int32)[None]
    top = RotaryEmbedding.BLOCK  # one past the rows held
    with pytest.raises(IndexError, match=f"position {top} is past RoPE table 0's {top} rows"):
        torch.ops.fms_paged.decoder_logits(stack, torch.tensor([[1]]), torch.tensor([[top]]), cos, sin,
                                           *pools, torch.tensor([0]), table, torch.tensor([[0, top, 1, 0]]),
                                           P, None)
    before = pools[0][0].clone()
    with pytest.raises(IndexError, match=f"position {top} is past RoPE table 0's"):
        torch.ops.fms_paged.decode_greedy(stack, torch.tensor([1]), torch.tensor([top - 2]),
                                          torch.tensor([0]), cos, sin, *pools,
                                          torch.arange(1, 66, dtype=torch.int32)[None], P, 3)
    assert torch.equal(pools[0][0], before)  # refused before any step wrote
    assert math.isfinite(float(model.rope_tables(top + 1)[0][0][top].sum()))
