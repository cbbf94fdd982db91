"""Quantize on load (`get_model(quantization="int8" | "int4")`, `fms_paged.modules.quantized`):
each quantized projection against a float64 product with its dequantized weight, the model's
logits against the same model holding the dequantized weights in full precision, the refusals,
and the engine's paged steps on a quantized model against dense generate() of it and of the
dequantized model."""

from __future__ import annotations

import random

import pytest
import torch

from fms_paged import Engine, SamplingParams, generate, get_model
from fms_paged.modules.linear import Linear
from fms_paged.modules.quantized import (
    QuantizationError,
    QuantizedLinear,
    check_scheme,
    describe,
    quantize_model,
)
from fms_paged.parallel import TensorParallelError, shard

SCHEMES = [("int8", 128), ("int4", 32), ("int4", 64)]  # micro's K=64: int4 groups of 32 and 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("scheme", "group"), [("int8", 128), ("int4", 32), ("int4", 128), ("int4", 256)])
def test_quantized_linear_against_float64_of_dequantized_weight(scheme, group, dtype):
    """y = x @ deq(W)^T + b for x [2, 3, 512], N=48 (3 of int4's 16-row packs), in float64 as
    the reference. Bound per output: fp32, the kernel's fp32 sums over K=512 products:
    |err| <= 1e-5 * sum_k |x_k w_k| (a few hundred ulps of 2^-24 accumulated); bf16, the output
    rounded to bf16 (2^-8 relative; fp16: 2^-11) after fp32 sums: |err| <= 2^-7 * sum_k |x_k w_k|. The weight
    also stays within its quantization step of the original (int8: scale / 2 per channel; int4:
    scale / 2 per group, plus the zero point's rounding in the dtype)."""
    torch.manual_seed(0)
    lin = Linear(512, 48, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    q = QuantizedLinear(lin.weight, lin.bias, scheme, group)
    x = torch.randn(2, 3, 512, dtype=dtype)
    deq = q.dequantized()  # [N, K] float64
    ref = x.double() @ deq.T + lin.bias.double()
    scale = x.double().abs() @ deq.abs().T
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    y = q(x)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    assert ((y.double() - ref).abs() <= tol * scale + 1e-6).all()
    w = lin.weight.double()
    step = (w.abs().amax(1, keepdim=True) / 127 if scheme == "int8"
            else (w.reshape(48, -1, group).amax(-1) - w.reshape(48, -1, group).amin(-1)).repeat_interleave(
                group, 1) / 15)
    assert ((deq - w).abs() <= step * 0.5 * 1.02 + 1e-3 * w.abs().amax()).all()
    assert not any(t.is_floating_point() and t.shape == lin.weight.shape for t in q.buffers())  # no fp copy


def dequantized_copy(quantized: torch.nn.Module, **kw) -> torch.nn.Module:
    """The same model (`get_model(**kw)`; default: micro) with each quantized projection replaced
    by a `Linear` holding its dequantized weight (rounded to the model's dtype)."""
    ref = get_model(**(kw or {"variant": "micro"}))
    qmods = dict(quantized.named_modules())
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, Linear) and isinstance(qmods.get(name), QuantizedLinear):
                m.weight.copy_(qmods[name].dequantized(m.weight.dtype))
    return ref


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
def test_model_logits_equal_the_dequantized_model(scheme, group):
    """micro in fp32, dense (sdpa): logits of the quantized model against the model holding its
    dequantized weights (the same numbers, computed by the full-precision paths) within 1e-4 of
    the logits' largest magnitude (fp32 sums in another order through 2 layers); the one-call C++
    forward declines for it; `describe` names each layer's format and kernel; the head stays fp32."""
    model = get_model(variant="micro", quantization=scheme, quantization_group_size=group)
    assert model.config.quantization == scheme
    assert all(layer.fused_weights() is None for layer in model.layers)
    ref = dequantized_copy(model)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(tokens), ref(tokens)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    rows = describe(model)
    kernel = "_weight_int8pack_mm" if scheme == "int8" else f"g{group}, aten _weight_int4pack_mm_for_cpu"
    assert all(kernel in r["format"] for r in rows if r["layer"] != "head") and len(rows) == 2 * 7 + 1
    assert rows[-1]["format"].startswith("float32") and type(model.head) is Linear


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "int4"), ("qwen2", "int8")])
def test_gguf_file_quantized_on_load(tmp_path, arch, scheme):
    """A GGUF file (Q8_0 blocks, dequantized on load) quantized again on load: logits against the
    same file's model holding the dequantized weights, within 1e-4 of their largest magnitude
    (fp32, as above); qwen2 brings the q/k/v biases through the quantized projections."""
    gguf_files = pytest.importorskip("tests.gguf_files")
    file = tmp_path / f"{arch}.gguf"
    gguf_files.write_gguf(file, arch, gguf_files.Q.Q8_0)
    model = get_model(model_path=file, dtype=torch.float32, quantization=scheme)
    assert model.config.quantization == scheme
    assert isinstance(model.layers[0].attn.in_proj.query, QuantizedLinear)
    ref = dequantized_copy(model, model_path=file, dtype=torch.float32, gguf_blocks=False)
    tokens = gguf_files.prompt_ids()
    with torch.no_grad():
        got, want = model(tokens), ref(tokens)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_refusals_name_the_reason():
    """What the kernels cannot do is refused before the model changes, saying why."""
    with pytest.raises(QuantizationError, match="does not divide .*K=64"):
        get_model(variant="micro", quantization="int4")  # default group 128 > micro's K=64
    with pytest.raises(QuantizationError, match=r"group size 16.*\(32, 64, 128, 256\)"):
        get_model(variant="micro", quantization="int4", quantization_group_size=16)
    with pytest.raises(QuantizationError, match="expected one of"):
        get_model(variant="micro", quantization="fp8")
    with pytest.raises(QuantizationError, match="CPU kernels.*cuda"):
        check_scheme("int8", 128, torch.device("cuda"))
    model = get_model(variant="micro", kvheads=1, head_dim=8)  # k/v: N=8, not a multiple of 16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizationError, match="N=8 .*multiple of 16"):
        quantize_model(model, "int4", 32)
    assert model.config.quantization is None and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items())  # unchanged
    q = get_model(variant="micro", quantization="int8")
    with pytest.raises(QuantizationError, match="bfloat16.*float32"):
        q.layers[0].ff_sub_module.w2(torch.randn(1, 128, dtype=torch.bfloat16))
    with pytest.raises(TensorParallelError, match="quantized"):
        shard(q, 0, 2)  # (refused before any collective: no process group needed)


@pytest.mark.parametrize(("scheme", "group"), [("int8", 128), ("int4", 32)])
def test_engine_runs_a_quantized_model(scheme, group):
    """Paged engine steps (batched prefill and decode, 6 requests) on the quantized micro model in
    fp32: each request's greedy tokens equal dense generate() of the quantized model alone (the
    same kernels: exact), and those of the dequantized-weights model on at least 90% of the tokens
    (fp32 sums in another order may flip a near-tie of this random model's logits)."""
    kw = dict(quantization=scheme, quantization_group_size=group)
    paged = get_model(variant="micro", attn_impl="paged", **kw)
    dense = get_model(variant="micro", **kw)
    ref = dequantized_copy(dense)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    eng = Engine(paged, max_num_seqs=4, max_num_batched_tokens=32, num_pages=16, compile=False,
                 max_model_len=128)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    got: dict[int, list[int]] = {}
    for out in eng.stream():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    same = total = 0
    for rid, p in zip(ids, prompts):
        assert got[rid] == generate(dense, [p], 12, eos_id=None)[0]
        want = generate(ref, [p], 12, eos_id=None)[0]
        same += sum(a == b for a, b in zip(got[rid], want))
        total += len(want)
    assert same >= 0.9 * total
