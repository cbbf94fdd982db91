"""The GEMM kernel (`csrc/kernels/gemm.cpp`, the operator `fms_paged::gemm`): many rows times the
plain row-major weights the GEMV kernel reads, against float64 of the same inputs, on each kernel
build this CPU runs (AVX512_BF16 pairs, fp32 multiply-adds with 16 and 8 lanes, SSE2), and as the
path `Linear` takes past the GEMV's rows with `fms_paged.native.gemm.GEMM == "own"` (no packed copy).

Tolerance: every path sums in fp32 and rounds its output once, so a half-precision output is within
u * |ref| of float64 (u: the dtype's unit roundoff, the rounding of the output) plus fp32's
round-off over K <= 1000 terms of unit-scale products (rtol 1e-5 / atol 1e-4, as
tests/models/test_linear.py states); fp32 outputs within that fp32 term.
"""

from __future__ import annotations

import pytest
import torch

from fms_paged import native
from fms_paged.modules import linear as L
from fms_paged.native import gemm
from tests.models.test_linear import TOL, assert_rounded_from, isas

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _operators():
    why = native.load_gemv(torch.float32)
    if why is not None:
        pytest.skip(f"no C++ operators here: {why}")


def check(got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, **TOL)
    else:
        assert_rounded_from(got, ref)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_against_float64(dtype, isa, monkeypatch):
    """Every row count from 1 to 37 (the panels take calls of any rows: fewer than a register
    tile, whole tiles and every ragged rest), a stack of three weights whose row counts are not
    whole panels (96, 33, 7), K of 33, 97 and 1001 (odd: a vector's tail, a bf16 pair cut in half),
    x rows strided inside a wider tensor, on each build this CPU runs."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    assert native.load_gemm(dtype) is None  # this build's kernel (the CPU's own again below)
    g = torch.Generator().manual_seed(0)
    for K in (33, 97, 1001):
        ws = [(torch.randn(n, K, generator=g) / 16).to(dtype) for n in (96, 33, 7)]
        wide = torch.randn(37, K + 5, generator=g).to(dtype)
        for M in range(1, 38):
            x = wide[:M, 2 : 2 + K]  # row stride K + 5
            got = torch.ops.fms_paged.gemm(x, ws)
            assert got.dtype == dtype and got.shape == (M, 136)
            check(got, torch.cat([x.double() @ w.double().T for w in ws], -1))
    monkeypatch.delenv("FMS_PAGED_CPU_ISA")
    native.load_gemm(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_bits_do_not_depend_on_rows_or_threads(dtype):
    """A row's result is the same bits whatever the other rows of its call (its place in a register
    tile, the chunk of rows it falls in) and on 1, 2 or 3 threads: the sums of a row run in one
    order. 300 rows of K = 640 over 1,536 + 100 weight rows; a call of a part of them (a single
    row on: every call takes the panels, whatever its rows) gives the bits of the 300-row call's."""
    assert native.load_gemm(dtype) is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 640, generator=g).to(dtype)
    ws = [(torch.randn(n, 640, generator=g) / 24).to(dtype) for n in (1536, 100)]
    threads = torch.get_num_threads()

    def on_1_2_3_threads(weights):  # the product on 1, 2 and 3 threads
        outs = []
        try:
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                outs.append(torch.ops.fms_paged.gemm(x, weights))
        finally:
            torch.set_num_threads(threads)
        return outs

    outs = on_1_2_3_threads(ws)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    for rows in (slice(0, 1), slice(7, 12), slice(26, 31), slice(0, 40), slice(7, 50), slice(260, 300)):
        assert torch.equal(torch.ops.fms_paged.gemm(x[rows], ws), outs[0][rows])
    check(outs[0], torch.cat([x.double() @ w.double().T for w in ws], -1))
    # a weight of few panels (200 rows: 4 of 64): the threads split x's rows among them too, each
    # part packing the panel again; the same bits on 1, 2 or 3 threads and in parts of the rows
    w = [(torch.randn(200, 640, generator=g) / 24).to(dtype)]
    split = on_1_2_3_threads(w)
    assert all(torch.equal(out, split[0]) for out in split[1:])
    for rows in (slice(0, 40), slice(90, 200), slice(260, 300)):
        assert torch.equal(torch.ops.fms_paged.gemm(x[rows], w), split[0][rows])
    check(split[0], x.double() @ w[0].double().T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_takes_the_gemm_on_the_plain_weights(dtype, monkeypatch):
    """With GEMM == "own", `Linear` and `linear_cat` run calls past the GEMV's rows through the GEMM
    kernel: no packed copy of any weight is made, and the results are float64's of the same inputs
    (the bias added to the rounded product, as the GEMV path adds it). bf16 calls under 32 rows
    stay on the GEMV kernel (`gemm.OWN_GEMV_MAX_ROWS`)."""
    monkeypatch.setattr(gemm, "GEMM", "own")
    L.configure()
    try:
        g = torch.Generator().manual_seed(2)
        lin = L.Linear(256, 1040, bias=True).requires_grad_(False).to(dtype)
        a, b = (L.Linear(256, n, bias=False).requires_grad_(False).to(dtype) for n in (64, 48))
        gemv_rows = gemm.OWN_GEMV_MAX_ROWS.get(dtype, L.GEMV_MAX_ROWS)
        assert L.cpu_path(torch.zeros(gemv_rows, 256, dtype=dtype), lin.weight) == "gemv"
        for rows in (gemv_rows + 1, 300):
            x = torch.randn(rows, 256, generator=g).to(dtype)
            assert L.cpu_path(x, lin.weight) == "gemm"
            product = x.double() @ lin.weight.double().T
            got = lin(x)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), product + lin.bias.double(), **TOL)
            else:
                assert_rounded_from(got, product + lin.bias.double(), product)
            ya, yb = L.linear_cat(x, [a, b])
            check(ya, x.double() @ a.weight.double().T)
            check(yb, x.double() @ b.weight.double().T)
        assert not any(L.is_packed(m.weight) for m in (lin, a, b))
        assert L.unpacked_bytes(torch.nn.ModuleList([lin, a, b])) == 0  # nothing will be packed
    finally:
        monkeypatch.undo()
        L.configure()


def test_gemm_refuses_bad_weights():
    with pytest.raises(ValueError, match=r"gemm: weight 1 must be a 2-D torch.float32 CPU tensor \[N, 8\]"):
        torch.ops.fms_paged.gemm(torch.zeros(10, 8), [torch.zeros(4, 8), torch.zeros(4, 7)])


@pytest.mark.parametrize("flags,isa,onednn,want", [
    ({"avx2", "avx512f", "avx512_bf16"}, "native", True, "own"),  # Zen 4: AVX-512, no AMX
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "native", True, "packed"),  # AMX
    ({"avx2", "avx512f"}, "avx2", True, "packed"),  # kernels built narrower than the CPU
    ({"avx2", "avx512f"}, "baseline", True, "packed"),
    ({"avx2", "fma", "f16c"}, "native", True, "packed"),  # AVX2 only
    ({"avx2", "avx512f"}, "native", False, "packed"),  # no oneDNN: ATen's GEMM, nothing packed
    ({"asimd", "fp"}, "native", True, "packed"),  # Arm
])
def test_default_gemm_follows_the_cpu(flags, isa, onednn, want, monkeypatch):
    """The GEMM kernel by default only where its kernels are built for AVX-512 and there is no AMX
    (`gemm.default_gemm`'s measured rule)."""
    monkeypatch.setattr(gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(gemm, "isa", lambda: isa)
    monkeypatch.setattr(gemm, "ONEDNN", onednn)
    assert gemm.default_gemm() == want
