"""GGUF projections held as the file's blocks (`BlockLinear`: Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K)
and computed by the qgemv kernel (csrc/kernels/qgemv.cpp): each row of x quantized to int8 per
block of 32 (scale max|x_b| / 127, rounded to nearest), integer dot products, fp32 sums.

The kernel's error bound, which the kernel tests assert per output: the integer products are exact,
so beside fp32 rounding the only error is x's rounding, at most dx_b / 2 = max|x_b| / 254 per
value of block b: |y - x W^T| <= sum_b (max|x_b| / 254) sum_{i in b} |w_i| (+ fp32 sums' and
the output's own rounding: 1e-5 relative to sum |x| |w|, and bf16's 2^-8 of |y|). The types other
than Q8_0 / Q4_0 are computed as w = a u + b (u the unsigned quants, b an offset: Q4_K / Q5_K's
-dmin m, Q6_K's -32 a, Q5_0's -16 d), two fp32 products a dx (sum u qx) and b dx (sum qx) per
sub-block: their rounding is relative to |a u| + |b| <= |w| + 2 |b|, not to |w|, so the fp32 term
there is 1e-5 of sum |x| (|w| + 2 |b|) (`offsets`: b of each weight). 1e-5 is ~170 ulps of fp32: the
sums' and products' rounding over K <= 768 stays far below it.

Prefill calls (at least TILE_ROWS rows) on a CPU with AVX512_BF16 (the native build here) take
another path: the weights dequantized into bf16 (2^-9 of each weight; a row pair at a time, from
PANEL_ROWS rows a panel of 64 rows at a time) and dotted with x rounded to bf16 (2^-9 of each
value), fp32 sums: |y - x W^T| <= 2^-8 sum |x| |w| (+ the same fp32 and output rounding). An AVX2
build's prefill calls (at least AVX2_PANEL_ROWS rows) dequantize fp32 panels and multiply fp32 x:
nothing but the fp32 and output rounding.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from fms_paged import Engine, SamplingParams, generate, get_model, native  # noqa: E402
from fms_paged.models.gguf import file_summary, layer_kernels  # noqa: E402
from fms_paged.modules.quantized import (  # noqa: E402
    BLOCK_TYPES,
    BLOCK_VALUES,
    BlockEmbedding,
    BlockLinear,
    QuantizationError,
    dequantize_blocks,
    layer_formats,
    qgemv_isa,
    qgemv_kernel,
)
from tests.gguf_files import MIXED, Q, prompt_ids, random_blocks, rel_err, write_gguf  # noqa: E402

TYPES = ("Q8_0", "Q4_0")  # the types held as blocks first
NEW_TYPES = ("Q5_0", "Q4_K", "Q5_K", "Q6_K")  # computed as w = a u + b (module docstring)
ALL_TYPES = TYPES + NEW_TYPES
TILE_ROWS = 4  # (qgemv.cpp) rows from which an AVX512_BF16 build dequantizes bf16 tiles
PANEL_ROWS = 12  # (qgemv.cpp) rows from which it dequantizes panels (panels.h)
AVX2_PANEL_ROWS = 20  # (qgemv.cpp) rows from which an AVX2 build dequantizes fp32 panels
GROUP_ROWS = 8  # (qgemv.cpp) rows up to which the int8 path keeps Q8_0 / Q4_0 / Q4_K / Q6_K calls
GROUP_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")


def tiles(isa: str, rows: int, kind: str) -> bool:
    """Whether a call of `rows` rows over weights of `kind` takes the bf16 tiles (else int8
    activations): from TILE_ROWS rows on an AVX512_BF16 build, but for up to GROUP_ROWS rows of the
    types whose int8 path reads 16 weight rows at a time (AVX-512 VNNI)."""
    grouped = kind in GROUP_TYPES and rows <= GROUP_ROWS and "avx512_vnni" in native.cpu_flags()
    return isa == "native" and "avx512_bf16" in native.cpu_flags() and rows >= TILE_ROWS and not grouped


def isas() -> list[str]:
    """The builds this CPU runs: its own (VNNI where it has it) and the narrower ones."""
    flags = native.cpu_flags()
    return ["native", "baseline"] + (["avx2"] if {"avx2", "f16c"} <= flags else [])


@contextlib.contextmanager
def isa_build(isa: str, dtype: torch.dtype, monkeypatch):
    """The operators run the `isa` build of the qgemv kernel for `dtype` inside, this CPU's own after."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    assert native.load_qgemv(dtype) is None
    try:
        yield
    finally:
        monkeypatch.delenv("FMS_PAGED_CPU_ISA")
        native.load_qgemv(dtype)


def blocks_of(values: np.ndarray, kind: str) -> torch.Tensor:
    """fp32 [N, K] quantized by gguf (llama.cpp's quantizer) -> uint8 blocks [N, K / 32, bytes]."""
    raw = gguf.quants.quantize(values.astype(np.float32), Q[kind])
    n, k = values.shape
    return torch.from_numpy(np.ascontiguousarray(raw)).reshape(n, k // 32, -1)


def weight_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """A weight [n, k] of `kind` as blocks [n, k / block values, bytes]: values ~N(0, 0.05) quantized
    by gguf, or (the K-quants, which gguf does not quantize) random blocks (`random_blocks`); Q4_K /
    Q5_K's packed scales and mins here random bytes (every bit pattern; d, dmin small enough to keep
    the values below ~1), where the model files' are centred."""
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        raw = random_blocks(Q[kind], (n, k), rng).reshape(n, k // BLOCK_VALUES[kind], BLOCK_TYPES[kind])
        if kind != "Q6_K":
            raw[..., 0:4] = rng.uniform(2e-4, 6e-4, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
            raw[..., 4:16] = rng.integers(0, 256, (n, k // 256, 12), dtype=np.uint8)
        return torch.from_numpy(np.ascontiguousarray(raw))
    return blocks_of(rng.normal(0, 0.05, (n, k)).astype(np.float32), kind)


# the bytes of each type's quants (the rest: scales, mins)
QUANT_BYTES = {"Q5_0": slice(2, 22), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176), "Q6_K": slice(0, 192)}


def offsets(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The offset b of each weight (w = a u + b; 0 for Q8_0 / Q4_0, whose paths have none), float64
    [N, K]: the blocks dequantized with every quant zero (u = 0 leaves b)."""
    if kind in TYPES:
        return torch.zeros(blocks.shape[0], blocks.shape[1] * BLOCK_VALUES[kind], dtype=torch.float64)
    zeroed = blocks.clone()
    zeroed[..., QUANT_BYTES[kind]] = 0
    return dequantize_blocks(zeroed, kind)


def fp32_panels(isa: str, rows: int) -> bool:
    """Whether a call of `rows` rows takes an AVX2 build's fp32 panels (an AVX2 build: forced, or
    the native one on a CPU with AVX2 and no AVX-512)."""
    flags = native.cpu_flags()
    avx2_build = isa == "avx2" or (isa == "native" and "avx2" in flags and "avx512f" not in flags)
    return avx2_build and "avx2" in flags and rows >= AVX2_PANEL_ROWS


def kernel_bound(x: torch.Tensor, w: torch.Tensor, kind: str, isa: str = "native") -> torch.Tensor:
    """The path's bound for x [M, K], w [N, K] (float64) -> [M, N]: sum_b (max|x_b| / 254) sum_{i in
    b} |w_i| (int8 activations), 2^-8 sum |x| |w| (bf16 tiles and panels), or nothing beyond the
    callers' fp32 rounding term (fp32 panels)."""
    M, K = x.shape
    if tiles(isa, M, kind):
        return 2.0**-8 * (x.abs() @ w.abs().T)
    if fp32_panels(isa, M):
        return torch.zeros(M, w.shape[0], dtype=x.dtype)
    amax = x.abs().reshape(M, K // 32, 32).amax(-1)  # [M, nb]
    wsum = w.abs().reshape(w.shape[0], K // 32, 32).sum(-1)  # [N, nb]
    return amax / 254 @ wsum.T


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ALL_TYPES)
def test_kernel_within_the_int8_kernel_bound(kind, dtype, isa, monkeypatch):
    """x [M, K] @ blocks^T on each build, for 1, 3, 6 and 20 rows (tiles of 4 and 8 and the rows
    after them; 20: a prefill's path) and weight stacks of odd widths (the last row pair half full),
    K of 10 blocks (AVX-512 takes two a register: 5 pairs) and 11 (a pair half full; the K-quants:
    2 and 3 super-blocks), against float64 of the dequantized weights, within the path's stated
    bound; and gguf's own dequantizer agrees with ours (bit for bit in float64, or, Q4_K / Q5_K,
    whose d sc q - dmin m gguf rounds in fp32, once rounded to fp32)."""
    rng = np.random.default_rng(0)
    widths = (512, 768) if BLOCK_VALUES[kind] == 256 else (320, 352)
    with isa_build(isa, dtype, monkeypatch):
        for K in widths:
            blocks = [weight_blocks(kind, n, K, rng) for n in (37, 64, 5)]
            for b in blocks:
                theirs = gguf.quants.dequantize(b.reshape(b.shape[0], -1).numpy(), Q[kind])
                ours = dequantize_blocks(b, kind)
                if kind in ("Q4_K", "Q5_K"):
                    assert np.array_equal(ours.float().numpy(), theirs.reshape(b.shape[0], K))
                else:
                    assert np.array_equal(ours.numpy(), theirs.astype(np.float64).reshape(b.shape[0], K))
            for M in (1, 2, 3, 6, 8, 20):
                x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
                got = torch.ops.fms_paged.qlinear(x, blocks, None)
                assert got.dtype == dtype and got.shape == (M, 106)
                w64 = torch.cat([dequantize_blocks(b, kind) for b in blocks])
                b64 = torch.cat([offsets(b, kind) for b in blocks])
                x64 = x.double()
                want = x64 @ w64.T
                out_round = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # y stored in bf16
                rounding = 1e-5 * (x64.abs() @ (w64.abs() + 2 * b64.abs()).T) + out_round * want.abs()
                err = (got.double() - want).abs()
                assert (err <= kernel_bound(x64, w64, kind, isa) + rounding).all()
                # the bound is not vacuous: the error is far below |y|
                assert float(err.max()) <= 0.02 * float(want.abs().max())


def test_one_call_of_two_types_within_the_bound():
    """A call holding a Q4_K and a Q6_K weight (a Q4_K_M layer's q and v), whose rows the kernel may
    take by two paths in one call (16 weight rows at a time for one, a row at a time for the other),
    split between threads by rows: each output within the path's bound of float64 (module
    docstring; the same fp32 term as the single-type test), for 1, 2, 3 and 6 rows of x, and for
    PANEL_ROWS and 40 rows, whose panels of 64 weight rows hold rows of both types (130 rows: the
    last panel 2 rows) and, at K = 2560 (1280 steps of bf16 pairs, more than a panel holds), K in
    two blocks of whole super-blocks whose sums wait between them."""
    assert native.load_qgemv(torch.float32) is None
    rng = np.random.default_rng(3)
    for K, (n_k, n_v) in ((512, (40, 24)), (2560, (40, 90))):
        blocks = [weight_blocks("Q4_K", n_k, K, rng), weight_blocks("Q6_K", n_v, K, rng)]
        w64 = torch.cat([dequantize_blocks(blocks[0], "Q4_K"), dequantize_blocks(blocks[1], "Q6_K")])
        b64 = torch.cat([offsets(blocks[0], "Q4_K"), offsets(blocks[1], "Q6_K")])
        for M in (1, 2, 3, 6, PANEL_ROWS, 40):
            x64 = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).double()
            got = torch.ops.fms_paged.qlinear(x64.float(), blocks, None).double()
            want = x64 @ w64.T
            rounding = 1e-5 * (x64.abs() @ (w64.abs() + 2 * b64.abs()).T)
            err = (got - want).abs()
            assert (err <= kernel_bound(x64, w64, "Q4_K") + rounding).all(), (K, M)
            assert float(err.max()) <= 0.02 * float(want.abs().max())


def test_a_prefill_of_many_rows_and_the_bias():
    """A prefill's rows (300, on every thread) through BlockLinear with a bias, against float64."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (96, 256)).astype(np.float32)
    bias = torch.randn(96)
    m = BlockLinear(blocks_of(w, "Q4_0"), "Q4_0", bias)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(2))
    got = m(x)
    w64 = m.dequantized()
    want = x.double() @ w64.T + bias.double()
    assert ((got.double() - want).abs() <= kernel_bound(x.double(), w64, "Q4_0") + 1e-5 * (
        x.double().abs() @ w64.abs().T + bias.double().abs())).all()


def test_refusals_name_the_blocks_expected():
    """Blocks that do not fit x's width are refused naming the shapes each type takes; blocks of
    another size, or a type the kernel does not read (Q4_1: llama.cpp's fallback for rows not a
    multiple of 256 wide in some files, dequantized at load: test_mixed_groups_...), cannot make a
    BlockLinear. (A K-quant row is whole super-blocks by the file's layout: a width not a multiple
    of 256 never comes as Q4_K; llama.cpp writes such rows as Q5_0 / Q8_0, held as blocks too.)"""
    w = weight_blocks("Q4_K", 8, 512, np.random.default_rng(3))
    assert native.load_qgemv(torch.float32) is None
    with pytest.raises(ValueError, match=r"must be GGUF blocks of x's width 288.*144 / 176 / 210\] \(Q4_K"):
        torch.ops.fms_paged.qlinear(torch.randn(2, 288), [w], None)
    with pytest.raises(QuantizationError, match=r"Q4_K blocks as uint8 \[N, K / 256, 144\]"):
        BlockLinear(w[..., :140].contiguous(), "Q4_K")
    with pytest.raises(QuantizationError, match="types read: Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K"):
        BlockLinear(torch.zeros(8, 16, 20, dtype=torch.uint8), "Q4_1")


# the model's logits against the dequantized model's (same file, `gguf_blocks=False`: fp32 sums
# of the exact weights). Per projection the kernel's error is at most max|x_b| / 254 per value
# (asserted above); the activations' rounding (uniform, ~0.6% of a value's spread per
# projection) adds up over two layers of random weights, whose outputs carry no structure that
# would average it out: the logits moved 1.5-2.9% of their largest over Q8_0, Q4_0 and a mix, two
# seeds each, as much as a float64 simulation of the kernel's scheme (the kernel matched that
# simulation to 1e-6 wherever no rounding of x flipped). 5% leaves headroom and still fails a kernel
# that reads a block, a nibble or a scale wrong (errors of 10-100% of the logits).
MODEL_REL = 5e-2


@pytest.mark.parametrize("kind", [*ALL_TYPES, "mixed"])
def test_model_logits_and_engine_against_the_dequantized_model(kind, tmp_path):
    """A llama GGUF of one block type, or "mixed" (a Q4_K_M-like file: q/k Q4_K with v Q6_K in one
    kernel call, gate Q5_K with up Q4_K, head Q6_K, embedding Q8_0): every matrix loads as its blocks
    (projections, embedding and head; no dequantized copy: the model's only fp32 tensors are its
    norms), the one-call C++ forward takes them, logits (the sdpa model and the paged one) within
    MODEL_REL of the dequantized model's, and the engine's greedy tokens from the cpp kernel equal
    the paged model's own."""
    file = tmp_path / "m.gguf"
    write_gguf(file, "llama", MIXED if kind == "mixed" else Q[kind])
    ref = get_model(model_path=file, device="cpu", dtype=torch.float32, gguf_blocks=False)
    dense = get_model(model_path=file, device="cpu", dtype=torch.float32)
    paged = get_model(model_path=file, device="cpu", dtype=torch.float32, attn_impl="paged", page_size=16)
    block_mods = {n: m for n, m in paged.layers.named_modules() if isinstance(m, BlockLinear)}
    assert len(block_mods) == 7 * paged.config.nlayers
    gguf_names = {"query": "attn_q", "key": "attn_k", "value": "attn_v", "dense": "attn_output",
                  "wg": "ffn_gate", "w1": "ffn_up", "w2": "ffn_down"}
    for name, m in block_mods.items():
        want = kind if kind != "mixed" else MIXED[gguf_names[name.rsplit(".", 1)[-1]]].name
        assert m.ggml_type == want, name
    assert isinstance(paged.embedding, BlockEmbedding) and isinstance(paged.head, BlockLinear)
    assert all(p.dim() == 1 for p in paged.parameters())  # the norms' weights alone
    ids = prompt_ids(20)
    with torch.no_grad():
        want = ref(ids)
        assert rel_err(dense(ids), want) <= MODEL_REL
        prompts = [ids[0].tolist(), prompt_ids(9, 3)[0].tolist()]
        tokens = generate(paged, prompts, 8, eos_id=None)
    assert paged.decoder_stack() is not None and paged.logits_stack() is not None  # the one-call forward
    eng = Engine(paged, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, compile=False,
                 kernel="cpp")
    ids_ = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    got: dict[int, list[int]] = {}
    for out in eng.stream():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[i] for i in ids_] == tokens
    formats = layer_formats(paged)
    if kind != "mixed":
        assert formats["layer 0"].startswith(f"GGUF {kind} blocks, fms_paged qgemv"), formats
    else:
        for k in ("Q4_K", "Q5_K", "Q6_K"):
            assert f"GGUF {k} blocks, fms_paged qgemv" in formats["layer 0"], formats
        # `fms-paged info x.gguf`'s per-layer kernels, from the file's table alone
        run = qgemv_kernel()
        assert layer_kernels(file)["layer 0"].split("; ") == [
            f"query, key, dense, w1: GGUF Q4_K blocks, {run}", f"value, w2: GGUF Q6_K blocks, {run}",
            f"wg: GGUF Q5_K blocks, {run}"]
        assert layer_kernels(file)["head"] == f"GGUF Q6_K blocks, {run}"


def test_mixed_groups_stay_dequantized_and_info_names_the_kernel(tmp_path):
    """q/k Q4_0 with v Q8_0 run as blocks together (one call takes both types); a layer whose gate
    is Q4_0 and up a type the kernel does not read (Q4_1) keeps gate/up dequantized (one kernel call
    computes both); the file's summary names the kernel."""
    file = tmp_path / "mix.gguf"
    kinds = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0,
             "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}
    write_gguf(file, "llama", kinds)
    model = get_model(model_path=file, device="cpu", dtype=torch.float32)
    layer = model.layers[0]
    assert isinstance(layer.attn.in_proj.value, BlockLinear) and layer.attn.in_proj.value.ggml_type == "Q8_0"
    assert not isinstance(layer.ff_sub_module.wg, BlockLinear)
    assert isinstance(layer.ff_sub_module.w2, BlockLinear)
    ref = get_model(model_path=file, device="cpu", dtype=torch.float32, gguf_blocks=False)
    ids = prompt_ids(10)
    with torch.no_grad():
        assert rel_err(model(ids), ref(ids)) <= MODEL_REL
    assert "qgemv" in file_summary(file)["kernel"]
    layers = layer_kernels(file)
    run = qgemv_kernel()
    # the kernel's paths as this CPU and build take them: int8 decode rows on the ISA's dot
    # products; prefill on bf16 panels where the native build has AVX512_BF16, fp32 on AVX2 builds
    assert f"int8 activations per block of 32, {qgemv_isa()}" in run
    panels = native.isa() == "native" and {"avx512_bf16", "avx512bw"} <= set(native.cpu_flags())
    assert ("bf16 panels with vdpbf16ps for prefill" in run) == panels
    assert ("fp32 panels for prefill" in run) == fp32_panels(native.isa(), AVX2_PANEL_ROWS)
    assert layers["layer 1"].split("; ") == [
        f"query, key, w2: GGUF Q4_0 blocks, {run}", f"value, dense: GGUF Q8_0 blocks, {run}",
        "wg: Q4_0 held as float32, the float32 GEMV / GEMM",
        "w1: Q4_1 held as float32, the float32 GEMV / GEMM"]
    assert layers["head"] == "GGUF Q8_0 blocks, " + run
