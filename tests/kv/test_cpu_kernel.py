"""The CPU paged-attention kernel (`fms_paged.kv.cpu_kernel`) against attention computed by its
definition in float64 over each sequence's keys gathered into logical order (an independent
reference: the kernel reads pages in place, runs an online softmax, sums in another order and has
its own exp and tanh), with the variants as Hugging Face transformers defines them: a sliding
window, a logit soft-cap and attention sinks.

Tolerance 1e-5 absolute on outputs of magnitude ~1: fp32 round-off of softmax-weighted sums of up
to a few hundred terms, and the kernel's exp and tanh (Cephes' polynomials, a few ulps; a
soft-capped score of magnitude up to the cap, 5, is off by a few of its ulps). In bf16 and fp16
the reference is computed in float64 from the same half-precision inputs; the kernel computes in
fp32 and rounds its output once, so each output is within half an ulp of the reference, at most
u * |ref| (u: the dtype's unit roundoff, 2^-8 for bf16, 2^-11 for fp16), plus that 1e-5. A bf16
prefill on a CPU with AVX512_BF16 also rounds each probability to bf16 before its product with
the values (bf16 dot products, as torch's own CPU flash attention and OpenVINO do): each output is
then off by at most u * (|ref| + sum_j p_j |v_j|), the second term the reference's attention over
|v| (`rounds_probabilities`).
"""

import re

import pytest
import torch
import torch.nn.functional as F

from fms_paged import get_model, native
from fms_paged.kv import cpu_kernel
from fms_paged.kv._pool_ops import write_slots
from fms_paged.kv.kernels import choose_kernel
from fms_paged.kv.paged import PagedBackend
from fms_paged.kv.quant import dequantize, quantize
from fms_paged.native import build

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


def reference(q, k, v, slots, chunks, H, window=0, softcap=0.0, sinks=None):
    """float64 attention per chunk over its sequence's keys 0 .. q0 + n - 1 in logical order, as HF's
    eager attention computes it: scores q k^T / sqrt(D), soft-capped (softcap * tanh(s / softcap)),
    masked (key k seen by the query at p iff k <= p and, with a window, p - k < window), a softmax
    over the keys and the head's sink logit as one more column, the sink's column dropped, @ v.
    q: [B, H, S, D]; k, v: [1, Hkv, NP, D]; sinks: [H] or None -> [B, S, H, D] float64."""
    B, _, S, D = q.shape
    G = H // k.shape[1]
    rows = q.transpose(1, 2).reshape(B * S, H, D).double()
    out = torch.zeros_like(rows)
    for seq, q0, n, off in chunks.tolist():
        if seq < 0:
            continue
        L = q0 + n
        sl = slots[seq][:L]
        kk = k[0, :, sl].double().repeat_interleave(G, 0)  # [H, L, D]
        vv = v[0, :, sl].double().repeat_interleave(G, 0)
        qq = rows[off : off + n].transpose(0, 1)  # [H, n, D]
        s = qq @ kk.transpose(1, 2) * D**-0.5  # [H, n, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp, kp = torch.arange(q0, L)[:, None], torch.arange(L)[None, :]  # [n, 1], [1, L]
        seen = kp <= qp
        if window:
            seen &= qp - kp < window
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(H, n, 1)], dim=-1)  # [H, n, L + 1]
        p = torch.softmax(s, dim=-1)[..., :L]
        out[off : off + n] = (p @ vv).transpose(0, 1)
    return out.view(B, S, H, D)


def run(q, k, v, table, chunks, P, **variants):
    # the operator, once `paged_attention` has built and loaded the kernel for this ISA, dtype and D
    return cpu_kernel.paged_attention(q, k, v, table, chunks, P, q.shape[-1] ** -0.5, **variants)


@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("P", [8, 16, 64])
def test_prefill_chunks_and_decode_rows_match_float64(D, H, Hkv, P):
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


def within_rounding(out: torch.Tensor, ref: torch.Tensor, ref_abs: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Elementwise: the kernel's output is its dtype's rounding of the float64 reference; with
    `ref_abs` (the reference's attention over |v|), of the reference with each probability rounded
    to the dtype as well (module docstring)."""
    u = UNIT_ROUNDOFF[out.dtype]
    bound = u * ref.abs() + TOL + (0 if ref_abs is None else u * ref_abs)
    return (out.double() - ref).abs() <= bound


def rounds_probabilities(isa: str, dtype: torch.dtype) -> bool:
    """Whether this build's prefill rounds probabilities to the dtype: bf16 dot products, in the
    native build of a CPU with AVX512_BF16."""
    return dtype == torch.bfloat16 and isa == "native" and "avx512_bf16" in native.cpu_flags()


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
    ref_abs = reference(q, k, v.abs(), slots, chunks, H) if rounds_probabilities(isa, dtype) else None
    ok = within_rounding(out, reference(q, k, v, slots, chunks, H), ref_abs)
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


def test_reference_is_sdpa_without_variants():
    """The float64 reference, written out by the definition, is torch's SDPA (causal, GQA) when no
    variant is asked for: the variants' tests extend a reference that is checked itself."""
    H, Hkv, D = 4, 2, 16
    k, v, _, slots = make_pool([30, 9], H, Hkv, D, 8)
    chunks = torch.tensor([(0, 0, 30, 0), (1, 8, 1, 30)])
    q = torch.randn(1, H, 31, D, dtype=torch.float64)
    ref = reference(q, k, v, slots, chunks, H)
    for seq, q0, n, off in chunks.tolist():
        sl = slots[seq][: q0 + n]
        mask = torch.arange(q0 + n)[None, :] <= torch.arange(q0, q0 + n)[:, None]
        kk, vv = k[0, :, sl].double(), v[0, :, sl].double()  # [Hkv, L, D]
        sdpa = F.scaled_dot_product_attention(q[0, :, off : off + n], kk, vv, attn_mask=mask,
                                              enable_gqa=True)  # [H, n, D]
        torch.testing.assert_close(ref[0, off : off + n], sdpa.transpose(0, 1), rtol=0, atol=1e-12)


# one call of the variant tests: (seq, first position, tokens), each sequence as long as its chunk
# reaches: a prompt from 0 (two work items for GQA, one with keys before its window), a chunk
# continuing at 50 (past every window tested), decode rows at 70 (past the windows) and at 3 (inside
# them), and a short chunk continuing at 9
VARIANT_PARTS = [(0, 0, 37), (1, 50, 23), (2, 70, 1), (3, 3, 1), (4, 9, 3)]


def sink_logits(kind, H):
    """[H] fp32 sink logits: "small" ~ N(0, 1); "big" ~ 5 (they dominate the softmax), one head's
    -inf (no weight: as if it had none)."""
    g = torch.Generator().manual_seed(2)
    if kind == "small":
        return torch.randn(H, generator=g)
    big = 5.0 + 0.5 * torch.randn(H, generator=g)
    big[1] = float("-inf")
    return big


def variant_inputs(dtype, H, Hkv, P, window, softcap, sinks, extra=()):
    """One call's inputs for VARIANT_PARTS and the chunks `extra` after them (head dim 32): q
    [1, H, T, D] (a view), the pools k, v and the kernel's kp, vp (NaN, besides the stale slots, at
    every key older than all its sequence's queries' windows), the page table, each sequence's
    slots, the chunk list and the [H] sink logits (or None)."""
    D, parts = 32, [*VARIANT_PARTS, *extra]
    k, v, table, slots = make_pool([q0 + n for _, q0, n in VARIANT_PARTS], H, Hkv, D, P)
    k, v = k.to(dtype), v.to(dtype)
    offs = torch.tensor([0] + [n for _, _, n in parts]).cumsum(0)
    chunks = torch.tensor([(s, q0, n, int(o)) for (s, q0, n), o in zip(parts, offs)])
    q = torch.randn(1, int(offs[-1]), H, D, generator=torch.Generator().manual_seed(1))
    q = (q * (4.0 if softcap else 1.0)).to(dtype).transpose(1, 2)  # [1, H, T, D], a view
    sinks = None if sinks is None else sink_logits(sinks, H)
    kp, vp = k.clone(), v.clone()
    if window:
        for s, q0, _ in VARIANT_PARTS:
            old = slots[s][: max(0, q0 - window + 1)]
            kp[0, :, old] = float("nan")
            vp[0, :, old] = float("nan")
    return q, k, v, kp, vp, table, slots, chunks, sinks


def variant_call(isa, dtype, H, Hkv, P, window, softcap, sinks, monkeypatch):
    """The kernel's output for VARIANT_PARTS in one call, the reference's, and (bf16 probabilities:
    `rounds_probabilities`) the reference's over |v|, else None. The kernel's pools hold
    NaN, besides the stale slots, at every key older than all its sequence's queries' windows: it
    must neither read their values nor let their scores through. With a soft-cap, q is scaled by 4
    so that scores reach well past the cap (the tanh matters)."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    q, k, v, kp, vp, table, slots, chunks, sinks = variant_inputs(dtype, H, Hkv, P, window, softcap, sinks)
    out = run(q, kp, vp, table, chunks, P, window=window, softcap=softcap, sinks=sinks)
    ref_abs = (reference(q, k, v.abs(), slots, chunks, H, window, softcap, sinks)
               if rounds_probabilities(isa, dtype) else None)
    return out, reference(q, k, v, slots, chunks, H, window, softcap, sinks), ref_abs


VARIANTS = [  # window, softcap, sinks, page size
    pytest.param(1, 0.0, None, 8, id="window1"),
    pytest.param(5, 0.0, None, 8, id="window5<page"),
    pytest.param(16, 0.0, None, 16, id="window16=page"),
    pytest.param(16, 0.0, None, 8, id="window16>page"),
    pytest.param(40, 0.0, None, 16, id="window40>page"),
    pytest.param(0, 5.0, None, 16, id="softcap"),
    pytest.param(0, 0.0, "small", 8, id="sinks"),
    pytest.param(0, 0.0, "big", 16, id="big-sinks"),
    pytest.param(5, 5.0, "small", 8, id="all-window5"),
    pytest.param(40, 5.0, "big", 16, id="all-window40"),
]


@pytest.mark.parametrize("window,softcap,sinks,P", VARIANTS)
@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isas())
def test_window_softcap_and_sinks_match_float64(isa, dtype, H, Hkv, window, softcap, sinks, P, monkeypatch):
    """Sliding windows shorter than, as long as and longer than a page (and than some sequences),
    the soft-cap, sinks (small, and big enough to take most of the weight) and all three at once,
    on prefill chunks from 0 and continuing past the window, and decode rows, in one call; GQA and
    MHA; fp32 and bf16 on each build this CPU runs."""
    out, ref, ref_abs = variant_call(isa, dtype, H, Hkv, P, window, softcap, sinks, monkeypatch)
    assert torch.isfinite(out).all()
    ok = within_rounding(out, ref, ref_abs)
    assert ok.all(), f"{(~ok).sum().item()} outputs off by more than the dtype's rounding"


@pytest.mark.parametrize("window,softcap,sinks,P", [
    pytest.param(0, 0.0, None, 8, id="plain"),
    pytest.param(5, 5.0, "small", 8, id="all-window5"),
    pytest.param(40, 5.0, "big", 16, id="all-window40")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", isas())
def test_int8_pools_on_each_isa_match_float64_of_dequantized(isa, dtype, window, softcap, sinks, P,
                                                             monkeypatch):
    """The int8-pool build ("attention_i8": 8-bit KV pages) on this CPU's build and on each
    narrower one: int8 rows with one fp32 scale per token and kv head (`quant.quantize`, as ASSIGN
    writes them), prefill chunks from 0 and continuing, decode rows, GQA, windows, soft-cap and
    sinks in one call, against the float64 reference over the dequantized pages. Every stale slot's
    and every key's older than all its sequence's queries' windows has a NaN scale: never read (or
    never let through). The build converts rows to fp32 as it loads them and never rounds a
    probability, so the bound is `within_rounding`'s without the |v| term."""
    monkeypatch.setenv("FMS_PAGED_CPU_ISA", isa)
    q, k, v, kp, vp, table, slots, chunks, sinks = variant_inputs(dtype, 4, 2, P, window, softcap, sinks)
    (kq, ks), (vq, vs) = (quantize(torch.nan_to_num(x, nan=0.0), torch.int8, 1) for x in (k, v))
    ks[kp[..., :1].isnan()] = float("nan")  # [1, Hkv, NP, 1]: the slots the kernel must not read
    vs[vp[..., :1].isnan()] = float("nan")
    out = run(q, kq, vq, table, chunks, P, window=window, softcap=softcap, sinks=sinks,
              k_scales=ks, v_scales=vs)
    kd, vd = (dequantize(x, s.nan_to_num(0.0), torch.float64) for x, s in ((kq, ks), (vq, vs)))
    assert torch.isfinite(out).all()
    ok = within_rounding(out, reference(q, kd, vd, slots, chunks, 4, window, softcap, sinks))
    assert ok.all(), f"{(~ok).sum().item()} outputs off by more than the dtype's rounding"


@pytest.mark.parametrize("window,softcap,sinks,P", [pytest.param(0, 0.0, None, 8, id="plain"), *VARIANTS])
def test_steps_fallback_matches_float64(window, softcap, sinks, P):
    """What a cpp step computes by torch's operations while a first start's builds compile
    (`CppStep.gathered`), on the variants' chunks and pools (NaN in every stale slot and at every
    key older than all its sequence's queries' windows: never read): the reference's attention,
    fp32, GQA, and zero for the row of no sequence."""
    from types import SimpleNamespace

    from fms_paged.kv.kernels.cpp import CppStep
    from fms_paged.kv.spec import AttentionSpec

    H, Hkv = 4, 2
    q, k, v, kp, vp, table, slots, chunks, sinks = variant_inputs(
        torch.float32, H, Hkv, P, window, softcap, sinks, extra=[(-1, 0, 1)])
    step = CppStep(SimpleNamespace(page_table=table, page_size=P, k_pools=[kp]), torch.zeros(0), chunks)
    spec = AttentionSpec(q.shape[-1] ** -0.5, window or None, softcap or None, sinks)
    out = step.gathered(q, kp, vp, spec)
    assert out.shape == q.shape
    ref = reference(q, k, v, slots, chunks, H, window, softcap, sinks)
    assert (out.transpose(1, 2).double() - ref).abs().max().item() <= TOL
    assert (out[0, :, -1] == 0).all()


def test_variants_off_are_the_plain_kernel():
    """A window no query outgrows and sinks of -inf (no weight) leave every output bit as without
    them: masked keys get exactly zero weight and the softmax's start changes nothing; the
    defaults are the plain kernel's."""
    H, Hkv, D, P = 4, 2, 32, 8
    k, v, table, _ = make_pool([q0 + n for _, q0, n in VARIANT_PARTS], H, Hkv, D, P)
    offs = torch.tensor([0] + [n for _, _, n in VARIANT_PARTS]).cumsum(0)
    chunks = torch.tensor([(s, q0, n, int(o)) for (s, q0, n), o in zip(VARIANT_PARTS, offs)])
    q = torch.randn(1, H, int(offs[-1]), D)
    plain = run(q, k, v, table, chunks, P)
    assert torch.equal(run(q, k, v, table, chunks, P, window=0, softcap=0.0, sinks=None), plain)
    assert torch.equal(run(q, k, v, table, chunks, P, window=74), plain)
    assert torch.equal(run(q, k, v, table, chunks, P, sinks=torch.full((H,), float("-inf"))), plain)


def test_bad_variants_raise():
    """window, softcap and sinks are checked where they enter: a ValueError naming the value."""
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, _ = make_pool([20], H, Hkv, D, P)
    chunks = torch.tensor([(0, 0, 20, 0)])
    q = torch.randn(1, H, 20, D)
    with pytest.raises(ValueError, match=r"window=-1; expected an int >= 0"):
        run(q, k, v, table, chunks, P, window=-1)
    for window in (2.0, True):
        with pytest.raises(ValueError, match=rf"window={window}; expected an int"):
            cpu_kernel.paged_attention(q, k, v, table, chunks, P, 0.25, window=window)
    for softcap in (-1.0, float("inf"), float("nan"), 1e39, 1e-40):
        with pytest.raises(ValueError, match=re.escape(f"softcap={softcap}; expected 0.0 (none) or a fin")):
            run(q, k, v, table, chunks, P, softcap=softcap)
    bad_sinks = [(torch.zeros(H, dtype=torch.float64), r"got torch.float64 \(4,\) on cpu"),
                 (torch.zeros(H + 1), r"got torch.float32 \(5,\) on cpu"),
                 (torch.zeros(1, H), r"got torch.float32 \(1, 4\) on cpu"),
                 (torch.zeros(2 * H)[::2], r"got torch.float32 \(4,\) on cpu, not contiguous")]
    for sinks, got in bad_sinks:
        with pytest.raises(ValueError, match=r"sinks must be None or a contiguous torch.float32 CPU tensor "
                                             r"\[4\] \(one logit per query head\), " + got):
            run(q, k, v, table, chunks, P, sinks=sinks)
    for sinks, got in [(torch.zeros(H, device="meta"), "on meta"), ([0.0] * H, "got list")]:
        with pytest.raises(ValueError, match=got):
            cpu_kernel.paged_attention(q, k, v, table, chunks, P, 0.25, sinks=sinks)


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
    """The op is opaque to torch.compile (fullgraph): its fake gives the shape, the kernel runs;
    with its defaults and with a window, a soft-cap and sinks."""
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, slots = make_pool([40, 9], H, Hkv, D, P)
    chunks = torch.tensor([(0, 0, 40, 0), (1, 8, 1, 40)])
    q, sinks = torch.randn(1, H, 41, D), torch.randn(H)
    variants = dict(window=5, softcap=5.0, sinks=sinks)
    run(q, k, v, table, chunks, P)  # loads the kernel: the graph calls the operator itself
    op = torch.ops.fms_paged.paged_attention
    s = D**-0.5
    both = lambda q: op(q, k, v, table, chunks, P, s) * 2 + op(q, k, v, table, chunks, P, s, **variants)
    assert torch.equal(torch.compile(both, fullgraph=True, backend="eager")(q), both(q))


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
    assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=torch.float32).name == "cpp"
    assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=torch.float32,
                         score_mod=lambda s, b, h, q, k: s).name != "cpp"  # the kernel has no score_mod
    for dt in (torch.bfloat16, torch.float16):
        assert choose_kernel("auto", cpu, 16, head_dim=32, dtype=dt).name == "cpp"
    for kw, why in [(dict(head_dim=24, dtype=torch.float32), "head_dim=24 is not a multiple of 16"),
                    (dict(head_dim=32, dtype=torch.float64), "it takes torch.float32, torch.bfloat16, "
                                                             "torch.float16, the model is torch.float64"),
                    (dict(head_dim=32, dtype=torch.float32, score_mod=lambda *a: a[0]), "score_mod")]:
        with pytest.raises(ValueError, match=why):
            choose_kernel("cpp", cpu, 16, **kw)
    with pytest.raises(ValueError, match="page_size=12 is not a multiple of 8"):
        choose_kernel("cpp", cpu, 12, head_dim=32, dtype=torch.float32)
    assert PagedBackend(get_model(variant="micro", attn_impl="paged", page_size=16, device="cpu"),
                        2, 64).kernel.name == "cpp"


def test_built_once_per_head_dim_into_the_cache_dir(tmp_path, monkeypatch):
    """The library is built into $FMS_PAGED_CACHE_DIR, keyed by what it was built from, and a second
    request loads the file built (no rebuild)."""
    monkeypatch.setenv("FMS_PAGED_CACHE_DIR", str(tmp_path))
    build.kernel_library.cache_clear()
    try:
        lib, why = build.load(build.ATTENTION_SOURCE, HEAD_DIM=48, FMS_ELEM="float")
        assert why is None and lib is not None
        (built,) = tmp_path.glob("attention_fms_elemfloat_head_dim48_*.so")
        mtime = built.stat().st_mtime_ns
        build.kernel_library.cache_clear()
        assert build.load(build.ATTENTION_SOURCE, HEAD_DIM=48, FMS_ELEM="float")[1] is None
        assert built.stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1
    finally:
        build.kernel_library.cache_clear()


def test_a_kernels_own_header_is_part_of_its_librarys_key(tmp_path):
    """Editing the decode path's header (attention_decode.h, included by attention.cpp) names a
    new library, so a cached build of the old text is not loaded for the new one."""
    source = build.ATTENTION_SOURCE
    for f in (source, source.with_name("attention_decode.h")):
        (tmp_path / f.name).write_text(f.read_text())
    src, header = tmp_path / source.name, tmp_path / "attention_decode.h"

    def library():
        name, _, made_from = build.kernel_recipe(src, "native", HEAD_DIM=64, FMS_ELEM="float")
        return build.library_path(name, made_from)

    before = library()
    header.write_text(header.read_text() + "\n// edited\n")
    assert library() != before


def _library(tmp_path, fields: str, elem: str = "float") -> str:
    """A kernel library whose argument struct is declared from `fields` (an X-macro list like
    FMS_PAGED_ATTENTION_FIELDS), exporting fms_paged_attention and its layout."""
    src = tmp_path / "other.cpp"
    src.write_text(f"""#include "args.h"
using T = {elem};
using KV = T;  // (the pools' storage type: T, or int8_t for the attention_i8 build)
#define FIELDS(X) {fields}
extern "C" {{
FMS_PAGED_ARGS(FmsPagedAttentionArgs, FIELDS, fms_paged_attention_layout)
int fms_paged_attention(const FmsPagedAttentionArgs*) {{ return 0; }}
}}
""")
    path, why = build.build_library("other", [native.compiler(), "-shared", "-fPIC", "-std=c++17",
                                       f"-I{build.KERNELS_DIR}", str(src)], [src.read_text()])
    assert why is None
    return str(path)


def test_library_with_another_layout_is_refused(tmp_path):
    """The operators load a kernel library only when its struct is laid out as theirs (one field
    list, csrc/kernels/kernels.h): a library with two same-typed fields swapped (same kinds, other
    offsets), one with a field more, and one built for another dtype are refused, naming both
    layouts, and the kernel loaded before keeps serving."""
    H, Hkv, D, P = 4, 2, 16, 16
    k, v, table, slots = make_pool([20], H, Hkv, D, P)
    chunks, q = torch.tensor([(0, 0, 20, 0)]), torch.randn(1, H, 20, D)
    good = run(q, k, v, table, chunks, P)
    header = (build.KERNELS_DIR / "kernels.h").read_text()
    start = "#define FMS_PAGED_ATTENTION_FIELDS(X)"
    fields = header[header.index(start) + len(start):header.index("// y [M")]
    fields = fields.replace("\\\n", " ").strip()
    swapped = fields.replace("X(int64_t, q_st) X(int64_t, q_sh)", "X(int64_t, q_sh) X(int64_t, q_st)")
    assert swapped != fields
    cases = [(_library(tmp_path, swapped), torch.float32, r"q_sh:i64@8 q_st:i64@16"),
             (_library(tmp_path, fields + " X(int64_t, extra)"), torch.float32, r"extra:i64@"),
             (_library(tmp_path, fields, "fms_bf16"), torch.float32, r"q:bf16\*@0")]
    for path, dtype, shown in cases:
        with pytest.raises(RuntimeError, match=r"laid out as 'FmsPagedAttentionArgs .*" + shown):
            torch.ops.fms_paged._load_kernel("attention", path, dtype, D)
    assert torch.equal(run(q, k, v, table, chunks, P), good)
    with pytest.raises(ValueError, match=r"kind='other'; expected 'attention', 'gemv', 'rows', "
                                         r"'attention_i8', 'gemm' or 'qgemv'"):
        torch.ops.fms_paged._load_kernel("other", cases[0][0], torch.float32, D)
    with pytest.raises(ValueError, match=r"_kernel_loaded: kind='other'; expected 'attention'"):
        torch.ops.fms_paged._kernel_loaded("other", torch.float32)
    assert torch.ops.fms_paged._kernel_loaded("attention", q.dtype, D)
    with pytest.raises(ValueError, match=r"head_dim=24; expected a multiple of 16"):
        torch.ops.fms_paged._load_kernel("attention", cases[0][0], torch.float32, 24)
