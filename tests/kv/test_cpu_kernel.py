"""The CPU paged-attention kernel (`fms_paged.kv.cpu_kernel`) against SDPA over each sequence's
keys gathered into logical order, computed in float64 (an independent reference: the kernel reads
pages in place, sums in another order and has its own exp).

Tolerance 1e-5 absolute on outputs of magnitude ~1: fp32 round-off of softmax-weighted sums of up
to a few hundred terms, and the kernel's exp (Cephes' polynomial, ~1 ulp). In bf16 and fp16 the
reference is computed in float64 from the same half-precision inputs; the kernel computes in fp32
and rounds its output once, so each output is within half an ulp of the reference, at most
u * |ref| (u: the dtype's unit roundoff, 2^-8 for bf16, 2^-11 for fp16), plus that 1e-5.
"""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from fms_paged import get_model, native
from fms_paged.kv import cpu_kernel
from fms_paged.kv._pool_ops import write_slots
from fms_paged.kv.kernels import choose_kernel
from fms_paged.kv.paged import PagedBackend

# a machine with a C++ compiler must build the kernel: a failed build fails these tests
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")

TOL = 1e-5
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # beyond fp32's


def isas() -> list[str]:
    """The builds this CPU can run: its own, and the narrower ones forced with FMS_PAGED_CPU_ISA
    (an AVX-512 CPU runs the AVX2 build a CPU without AVX-512 gets, and any x86 CPU the SSE2 one)."""
    out = ["native", "baseline"]
    if "avx2" in native.cpu_flags() and "f16c" in native.cpu_flags():
        out.insert(1, "avx2")
    return out


def make_pool(lengths, H, Hkv, D, P, seed=0):
    """Pools [1, Hkv, NP * P, D] whose every slot is NaN except the sequences' own tokens (stale
    data the kernel must never read), pages handed out in a shuffled order, and a page table."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // P) for n in lengths]
    NP = sum(n_pages) + 3  # + the null page and two never listed
    perm = torch.randperm(NP - 1, generator=g) + 1
    table = torch.zeros(len(lengths), max(n_pages), dtype=torch.int32)
    k = torch.full((1, Hkv, NP * P, D), float("nan"))
    v = torch.full((1, Hkv, NP * P, D), float("nan"))
    slots, used = [], 0
    for s, (n, npg) in enumerate(zip(lengths, n_pages)):
        table[s, :npg] = perm[used : used + npg].int()
        used += npg
        pos = torch.arange(n)
        sl = table[s, pos // P].long() * P + pos % P
        k[0, :, sl] = torch.randn(Hkv, n, D, generator=g)
        v[0, :, sl] = torch.randn(Hkv, n, D, generator=g)
        slots.append(sl)
    return k, v, table, slots


def reference(q, k, v, slots, chunks, H):
    """float64 SDPA per chunk over its sequence's keys 0 .. q0 + n - 1 in logical order."""
    B, _, S, D = q.shape
    rows = q.transpose(1, 2).reshape(B * S, H, D).double()
    out = torch.zeros_like(rows)
    for seq, q0, n, off in chunks.tolist():
        if seq < 0:
            continue
        sl = slots[seq][: q0 + n]
        kk, vv = k[0, :, sl].double(), v[0, :, sl].double()  # [Hkv, L, D]
        qq = rows[off : off + n].transpose(0, 1)  # [H, n, D]
        mask = torch.arange(q0 + n)[None, :] <= torch.arange(q0, q0 + n)[:, None]
        out[off : off + n] = F.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=mask, enable_gqa=True).transpose(0, 1)
    return out.view(B, S, H, D)


def run(q, k, v, table, chunks, P):
    return torch.ops.fms_paged.paged_attention(q, k, v, table, chunks, P, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("P", [8, 16, 64])
def test_prefill_chunks_and_decode_rows_match_sdpa(D, H, Hkv, P):
    """One call: prompts from position 0 (lengths not multiples of the page or the key block), a
    chunk continuing a prompt, decode rows at several positions and a row with no sequence."""
    lengths = [1, 15, 150, 77, 200, 64]
    k, v, table, slots = make_pool(lengths, H, Hkv, D, P)
    # (seq, first position, tokens): seq 3 continues at 37; seqs 4 and 5 decode their last token
    parts = [(0, 0, 1), (1, 0, 15), (2, 0, 150), (3, 37, 40), (4, 199, 1), (-1, 0, 1), (5, 63, 1)]
    offs = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0)[:-1]
    chunks = torch.tensor([(s, q0, n, int(o)) for (s, q0, n), o in zip(parts, offs)])
    T = int(offs[-1]) + 1
    q = torch.randn(1, T, H, D, generator=torch.Generator().manual_seed(1)).transpose(1, 2)  # a view
    out = run(q, k, v, table, chunks, P)
    assert out.shape == (1, T, H, D) and out.is_contiguous()
    ref = reference(q, k, v, slots, chunks, H)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= TOL
    assert (out[0, int(offs[5])] == 0).all()  # the row with no sequence


@pytest.mark.parametrize("H,Hkv", [(8, 2), (1, 1), (40, 1)])
def within_rounding(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise: the kernel's output is its dtype's rounding of the float64 reference (module
    docstring)."""
    return (out.double() - ref).abs() <= UNIT_ROUNDOFF[out.dtype] * ref.abs() + TOL


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D,H,Hkv,P", [(64, 8, 2, 16), (32, 4, 4, 8), (128, 9, 3, 64)])
def test_half_precision_and_each_isa_match_float64(isa, dtype, D, H, Hkv, P, monkeypatch):
    """bf16 / fp16 pools and queries (and fp32), on this CPU's build and on each narrower one:
    prefill chunks from position 0 and continuing, decode rows, GQA and MHA, lengths that end
    inside a page and a key block, every slot not a sequence's own NaN (stale pages the kernel must
    never let through), and a row with no sequence (zeros)."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    lengths = [1, 15, 150, 77, 200, 64]
    k, v, table, slots = make_pool(lengths, H, Hkv, D, P)
    k, v = k.to(dtype), v.to(dtype)  # NaN stays NaN
    parts = [(0, 0, 1), (1, 0, 15), (2, 0, 150), (3, 37, 40), (4, 199, 1), (-1, 0, 1), (5, 63, 1)]
    offs = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0)[:-1]
    chunks = torch.tensor([(s, q0, n, int(o)) for (s, q0, n), o in zip(parts, offs)])
    T = int(offs[-1]) + 1
    q = torch.randn(1, T, H, D, generator=torch.Generator().manual_seed(1)).to(dtype).transpose(1, 2)
    out = run(q, k, v, table, chunks, P)
    assert out.dtype == dtype and out.shape == (1, T, H, D)
    ok = within_rounding(out, reference(q, k, v, slots, chunks, H))
    assert ok.all(), f"{(~ok).sum().item()} outputs off by more than the dtype's rounding"
    assert (out[0, int(offs[5])] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv", [(8, 2), (1, 1), (40, 1)])
def test_decode_batch_layout_and_thread_count(H, Hkv, dtype):
    """Decode rows as the model passes them ([B, H, 1, D], a transposed view), and the same bits
    with 1 thread as with the default count (each row is computed by one thread). Decode rows take
    the kernel's keys-in-lanes path: lengths that end inside a lane group of keys (8 or 16) and a 64-key block
    (5, 129, 300), one head alone, and 40 query heads on one kv head (two work items per row)."""
    D, P = 32, 16
    lengths = [300, 5, 129]
    k, v, table, slots = make_pool(lengths, H, Hkv, D, P)
    k, v = k.to(dtype), v.to(dtype)
    chunks = torch.tensor([(s, n - 1, 1, s) for s, n in enumerate(lengths)])
    q = torch.randn(3, 1, H, D).to(dtype).transpose(1, 2)  # [B, H, 1, D]
    out = run(q, k, v, table, chunks, P)
    assert within_rounding(out, reference(q, k, v, slots, chunks, H)).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(q, k, v, table, chunks, P), out)
    finally:
        torch.set_num_threads(threads)


def test_assign_through_write_slots_then_attend():
    """The engine's order: the step's keys and values (strided views, as the model passes them)
    are ASSIGNed by the page manager's `write_slots`, then the kernel attends (a prompt's tokens
    see each other): equal to the reference over pools holding those keys."""
    H, Hkv, D, P = 8, 2, 32, 16
    k, v, table, slots = make_pool([70, 21], H, Hkv, D, P)
    fresh_k, fresh_v = torch.randn(1, 70, Hkv * 3, D), torch.randn(1, 70, Hkv * 3, D)
    nk, nv = fresh_k[0, :, :Hkv], fresh_v[0, :, Hkv : 2 * Hkv]  # [70, Hkv, D] views of wider rows
    write_slots(k, v, slots[0], nk, nv)
    assert torch.equal(k[0, :, slots[0]], nk.transpose(0, 1))
    assert torch.equal(v[0, :, slots[0]], nv.transpose(0, 1))
    chunks = torch.tensor([(0, 0, 70, 0)])
    q = torch.randn(1, H, 70, D)
    out = run(q, k, v, table, chunks, P)
    assert (out.double() - reference(q, k, v, slots, chunks, H)).abs().max().item() <= TOL


def test_op_inside_a_compiled_graph():
    """The op is opaque to torch.compile (fullgraph): its fake gives the shape, the kernel runs."""
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, slots = make_pool([40, 9], H, Hkv, D, P)
    chunks = torch.tensor([(0, 0, 40, 0), (1, 8, 1, 40)])
    q = torch.randn(1, H, 41, D)
    f = torch.compile(lambda q: run(q, k, v, table, chunks, P) * 2, fullgraph=True, backend="eager")
    assert torch.equal(f(q), run(q, k, v, table, chunks, P) * 2)


def test_bad_inputs_raise():
    """A typed error naming the bad value, before the kernel reads anything: wrong dtypes, shapes,
    a page size the tiles do not fit, and chunks outside the page table or the step (the kernel
    checks those itself: they would be reads out of bounds)."""
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, _ = make_pool([20], H, Hkv, D, P)
    chunks = torch.tensor([(0, 0, 20, 0)])
    q = torch.randn(1, H, 20, D)
    with pytest.raises(ValueError, match=r"q is torch.float64; the kernel takes torch.float32, torch.bf"):
        run(q.double(), k, v, table, chunks, P)
    with pytest.raises(ValueError, match="k_pool must be a 4-D torch.bfloat16 CPU tensor, got torch.float32"):
        run(q.bfloat16(), k, v.bfloat16(), table, chunks, P)  # one dtype for q, the pools and out
    with pytest.raises(ValueError, match="page_table must be a 2-D torch.int32"):
        run(q, k, v, table.long(), chunks, P)
    with pytest.raises(ValueError, match="page_size=12"):
        run(q, k, v, table, chunks, 12)
    with pytest.raises(ValueError, match="must be contiguous"):
        run(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, table, chunks, P)
    with pytest.raises(ValueError, match=r"expected two pools \[1, Hkv, NP, 16\]"):
        run(q, k[..., :8].contiguous(), v, table, chunks, P)
    for bad in [(1, 0, 20, 0), (0, 0, 21, 0), (0, 60, 20, 0), (0, 0, 20, 1)]:  # seq, length, position, offset
        with pytest.raises(ValueError, match=rf"chunk 0 \[{', '.join(map(str, bad))}\]"):
            run(q, k, v, table, torch.tensor([bad]), P)


def test_kernel_choice():
    cpu = torch.device("cpu")
    assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=torch.float32) == "cpp"
    assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=torch.float32,
                         score_mod=lambda s, b, h, q, k: s) != "cpp"  # the kernel has no score_mod
    for dt in (torch.bfloat16, torch.float16):
        assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=dt) == "cpp"
    for kw, why in [(dict(head_dim=24, dtype=torch.float32), "head_dim=24 is not a multiple of 16"),
                    (dict(head_dim=32, dtype=torch.float64), "it takes torch.float32, torch.bfloat16, "
                                                             "torch.float16, the model is torch.float64"),
                    (dict(head_dim=32, dtype=torch.float32, score_mod=lambda *a: a[0]), "score_mod")]:
        with pytest.raises(ValueError, match=why):
            choose_kernel("cpp", cpu, 16, **kw)
    with pytest.raises(ValueError, match="page_size=12 is not a multiple of 8"):
        choose_kernel("cpp", cpu, 12, head_dim=32, dtype=torch.float32)
    assert PagedBackend(get_model(variant="micro", attn_impl="paged", page_size=16, device="cpu"),
                        2, 64).kernel == "cpp"


def test_built_once_per_head_dim_into_the_cache_dir(tmp_path, monkeypatch):
    """The library is built into $FMS_PAGED_CACHE_DIR, keyed by what it was built from, and a second
    request loads the file built (no rebuild)."""
    monkeypatch.setenv("FMS_PAGED_CACHE_DIR", str(tmp_path))
    native._load.cache_clear()
    try:
        lib, why = native.load(cpu_kernel.SOURCE, HEAD_DIM=48, FMS_ELEM="float")
        assert why is None and lib is not None
        (built,) = tmp_path.glob("cpu_attention_fms_elemfloat_head_dim48_*.so")
        mtime = built.stat().st_mtime_ns
        native._load.cache_clear()
        assert native.load(cpu_kernel.SOURCE, HEAD_DIM=48, FMS_ELEM="float")[1] is None
        assert built.stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1
    finally:
        native._load.cache_clear()


def test_struct_is_typed():
    """Fields are set by name and type-checked by ctypes; the kernel takes only its own struct, and
    a library built for one dtype refuses the struct of another (its pointers' kinds differ)."""
    Args = cpu_kernel.attention_args(torch.float32)
    with pytest.raises(AttributeError):
        Args(n_heads=4)  # not a field
    with pytest.raises(TypeError):
        Args(H=4.0)  # an int32 field
    with pytest.raises(TypeError):
        Args(q=torch.randn(4))  # a pointer field takes an address, not a tensor
    kernel, why = cpu_kernel._build(16)
    assert why is None

    class Other(ctypes.Structure):
        _fields_ = Args._fields_

    with pytest.raises(ctypes.ArgumentError):
        kernel(Other())
    lib, why = native.load(cpu_kernel.SOURCE, HEAD_DIM=16, FMS_ELEM="fms_bf16")
    assert why is None
    with pytest.raises(native.LayoutMismatch, match=r"first difference: 'q:bf16\*@0' where 'q:f32\*@0'"):
        native.bind(lib, "fms_paged_attention", Args)
    assert native.bind(lib, "fms_paged_attention", cpu_kernel.attention_args(torch.bfloat16)) is not None


def test_library_with_another_layout_is_refused(monkeypatch):
    """A library whose struct is laid out otherwise than the Python mirror (two same-typed fields
    swapped: the same kinds, other offsets) is refused naming the first differing field, and
    paged_attention raises rather than calling it."""
    lib, why = native.load(cpu_kernel.SOURCE, HEAD_DIM=16, FMS_ELEM="float")
    assert why is None
    fields = list(cpu_kernel.attention_args(torch.float32)._fields_)
    fields[1], fields[2] = fields[2], fields[1]  # q_sh before q_st
    swapped = type("FmsPagedAttentionArgs", (ctypes.Structure,), {"_fields_": fields})
    with pytest.raises(native.LayoutMismatch,
                       match=r"first difference: 'q_st:i64@8' where 'q_sh:i64@8' was expected"):
        native.bind(lib, "fms_paged_attention", swapped)
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, _ = make_pool([20], H, Hkv, D, P)
    real = native.layout
    monkeypatch.setattr(native, "layout", lambda struct: real(struct) + " extra:i64@192")  # one more field
    cpu_kernel._built.cache_clear()
    try:
        with pytest.raises(native.LayoutMismatch, match="first difference: 'nothing' where 'extra:i64@192'"):
            run(torch.randn(1, H, 20, D), k, v, table, torch.tensor([(0, 0, 20, 0)]), P)
    finally:
        monkeypatch.undo()
        cpu_kernel._built.cache_clear()
