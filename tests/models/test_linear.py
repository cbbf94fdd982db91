"""The packed CPU linear (`fms_paged.modules.linear`) against `F.linear` on the same weights.

Every test here runs with oneDNN's packed GEMM past the GEMV's rows (`packed_gemm`), whichever
GEMM this CPU takes by default (`fms_paged.native.gemm.default_gemm`); tests/models/test_gemm.py
tests the GEMM kernel on the plain weights.

Tolerance: oneDNN and MKL sum the K products in different orders; fp32 round-off over K <= 1024
terms of unit-scale values stays far below rtol 1e-5 / atol 1e-4. In bf16 and fp16 the reference
is float64 from the same half-precision inputs: every path sums in fp32 and rounds its output
once, so an output is within u * |ref| of it (u: the dtype's unit roundoff) plus that fp32 term.
"""

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fms_paged import get_model, native
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.modules import linear as L
from tests.conftest import gemm_kind

TOL = dict(rtol=1e-5, atol=1e-4)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture(autouse=True)
def packed_gemm():
    """oneDNN's packed GEMM past the GEMV's rows inside each test: the paths this module tests."""
    with gemm_kind("packed"):
        yield


def assert_rounded_from(got: torch.Tensor, ref: torch.Tensor, rounded: torch.Tensor | None = None) -> None:
    """`got` (half precision) is its dtype's rounding of `ref` (float64), up to fp32 round-off; with
    `rounded`, an intermediate that was rounded to the dtype too (its error adds u * |rounded|)."""
    err = (got.double() - ref).abs()
    bound = UNIT_ROUNDOFF[got.dtype] * ref.abs() + TOL["rtol"] * ref.abs() + TOL["atol"]
    if rounded is not None:
        bound = bound + UNIT_ROUNDOFF[got.dtype] * rounded.abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} beyond the dtype's rounding"


def isas() -> list[str]:
    """The kernel builds this CPU runs: its own and the narrower ones (see tests/kv/test_cpu_kernel.py)."""
    flags = native.cpu_flags()
    return ["native", "baseline"] + (["avx2"] if {"avx2", "f16c"} <= flags else [])


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 5, L.GEMV_MAX_ROWS])
def test_gemv_in_half_precision(dtype, rows, isa, monkeypatch):
    """The GEMV kernel on bf16 / fp16 x and weights (a stack of three, widths that are not whole
    vectors or register tiles) on each build this CPU runs, against float64 of the same inputs."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 250, generator=g).to(dtype)
    ws = [(torch.randn(n, 250, generator=g) / 16).to(dtype) for n in (96, 33, 7)]
    got = L.gemv(x, ws)
    assert got.dtype == dtype and got.shape == (rows, 136)
    assert_rounded_from(got, torch.cat([x.double() @ w.double().T for w in ws], -1))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_row_bits_do_not_depend_on_the_calls_rows(dtype, isa, monkeypatch):
    """A row's GEMV output is the same bits whether its call has 1 or up to GEMV_MAX_ROWS rows, at
    any place among them (its register tile's shape changes, not the order of its sums), on each
    build: a speculative verify's rows compute what decoding each alone does. K = 250 leaves a
    tail past whole vectors."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(L.GEMV_MAX_ROWS, 250, generator=g).to(dtype)
    ws = [(torch.randn(n, 250, generator=g) / 16).to(dtype) for n in (96, 33, 7)]
    alone = torch.cat([L.gemv(x[r : r + 1], ws) for r in range(len(x))])
    for m in range(2, len(x) + 1):
        for start in (0, len(x) - m):
            assert torch.equal(L.gemv(x[start : start + m], ws), alone[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_bits_do_not_depend_on_the_threads(dtype, rows):
    """Which thread computes a block of output columns (each starts on its own share, claimed in
    chunks; the first done takes the others' last chunks) leaves every output bit as one thread's:
    a stack of weights of many chunks on 1, 2 and 3 threads, against float64 as well."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    ws = [(torch.randn(n, 576, generator=g) / 24).to(dtype) for n in (1536, 1536, 100)]
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(L.gemv(x, ws))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    ref = torch.cat([x.double() @ w.double().T for w in ws], -1)
    if dtype == torch.float32:
        torch.testing.assert_close(outs[0].double(), ref, **TOL)
    else:
        assert_rounded_from(outs[0], ref)


@pytest.mark.parametrize("fp32_copy", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, L.GEMV_MAX_ROWS + 1, 300])
def test_half_precision_linear_paths(dtype, rows, fp32_copy, monkeypatch):
    """A bf16 / fp16 `Linear` takes the GEMV kernel for a decode's rows and a packed GEMM past them:
    in its own dtype where oneDNN has that GEMM on this CPU (AVX512_BF16 / AMX), else on an fp32
    copy of the weight. `fp32_copy` forces the second path (what a CPU without such a GEMM runs);
    the first runs only where this CPU has it. Both against float64 of the same inputs."""
    native_half = L.PACK_DTYPES[dtype] == dtype
    if not fp32_copy and not native_half:
        pytest.skip(f"oneDNN has no {dtype} GEMM on this CPU: only the fp32-copy path runs here")
    if fp32_copy:
        monkeypatch.setitem(L.PACK_DTYPES, dtype, torch.float32)
        L.configure()  # the operator's rules: undone below
    g = torch.Generator().manual_seed(0)
    lin = L.Linear(256, 1040, bias=True).requires_grad_(False).to(dtype)  # 2^18 weights and more: packs
    x = torch.randn(rows, 256, generator=g).to(dtype)
    path = "gemv" if rows <= L.GEMV_MAX_ROWS else "packed"
    assert L.cpu_path(x, lin.weight) == path
    got = lin(x)
    assert got.dtype == dtype
    if path == "packed":
        assert L.packed_copy(lin.weight).dtype == (torch.float32 if fp32_copy else dtype)
    # the GEMV path adds the bias to its rounded product (a second rounding); the packed GEMM adds it
    # before rounding (LLaMA's projections have no bias)
    product = x.double() @ lin.weight.double().T
    assert_rounded_from(got, product + lin.bias.double(), product if path == "gemv" else None)
    monkeypatch.undo()  # the operator back to this CPU's rules
    L.configure()


def onednn_cap_below_this_cpu() -> tuple[str, str]:
    """(ONEDNN_MAX_CPU_ISA value, a word oneDNN's reported ISA must then lack): one step below this
    CPU's best GEMM unit, so a test runs the packed GEMMs on the path of the CPUs below it. AMX
    (Intel Xeon 4th gen on) -> AVX-512 with bf16 (AMD Zen 4's path); AVX-512 -> AVX2; else SSE4.1."""
    flags = native.cpu_flags()
    if "amx_bf16" in flags:
        return "AVX512_CORE_BF16", "AMX"
    if "avx512f" in flags:
        return "AVX2", "AVX-512"
    return "SSE41", "AVX"


def test_half_precision_linear_paths_below_this_cpus_gemm_unit(tmp_path):
    """The half-precision `Linear` tests again in a process whose oneDNN is capped one ISA below this
    CPU (`ONEDNN_MAX_CPU_ISA`, read once per process): the GEMMs' fallback from AMX, which the
    machine would not run otherwise. oneDNN's own report shows the cap took effect."""
    cap, absent = onednn_cap_below_this_cpu()
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=cap, ONEDNN_VERBOSE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
           f"{__file__}::test_half_precision_linear_paths", f"{__file__}::test_cpu_paths_match_f_linear"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    isa = [line for line in run.stdout.splitlines() if line.startswith("onednn_verbose") and ",isa:" in line]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert isa and absent not in isa[0], isa
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-500:]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "out_f, in_f, lead, path",
    [
        (1024, 256, (1,), "gemv"),  # one row (a decode step of one sequence)
        (1000, 250, (1, 1), "gemv"),  # widths that are not whole vectors or register tiles
        (1000, 250, (1, 7), "gemv"),  # 7 rows: a full register tile of 4 rows and one of 3
        (1024, 256, (2, 3), "gemv"),  # 6 rows: a full tile and one of 2
        (1024, 256, (3,), "gemv"),  # a partial tile only
        (1024, 256, (L.GEMV_MAX_ROWS,), "gemv"),
        (1024, 256, (L.GEMV_MAX_ROWS + 1,), "packed"),  # a large weight: packs at more rows
        (48, 40, (1, 300), "packed"),  # a small weight: packs from PACK_MIN_ROWS rows (prefill)
        (48, 40, (L.PACK_MIN_ROWS,), "packed"),
    ],
)
def test_cpu_paths_match_f_linear(out_f, in_f, lead, path, bias):
    torch.manual_seed(0)
    lin = L.Linear(in_f, out_f, bias=bias).requires_grad_(False)
    x = torch.randn(*lead, in_f)
    assert L.cpu_path(x, lin.weight) == path
    got = lin(x)
    assert L.is_packed(lin.weight) == (path == "packed")
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), **TOL)


def test_small_calls_and_other_dtypes_keep_f_linear():
    """Small fp32 GEMMs keep MKL's lower per-call cost; float64 is none of the kernels' dtypes."""
    lin = L.Linear(40, 48, bias=False).requires_grad_(False)
    assert L.cpu_path(torch.randn(L.PACK_MIN_ROWS - 1, 40), lin.weight) is None
    lin(torch.randn(L.PACK_MIN_ROWS - 1, 40))
    assert not L.is_packed(lin.weight)
    big = L.Linear(256, 1024, bias=False).to(torch.float64).requires_grad_(False)
    x = torch.randn(3, 256, dtype=torch.float64)
    assert L.cpu_path(x, big.weight) is None
    assert torch.equal(big(x), F.linear(x, big.weight))


@pytest.mark.parametrize("rows", [1, L.GEMV_MAX_ROWS + 1])
def test_packed_copy_and_gemv_arguments_follow_weight_changes(rows):
    """A stale packed copy (or GEMV kernel arguments kept for a weight) would give the old weights'
    outputs: in-place writes (`load_state_dict`) and a new storage must both be followed."""
    torch.manual_seed(0)
    lin = L.Linear(256, 1024, bias=False).requires_grad_(False)
    x = torch.randn(rows, 256)
    first = lin(x)
    lin.load_state_dict({"weight": torch.randn(1024, 256)})
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)
    assert not torch.allclose(lin(x), first)
    lin.weight.data = torch.randn(1024, 256)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)
    with torch.no_grad():
        lin.weight.mul_(2)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)


def test_gemv_of_a_transposed_weight_is_not_taken_for_the_weight():
    """A square weight and its transpose share the data pointer and the shape: the kernel's
    arguments kept for the weight must not serve the transposed view (it is copied)."""
    torch.manual_seed(0)
    w = torch.randn(256, 256)
    x = torch.randn(2, 256)
    torch.testing.assert_close(L.gemv(x, [w]), F.linear(x, w), **TOL)
    torch.testing.assert_close(L.gemv(x, [w.t()]), F.linear(x, w.t()), **TOL)
    torch.testing.assert_close(L.gemv(x, [w, w.t()]), torch.cat([x @ w.t(), x @ w], -1), **TOL)


def test_packed_copy_goes_with_its_weight():
    lin = L.Linear(256, 1024, bias=False).requires_grad_(False)
    lin(torch.randn(L.GEMV_MAX_ROWS + 1, 256))
    gc.collect()
    before = len(torch.ops.fms_paged._packed_data_ptrs())
    del lin
    gc.collect()
    assert len(torch.ops.fms_paged._packed_data_ptrs()) == before - 1


def test_gradients_take_f_linear():
    torch.manual_seed(0)
    lin = L.Linear(256, 1024, bias=True)
    x = torch.randn(300, 256, requires_grad=True)
    assert L.cpu_path(x, lin.weight) is None
    lin(x).square().sum().backward()
    w, b, xr = (lin.weight.detach().requires_grad_(), lin.bias.detach().requires_grad_(),
                x.detach().requires_grad_())
    F.linear(xr, w, b).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, w.grad)
    torch.testing.assert_close(x.grad, xr.grad)


def _recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    return backend


def test_compiled_graphs_call_the_op():
    """Traced code holds the opaque op `fms_paged::linear` (no aten linear or matmul of the weight)."""
    torch.manual_seed(0)
    lin = L.Linear(256, 1024, bias=True).requires_grad_(False)
    x = torch.randn(L.GEMV_MAX_ROWS + 1, 256)  # above the GEMV kernel's rows: the packed path
    graphs: list[set] = []
    fn = torch.compile(lin, backend=_recording_backend(graphs), fullgraph=True)
    torch.testing.assert_close(fn(x), F.linear(x, lin.weight, lin.bias), **TOL)
    assert len(graphs) == 1
    assert graphs[0] == {"fms_paged.linear"}
    # through inductor: the op runs as an extern call on the live (repacked) weight
    mod = L.Linear(256, 1024, bias=False).requires_grad_(False)
    ind = torch.compile(mod, fullgraph=True)
    torch.testing.assert_close(ind(x), F.linear(x, mod.weight), **TOL)
    mod.load_state_dict({"weight": torch.randn(1024, 256)})
    torch.testing.assert_close(ind(x), F.linear(x, mod.weight), **TOL)


@pytest.mark.parametrize("bias", [False, True])
def test_one_compiled_graph_takes_every_path_by_its_rows(bias):
    """The op picks the GEMV kernel, the packed GEMM or F.linear when it runs, so a graph with the
    rows dynamic is traced once for every row count (a guard on the rows would recompile it) and
    each call equals F.linear."""
    torch.manual_seed(0)
    big = L.Linear(256, 1024, bias=bias).requires_grad_(False)  # packs past the GEMV rows
    small = L.Linear(64, 48, bias=bias).requires_grad_(False)  # F.linear below PACK_MIN_ROWS rows
    for lin, rows, want in ((big, (2, L.GEMV_MAX_ROWS, L.GEMV_MAX_ROWS + 1, 40), {"gemv", "packed"}),
                            (small, (2, L.GEMV_MAX_ROWS + 1, L.PACK_MIN_ROWS - 1, L.PACK_MIN_ROWS),
                             {"gemv", None, "packed"})):
        graphs: list[set] = []
        fn = torch.compile(lin, backend=_recording_backend(graphs), fullgraph=True, dynamic=True)
        paths = set()
        for n in rows:
            x = torch.randn(n, lin.in_features)
            paths.add(L.cpu_path(x, lin.weight))
            torch.testing.assert_close(fn(x), F.linear(x, lin.weight, lin.bias), **TOL)
        assert len(graphs) == 1 and paths == want


def test_linear_impl_torch_keeps_every_weight_unpacked():
    cfg = LLaMAConfig(src_vocab_size=4096, emb_dim=64, nheads=4, kvheads=2, nlayers=2,
                      max_expected_seq_len=512)
    torch.manual_seed(0)
    auto = LLaMA(cfg).eval().requires_grad_(False)
    auto.reset_parameters()
    plain = LLaMA(cfg.updated(linear_impl="torch")).eval().requires_grad_(False)
    plain.load_state_dict(auto.state_dict())
    plain.reset_buffers()
    x = torch.randint(0, 4096, (1, 300))
    torch.testing.assert_close(auto(x), plain(x), **TOL)
    assert L.packed_copy(auto.head.weight) is not None
    assert L.packed_copy(auto.layers[0].attn.in_proj.query.weight) is not None  # q/k/v stacked
    assert not any(L.is_packed(p) for p in plain.parameters())
    with pytest.raises(ValueError, match="linear_impl='onednn'"):
        LLaMAConfig(linear_impl="onednn")


def test_get_model_passes_linear_impl():
    model = get_model(linear_impl="torch", device="cpu")  # packing is the CPU's
    assert all(not m.pack for m in model.modules() if isinstance(m, L.Linear))


def test_stacked_projections_are_one_gemm_and_follow_each_weight():
    """q/k/v (and gate/up) through one GEMM over their stacked packed weights: each output equals
    its own F.linear, also after a change to any one weight of the stack, and in a compiled graph
    (one opaque op)."""
    torch.manual_seed(0)
    lins = [L.Linear(64, n, bias=False).requires_grad_(False) for n in (64, 32, 32)]
    x = torch.randn(1, L.PACK_MIN_ROWS, 64)
    assert L.cpu_path(x, lins[0].weight, 128) == "packed"

    def check(outs):
        assert len(outs) == 3
        for out, m in zip(outs, lins):
            torch.testing.assert_close(out, F.linear(x, m.weight), **TOL)

    check(L.linear_cat(x, lins))
    assert L.packed_copy(lins[0].weight) is not None and L.packed_copy(lins[1].weight) is None
    lins[2].load_state_dict({"weight": torch.randn(32, 64)})  # the last weight of the stack
    check(L.linear_cat(x, lins))
    graphs: list[set] = []
    fn = torch.compile(lambda x: L.linear_cat(x, lins), backend=_recording_backend(graphs), fullgraph=True)
    check(fn(x))
    assert len(graphs) == 1 and "fms_paged.linear" in graphs[0]
    small = torch.randn(L.GEMV_MAX_ROWS + 1, 64)  # below the packing thresholds: each its own F.linear
    assert L.cpu_path(small, lins[0].weight, 128) is None
    for out, m in zip(L.linear_cat(small, lins), lins):
        assert torch.equal(out, F.linear(small, m.weight))
    one = torch.randn(1, 1, 64)  # one row: the GEMV kernel over the three weights in one call
    assert L.cpu_path(one, lins[0].weight, 128) == "gemv"
    for out, m in zip(L.linear_cat(one, lins), lins):
        torch.testing.assert_close(out, F.linear(one, m.weight), **TOL)
    gemv_graphs: list[set] = []
    fn = torch.compile(lambda x: L.linear_cat(x, lins), backend=_recording_backend(gemv_graphs),
                       fullgraph=True)
    for out, m in zip(fn(one), lins):
        torch.testing.assert_close(out, F.linear(one, m.weight), **TOL)
    assert "fms_paged.linear" in gemv_graphs[0]


def test_inference_tensor_weights_pack_and_follow_a_new_storage():
    """Weights created under inference_mode have no version counter: the packed copy is keyed by
    the storage alone (the module docstring says what that means for in-place writes), so a call
    works under inference_mode and no_grad, and a new storage (`assign=True`) is followed."""
    torch.manual_seed(0)
    with torch.inference_mode():
        lin = L.Linear(256, 1024, bias=False).requires_grad_(False)
        x = torch.randn(L.GEMV_MAX_ROWS + 1, 256)
    assert lin.weight.is_inference() and L.cpu_path(x, lin.weight) == "packed"
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)
    assert L.is_packed(lin.weight)
    with torch.inference_mode():
        lin.load_state_dict({"weight": torch.randn(1024, 256)}, assign=True)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)
        with torch.no_grad():  # the GEMV kernel's cached arguments follow the storage as well
            torch.testing.assert_close(lin(x[:2]), F.linear(x[:2], lin.weight), **TOL)


def test_gemv_refuses_wrong_dtypes_and_widths():
    """The kernel reads rows x K floats of each weight: a tensor of another dtype or width, for x or
    any weight of the stack, is a typed error naming it, before the kernel runs."""
    w, x = torch.randn(64, 32), torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"x must be a CPU tensor \[..., K\] of torch.float32, "
                                         r"torch.bfloat16, torch.float16, got torch.float64"):
        L.gemv(x.double(), [w])
    with pytest.raises(ValueError, match=r"weight 1 must be a 2-D torch.float32 CPU tensor \[N, 32\] .* got "
                                         r"torch.float32 \(64, 16\)"):
        L.gemv(x, [w, torch.randn(64, 16)])
    with pytest.raises(ValueError, match=r"weight 0 must be .* got torch.bfloat16 \(64, 32\)"):
        L.gemv(x, [w.bfloat16()])
    torch.testing.assert_close(L.gemv(x, [w]), F.linear(x, w), **TOL)
    with pytest.raises(ValueError, match=r"\[N, 16\] \(x's dtype and width\), got torch.float32 \(64, 32\)"):
        L.gemv(x[:, :16], [w])  # the same weight, kept from the call before, with a narrower x
