"""The fused blocks (`torch.ops.fms_paged.decoder_stack`, `CppStep.run_blocks`; a decode step's
whole forward, `torch.ops.fms_paged.decoder_logits`, `CppStep.forward_model`) against
Hugging Face transformers (fp32) and against the blocks' modules on the same decode steps, for
every family we load (their variants: q/k/v bias, q/k norms, sliding windows, soft-caps, Gemma's
(1 + w) norms, sandwich norms and GeGLU, Granite's residual multiplier): the logits of each step,
and the K/V each step ASSIGNs.

fp32: the two paths compute the same products in other orders (RMSNorm's sum, 1/sqrt against
rsqrt): logits within 1e-4 of magnitude-1 values. bf16 / fp16: every intermediate is rounded where
the modules round it, so the paths differ by a few of the dtype's ulps where a rounding lands on
the other side: the greedy token agrees on nearly every row. The engine's token equality with
dense `generate` (tied to transformers) on every family runs through the fused block as well
(tests/engine/test_families.py: the cpp kernel's eager steps, prefill and decode, run the fused
blocks).
"""

import contextlib

import pytest
import torch

from fms_paged import get_model, native
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.kernels.cpp import CppStep
from fms_paged.modules import linear
from tests.conftest import HF_FAMILIES, gemm_kind

P = 16


def decode_logits(model, fused: bool, prompts: list[list[int]], steps: int, monkeypatch):
    """Prefill `prompts` (the modules), then `steps` greedy decode steps of all of them at once, with
    the fused block or the modules -> (logits of each decode step [steps, B, V], the keys the
    sequences hold, the token each decode step took [B, steps])."""
    calls, forward_call = [0], CppStep.forward_model

    def counted(self, *args):
        calls[0] += self.fused  # (a step set not fused runs the modules)
        return forward_call(self, *args) if fused else None

    monkeypatch.setattr(CppStep, "forward_model", counted)  # a decode step's one operator call
    if not fused:
        monkeypatch.setattr(CppStep, "run_blocks", lambda self, *args: None)
    cache = PagedCache(model, len(prompts), 128, kernel="cpp")
    ids, out = list(range(len(prompts))), []
    with torch.inference_mode():
        tokens, positions, step, last = cache.prefill(ids, prompts)
        step.fused = False  # the prefill through the modules either way: both paths decode from one state
        nxt = model(tokens, positions, step).flatten(0, 1)[last].argmax(-1)
        fed = [nxt]
        lengths = [len(p) for p in prompts]
        for _ in range(steps):
            tokens, positions, step = cache.decode(ids, nxt, lengths, [True] * len(ids))
            assert step.fused
            logits = model(tokens, positions, step)[:, -1]  # [B, V]
            out.append(logits.float())
            nxt, lengths = logits.argmax(-1), [n + 1 for n in lengths]
            fed.append(nxt)
    assert calls[0] == steps
    # the slots the sequences hold (the rest of the pool is stale: never zeroed for this kernel)
    slots = torch.cat([torch.tensor(cache.pm.pages_of(s))[torch.arange(n) // P] * P + torch.arange(n) % P
                       for s, n in zip(ids, lengths)])
    return torch.stack(out), [k[0, :, slots].float() for k in cache.k_pools], torch.stack(fed[:-1], 1)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_matches_the_modules(family, dtype, hf_family, monkeypatch):
    hf, path = hf_family(family)
    model = get_model(model_path=path, device="cpu", dtype=dtype, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    fused, kf, fed = decode_logits(model, True, prompts, 20, monkeypatch)
    plain, kp, _ = decode_logits(model, False, prompts, 20, monkeypatch)
    if dtype == torch.float32:
        # transformers on each whole sequence (prompt and the tokens the fused steps took): the
        # logits of every decode step, to 1e-4 of their scale
        for b, p in enumerate(prompts):
            with torch.no_grad():
                ref = hf(torch.tensor([p + fed[b].tolist()])).logits[0, len(p):]  # [steps, V]
            assert ((fused[:, b] - ref).abs().max() / ref.abs().max()).item() < 1e-4, b
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
        for a, b in zip(kf, kp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        scale = plain.abs().amax(-1, keepdim=True)
        assert ((fused - plain).abs() / scale).max() < 0.05
        agree = (fused.argmax(-1) == plain.argmax(-1)).float().mean().item()
        assert agree >= 0.9, agree


def prefill_blocks(model, prompts: list[list[int]], fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' output (fp32) on one prefill step of `prompts` on a fresh cache, by the fused
    operator or by the modules, and the keys that step wrote [layers, Hkv, tokens, D] (fp32)."""
    cache = PagedCache(model, len(prompts), 128, kernel="cpp")
    tokens, positions, step, _ = cache.prefill(list(range(len(prompts))), prompts)
    x, ropes = model.embed(tokens, positions)
    step = step.prepare()
    if fused:
        out = step.run_blocks(model, x, ropes)
    else:
        out = x
        for layer in model.layers:
            out = layer(out, *ropes[layer.rope_index], step)
    return out.float(), torch.stack([k[0, :, step.slots].float() for k in cache.k_pools])


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_one_call_forward_is_the_two_call_path_bit_for_bit(family, hf_family, monkeypatch):
    """`LLaMA.forward` on a step of the cpp kernel is one operator call (`fms_paged::decoder_logits`:
    the embedding times its scale, the RoPE rows, the blocks, the final norm, the head, the logits'
    scaling and soft-cap) whose logits are the model's other eager path's bit for bit (the lookups,
    scales and soft-cap in Python, `fms_paged::decoder_stack`, the norm and head modules), in bf16:
    on a prefill step of two chunks with `logits_at` and on the decode step after it. Gemma 2
    scales its embedding by a tensor of its dtype and soft-caps its logits; Granite scales by a
    float and divides its logits."""
    _, path = hf_family(family)
    model = get_model(model_path=path, device="cpu", dtype=torch.bfloat16, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (21, 9)]
    calls, forward_call = [0], CppStep.forward_model

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cache = PagedCache(model, 2, 128, kernel="cpp")
        with monkeypatch.context() as mp, torch.inference_mode():
            def counted(self, *args):
                calls[0] += 1
                return forward_call(self, *args) if fused else None

            mp.setattr(CppStep, "forward_model", counted)
            tokens, positions, step, last = cache.prefill([0, 1], prompts)
            first = model(tokens, positions, step, logits_at=last)  # [2, V]
            lengths = [len(p) for p in prompts]
            tokens, positions, step = cache.decode([0, 1], first.argmax(-1), lengths, [True] * 2)
            return first, model(tokens, positions, step)[:, -1]

    (pf, df), (pp, dp) = run(True), run(False)
    # every call offered to the one-call path, which has the ends
    assert calls[0] == 4 and model.logits_stack() is not None
    assert torch.equal(pf, pp) and torch.equal(df, dp)


def test_bad_arguments_raise():
    """A typed error naming the bad argument, before anything is written to the pools: a stack's
    weights and specs when it is made, a step's tensors at each call, and a weight whose storage was
    swapped for another shape since the stack was made."""
    model = get_model(variant="micro", attn_impl="paged", page_size=P, device="cpu")
    D, n = model.config.head_dim, model.config.nlayers
    cache = PagedCache(model, 2, 64, kernel="cpp")
    kp, vp = cache.k_pools, cache.v_pools
    x, cos = torch.randn(2, model.config.emb_dim), torch.zeros(2, D)
    chunks = torch.tensor([(-1, 0, 1, 0), (-1, 0, 1, 1)])
    weights = [torch.empty(0) if w is None else w for layer in model.layers for w in layer.fused_weights()]
    W = len(weights) // n
    swapped = [w.detach().clone() for w in weights]  # (not inference tensors: their .data can be set)

    def stack(**kw):
        args = dict(weights=weights, head_dim=D, rope_index=[0] * n, scales=[D**-0.5] * n, windows=[0] * n,
                    softcaps=[0.0] * n, sinks=[None] * n, eps=1e-5, unit_offset=False,
                    residual_multiplier=1.0, activation=0)
        return torch.classes.fms_paged.DecoderStack(*{**args, **kw}.values())

    def call(s=None, **kw):
        args = dict(x=x, cos=[cos], sin=[cos], k_pools=kp, v_pools=vp, slots=torch.zeros(2, dtype=torch.long),
                    page_table=cache.backend.view.page_table, chunks=chunks, page_size=P)
        return torch.ops.fms_paged.decoder_stack(stack() if s is None else s, *{**args, **kw}.values())

    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))  # loads the operators and the kernels for fp32
        for p in (*kp, *vp):
            p.zero_()
        before = [p.clone() for p in kp]
        assert call().shape == x.shape
        # the stack
        bad = list(weights)
        bad[W + 9] = bad[9][:, :8].contiguous()  # layer 1's output projection
        wrong_shape = r"layer 1: the weights do not make one decoder block .* o \(\d+, 8\)"
        with pytest.raises(ValueError, match=wrong_shape):
            stack(weights=bad)
        bad = list(weights)
        bad[4] = torch.zeros(model.config.nheads * D)  # a q bias without k and v ones
        with pytest.raises(ValueError, match=r"layer 0: .*q/k/v biases all or none"):
            stack(weights=bad)
        bad = list(weights)
        bad[W + 12] = bad[W + 12].double()
        wrong_dtype = r"layer 1: every weight must be .* torch.float32 .* got gate torch.float64"
        with pytest.raises(ValueError, match=wrong_dtype):
            stack(weights=bad)
        with pytest.raises(ValueError, match=rf"2 layers \(rope indices\) need {2 * W} weights"):
            stack(weights=weights[:W])
        with pytest.raises(ValueError, match=r"activation=3; expected 0 \(silu\) or 1 \(gelu_tanh\)"):
            stack(activation=3)
        with pytest.raises(ValueError, match=r"softcap=-1.0; expected 0.0 \(none\)"):
            stack(softcaps=[0.0, -1.0])
        # the step
        with pytest.raises(ValueError, match=r"slot 100000 of row 1 is outside layer 0's pools' \d+ slots"):
            call(slots=torch.tensor([0, 100000]))
        with pytest.raises(ValueError, match=r"slot -3 of row 0 is negative"):
            call(slots=torch.tensor([-3, 0]))
        with pytest.raises(ValueError, match=r"x must be contiguous CPU rows \[M, \d+\] .* torch.float64"):
            call(x=x.double())
        with pytest.raises(ValueError, match=rf"RoPE table 0: cos and sin must be contiguous fp32 \[2, {D}"):
            call(cos=[torch.zeros(3, D)], sin=[torch.zeros(3, D)])
        with pytest.raises(ValueError, match=r"layer 1 reads RoPE table 1 of 1"):
            call(stack(rope_index=[0, 1]))
        with pytest.raises(ValueError, match=r"2 layers need as many k_pools and v_pools, got 1 and 2"):
            call(k_pools=kp[:1])
        # a weight swapped for another shape after the stack was made
        made = stack(weights=swapped)
        with torch.inference_mode(False):
            swapped[W + 9].data = torch.zeros(4, 4)
        made_with = r"layer 1's o is now torch.float32 \(4, 4\); the stack was made with torch.float32 \(\d+"
        with pytest.raises(ValueError, match=made_with):
            call(made)
        # the ends of a one-call forward (decoder_logits)
        tokens = torch.tensor([[1], [2]])
        ends = dict(stack=stack(), tokens=tokens, positions=tokens, cos_tables=[torch.zeros(64, D)],
                    sin_tables=[torch.zeros(64, D)], k_pools=kp, v_pools=vp,
                    slots=torch.zeros(2, dtype=torch.long), page_table=cache.backend.view.page_table,
                    chunks=chunks, page_size=P, logits_at=None)
        with pytest.raises(ValueError, match=r"the stack has no ends \(DecoderStack\.set_ends\)"):
            torch.ops.fms_paged.decoder_logits(*ends.values())
        emb, C = model.embedding.weight, model.config.emb_dim
        with pytest.raises(ValueError, match=rf"set_ends: .* got torch.float32 \({emb.shape[0]}, {C}\), "
                                             rf"torch.float64 \({C},\)"):
            ends["stack"].set_ends(emb, 1.0, False, model.dec_norm.weight.double(), model.head.weight, 1.0,
                                   0.0)
        with pytest.raises(ValueError, match=r"logits_scaling=0.0, final_softcap=-1.0; expected a non-zero"):
            ends["stack"].set_ends(emb, 1.0, False, model.dec_norm.weight, model.head.weight, 0.0, -1.0)
        ends["stack"].set_ends(emb, 1.0, False, model.dec_norm.weight, model.head.weight, 1.0, 0.0)
        with pytest.raises(ValueError, match=r"tokens and positions must be int64 \[B, S\] alike, got "
                                             r"torch.int64 \(2, 1\) and torch.int32"):
            torch.ops.fms_paged.decoder_logits(*{**ends, "positions": tokens.int()}.values())
        assert torch.ops.fms_paged.decoder_logits(*ends.values()).shape == (2, 1, model.head.weight.shape[0])
        # only the null page's slot 0 was written (by the calls that succeeded)
        assert all(torch.equal(a[:, :, P:], b[:, :, P:]) for a, b in zip(kp, before))


def test_stack_follows_the_model(hf_family):
    """The model's kept DecoderStack computes with the weights the model has now: after a weight or
    a q/k/v bias is changed in place, a projection is replaced by a new parameter, or the model is
    converted to another dtype, the fused blocks equal the modules on a prefill of two chunks."""
    _, path = hf_family("qwen2")
    model = get_model(model_path=path, device="cpu", dtype=torch.float32, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 9)]

    def both():
        assert linear.serves(model.embedding.weight.dtype)  # the operators' GEMV and rows kernels loaded
        with torch.inference_mode():
            (fused, _), (plain, _) = (prefill_blocks(model, prompts, f) for f in (True, False))
        return ((fused - plain).abs().max() / plain.abs().max()).item()

    assert both() < 1e-5
    first = model.decoder_stack()
    attn = model.layers[-1].attn
    with torch.no_grad():
        attn.in_proj.key.bias.add_(0.5)  # in place: the same stack sees it
        model.layers[0].ff_sub_module.w2.weight.mul_(-1.0)
    assert model.decoder_stack() is first and both() < 1e-5
    attn.dense.weight = torch.nn.Parameter(torch.randn_like(attn.dense.weight) * 0.05)  # a new parameter
    assert model.decoder_stack() is not first and both() < 1e-5
    model.to(torch.bfloat16)
    model.reset_buffers()  # the RoPE tables in fp32 again, as a bf16 model loads them
    assert both() < 0.02  # bf16: a few of its ulps at the output's scale


def isas() -> list[str]:
    """The kernel builds this CPU runs: its own and the narrower ones (see tests/kv/test_cpu_kernel.py)."""
    flags = native.cpu_flags()
    return ["native", "baseline"] + (["avx2"] if {"avx2", "f16c"} <= flags else [])


@contextlib.contextmanager
def isa_build(isa: str, dtype: torch.dtype, monkeypatch):
    """The operators run the `isa` build of the GEMV and rows kernels for `dtype` (the attention's:
    from each cache's creation on) inside, this CPU's own again after."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    native.load_gemv(dtype)
    try:
        yield
    finally:
        monkeypatch.delenv("FMS_PAGED_CPU_ISA")
        native.load_gemv(dtype)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
@pytest.mark.parametrize("dtype,isa,kind", [(torch.float32, "native", "packed")]
                         + [(torch.bfloat16, isa, "packed") for isa in isas()]
                         + [(torch.float32, "native", "own"), (torch.bfloat16, "native", "own"),
                            (torch.bfloat16, "baseline", "own")])
def test_fused_blocks_take_any_rows(family, dtype, isa, kind, hf_family, monkeypatch):
    """The operator takes any number of rows: on a prefill step of two chunks (45 tokens: past the
    GEMV kernel's rows, so the GEMMs project them: oneDNN's on packed copies, or the GEMM kernel on
    the plain weights), the blocks' output and the keys they write equal the modules' (fp32: 1e-4;
    bf16: within a few of its ulps of the output's scale), and in fp32 the fused step's logits at
    every prompt token are transformers' on each prompt alone (1e-4 of their scale). bf16 on each
    kernel build this CPU runs (its rows kernel's vectors: 16 lanes, 8, SSE2)."""
    hf, path = hf_family(family)
    model = get_model(model_path=path, device="cpu", dtype=dtype, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 15)]
    with torch.inference_mode(), isa_build(isa, dtype, monkeypatch), gemm_kind(kind):
        w = model.layers[0].attn.dense.weight
        assert kind == "packed" or linear.cpu_path(torch.zeros(45, w.shape[1], dtype=dtype), w) == "gemm"
        outs, keys = zip(*(prefill_blocks(model, prompts, fused) for fused in (True, False)))
    if dtype == torch.float32:
        with torch.inference_mode():
            logits = model.logits(outs[0])[0]  # [T, V]: the fused blocks' output through the head
        start = 0
        for p in prompts:
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0]  # [n, V]
            got = logits[start : start + len(p)]
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
            start += len(p)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(keys[0], keys[1], rtol=1e-5, atol=1e-5)
    else:
        assert ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()) < 0.02
        assert ((keys[0] - keys[1]).abs().max() / keys[1].abs().max()) < 0.02


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_operator_is_torchs(dtype, isa, monkeypatch):
    """`fms_paged::argmax` (greedy sampling on the CPU: the rows kernel) gives torch.argmax's index
    for every row, on each kernel build this CPU runs: widths that are not whole vectors or shorter
    than one, many ties (the first wins), NaNs in the vectors' part and the tail (the first NaN
    wins), a row of -inf, and SmolLM2's vocabulary."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(), isa_build(isa, dtype, monkeypatch):
        for shape in [(1, 49152), (3, 1000), (2, 5), (4, 17), (1, 16), (2, 3, 40)]:
            x = torch.randn(*shape, generator=g).to(dtype)
            assert torch.equal(torch.ops.fms_paged.argmax(x), x.argmax(-1)), shape
        x = (torch.randn(5, 100, generator=g) * 3).round().to(dtype)  # each row's max tied
        x[1, 50] = x[1, 98] = float("nan")
        x[2] = float("-inf")
        x[3, 99] = float("nan")
        assert torch.equal(torch.ops.fms_paged.argmax(x), x.argmax(-1))
        with pytest.raises(ValueError, match=r"argmax: x must be contiguous CPU rows \[\.\.\., n > 0\]"):
            torch.ops.fms_paged.argmax(torch.zeros(3, 0, dtype=dtype))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_takes_the_rows_kernel_where_it_is_loaded(dtype, unit_offset, isa, monkeypatch):
    """`RMSNorm` on the CPU runs the rows kernel's norm (`fms_paged::rms_norm`, one operator call)
    where that kernel is loaded for its dtype: the module's output is the operator's, and within
    the fp32 round-off of the sum of squares of the torch formula it runs elsewhere (fp32: 2e-6
    relative; half precision: one of the dtype's ulps, where a rounding lands on the other side).
    A weight that wants its gradient keeps the torch formula (the operator has no backward)."""
    from fms_paged.modules.norm import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5, unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g) * 0.5 + (0.0 if unit_offset else 1.0))
    norm = norm.to(dtype)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    op, calls = torch.ops.fms_paged.rms_norm, []

    def counted(*args):
        calls.append(args)
        return op(*args)

    with isa_build(isa, dtype, monkeypatch):
        monkeypatch.setattr(torch.ops.fms_paged, "rms_norm", counted)
        with torch.inference_mode():
            got = norm(x)
            assert len(calls) == 1 and torch.equal(got, op(x, norm.weight, 1e-5, unit_offset))
            with monkeypatch.context() as mp:
                mp.setattr(native, "kernel_ready", lambda *args: False)
                ref = norm(x)  # the torch formula
        ulp = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
        assert ((got.float() - ref.float()).abs() <= ulp * ref.float().abs() + 1e-6).all()
        y = norm(x.float().requires_grad_().to(dtype))  # autograd: the torch formula
        y.float().sum().backward()
        assert len(calls) == 1 and norm.weight.grad is not None and y.grad_fn is not None


def test_a_models_first_forward_computes_what_later_ones_do(monkeypatch):
    """In a process where no kernel is loaded yet, a CPU model's first forward (whose first operator
    is a norm, ahead of any projection) loads the rows kernel for its norms as the projections load
    theirs, so it takes the paths every later forward takes: fp32 logits bit for bit the same (the
    norm's torch formula sums the squares in another order: ~1e-5 apart)."""
    if (why := native.ops()) is not None:
        pytest.skip(f"no operators here: {why}")
    monkeypatch.setattr(native, "_READY", {})  # no kernel loaded in this "process" yet
    monkeypatch.setattr(native, "_REGISTERED", {})
    model = get_model(variant="micro", attn_impl="sdpa", device="cpu", dtype=torch.float32)
    op, calls = torch.ops.fms_paged.rms_norm, []
    monkeypatch.setattr(torch.ops.fms_paged, "rms_norm", lambda *args: calls.append(1) or op(*args))
    tokens = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        first, second = model(tokens), model(tokens)
    assert calls and len(calls) % 2 == 0  # every norm of both forwards
    assert torch.equal(first, second)
