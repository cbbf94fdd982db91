"""8-bit KV pages (`kv_cache_dtype`, `fms_paged.kv.quant`): quantized as ASSIGN writes them, read by
the kernels that dequantize them, copied with their scales by copy-on-write.

References: a kernel's output over 8-bit pages is compared with attention computed by its
definition in float64 over the pages' dequantized keys and values (values * scale, read back by
GATHER), so the only difference is the kernel's own fp32 arithmetic (tolerance 1e-5, as
test_cpu_kernel.py states for fp32). The error of 8-bit pages against 16/32-bit ones is bounded
per element by the quantizer's rounding (int8: half a step, absmax / 254 of a token's head; fp8
e4m3: 2^-4 relative, 3 mantissa bits, plus the smallest subnormal's half at the scale).
"""

import numpy as np
import pytest
import torch

from fms_paged import Engine, SamplingParams, get_model, native
from fms_paged.kv._pool_ops import read_slots
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.kernels.cpp import quantized
from fms_paged.kv.kernels.cpp import ready as cpp_ready
from fms_paged.kv.quant import KVCacheDtypeError, dequantize, quantize, storage_dtype
from fms_paged.models.llama import LLaMA

pytestmark = pytest.mark.usefixtures("cpu_only")

TOL = 1e-5  # fp32 round-off of softmax-weighted sums of a few dozen terms of magnitude ~1
EIGHT_BIT = ("int8", "fp8_e4m3")


def tiny(kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.float32) -> LLaMA:
    """The micro variant's first layer (4 heads over 2 kv heads of 16, random weights), 8-token
    pages."""
    return get_model(variant="micro", attn_impl="paged", device="cpu", dtype=dtype, nlayers=1, page_size=8,
                     kv_cache_dtype=kv_cache_dtype).eval()


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_quantize_error_bound(name):
    """Round trip of one token's head: int8 within half a step (absmax / 254), fp8 e4m3 within
    2^-4 relative (+ half the smallest subnormal, 2^-10, times the scale)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 2, 5)[:, None, None]  # [T, H, D]
    x[0, 0, 7] = 40.0  # an outlier channel
    dt = storage_dtype(name, torch.float32)
    q, s = quantize(x, dt, 1)
    back = dequantize(q, s, torch.float64)
    amax = x.abs().amax(-1, keepdim=True).double()
    if name == "int8":
        bound = amax / 254 * (1 + 1e-6)
    else:
        bound = x.abs().double() * 2**-4 + s.double() * 2**-10  # s: [T, H, 1]
    assert ((back - x.double()).abs() <= bound).all()


def test_all_zero_head_is_exact():
    q, s = quantize(torch.zeros(2, 2, 16), torch.int8, 1)
    assert (s == 0).all() and (dequantize(q, s, torch.float32) == 0).all()


def reference(q, pools, scales, pm, seq, first, n):
    """float64 attention of the chunk's queries q [H, n, D] at positions first .. first + n - 1 of
    `seq` over its keys 0 .. first + n - 1, dequantized from the pages -> [H, n, D]."""
    pos = np.arange(first + n)
    slots = pm.slots([seq] * pos.size, pos)
    k, v = read_slots(*pools, slots, *scales, dtype=torch.float64)  # [1, Hkv, L, D]
    H, Hkv = q.shape[0], k.shape[1]
    k, v = k[0].repeat_interleave(H // Hkv, 0), v[0].repeat_interleave(H // Hkv, 0)  # [H, L, D]
    s = q.double() @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    seen = torch.arange(first + n)[None, :] <= torch.arange(first, first + n)[:, None]
    return torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v


needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")


@pytest.mark.parametrize("kernel,name,dtype", [
    ("gather", "int8", torch.float32), ("gather", "fp8_e4m3", torch.float32),
    pytest.param("cpp", "int8", torch.float32, marks=needs_compiler),
    pytest.param("cpp", "int8", torch.bfloat16, marks=needs_compiler)])
def test_kernel_on_8bit_pages_matches_float64_of_dequantized(kernel, name, dtype):
    """A prefill of two sequences (13 and 70 tokens: page boundaries, part pages; 71 keys with
    a decode row, more than one of the cpp kernel's 64-key blocks), then a decode row each: the
    kernel's outputs against `reference` over the same pages. bf16 queries: the output is rounded
    once to bf16, so the bound is TOL + 2^-8 |ref| (as test_cpu_kernel.py states)."""
    model = tiny(dtype=dtype)
    cache = PagedCache(model, 2, 128, kernel=kernel, kv_cache_dtype=name)
    v = cache.backend.view
    assert v.k_pools[0].dtype == storage_dtype(name, dtype) and v.k_scales[0] is not None
    if kernel == "cpp":  # the operator reads the int8 pages itself (not the torch fallback)
        assert cpp_ready(v) and quantized(v)
    attends_as_reference(cache, dtype, TOL, 0.0 if dtype == torch.float32 else 2.0**-8)


def attends_as_reference(cache: PagedCache, dtype: torch.dtype, atol: float, rtol: float) -> None:
    """A prefill of two sequences (13 and 70 tokens) on `cache` (the micro model's first layer),
    then a decode row each, with random q, k, v in `dtype` on the cache's device: the kernel's
    attention outputs against `reference` over the same pages, within atol + rtol |ref|."""
    v, device = cache.backend.view, cache.backend.device
    g = torch.Generator().manual_seed(2)
    lens = [13, 70]
    _, _, step, _ = cache.prefill([0, 1], [[1] * n for n in lens])
    T = sum(lens)
    q, k, val = (torch.randn(1, h, T, 16, generator=g).to(device, dtype) for h in (4, 2, 2))
    out = step.prepare().attend(0, q, k, val)[0]  # [H, T, D]
    pools, scales = (v.k_pools[0], v.v_pools[0]), v.scales(0)
    off = 0
    for seq, n in enumerate(lens):
        ref = reference(q[0, :, off : off + n], pools, scales, cache.pm, seq, 0, n)
        torch.testing.assert_close(out[:, off : off + n].double(), ref, atol=atol, rtol=rtol)
        off += n
    _, _, dstep = cache.decode([0, 1], torch.tensor([1, 1], device=device), lens, [True, True])
    q, k, val = (torch.randn(2, h, 1, 16, generator=g).to(device, dtype) for h in (4, 2, 2))
    out = dstep.prepare().attend(0, q, k, val)  # [B, H, 1, D]
    for seq, n in enumerate(lens):
        ref = reference(q[seq], pools, scales, cache.pm, seq, n, 1)
        torch.testing.assert_close(out[seq].double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_8bit_pages_close_to_32bit_pages(name):
    """The same steps over fp32 pages and over 8-bit ones: each attention output within the bound
    the keys' and values' rounding allows. With unit-variance keys and values (|k|, |v| <= ~4 over
    16 dims) and q of unit variance, int8 moves a score by <= |q|_1 * absmax / 254 (~0.1) and a value
    by <= absmax / 254 (~0.016); fp8 by <= 2^-4 of each (~0.4 on a score of magnitude ~6, in the
    worst case). Stated bound on the outputs: 0.1 (int8) and 0.5 (fp8); the measured maximum is a
    small fraction of it (asserted below as well, on the mean: 0.01 and 0.05)."""
    g = torch.Generator().manual_seed(3)
    outs = {}
    for kv in ("auto", name):
        cache = PagedCache(tiny(), 1, 64, kernel="gather", kv_cache_dtype=kv)
        g.manual_seed(3)
        _, _, step, _ = cache.prefill([0], [[1] * 20])
        q, k, v = (torch.randn(1, h, 20, 16, generator=g) for h in (4, 2, 2))
        outs[kv] = step.prepare().attend(0, q, k, v)
    err = (outs[name] - outs["auto"]).abs()
    assert err.max() < (0.1 if name == "int8" else 0.5)
    assert err.mean() < (0.01 if name == "int8" else 0.05)


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_fork_copy_on_write_copies_scales(name):
    """Seq 0 holds 10 tokens (page 2 of 8-token pages part full); FORK to seq 1, then a decode on
    seq 1 writes position 10: copy-on-write gives seq 1 its own copy of page 2. Its positions 8, 9
    read back exactly seq 0's values (values and scales copied: a copy without its scales would
    read the zeroed page's 0 scale), and seq 0 is unchanged by seq 1's write."""
    cache = PagedCache(tiny(), 2, 64, kernel="gather", kv_cache_dtype=name)
    v, pm = cache.backend.view, cache.pm
    g = torch.Generator().manual_seed(4)
    _, _, step, _ = cache.prefill([0], [[1] * 10])
    step.prepare().attend(0, *(torch.randn(1, h, 10, 16, generator=g) for h in (4, 2, 2)))
    pools, scales = (v.k_pools[0], v.v_pools[0]), v.scales(0)
    before = read_slots(*pools, pm.slots([0] * 10, np.arange(10)), *scales)
    pm.fork(0, 1)
    _, _, dstep = cache.decode([1], torch.tensor([1]), [10], [True])
    dstep.prepare().attend(0, *(torch.randn(1, h, 1, 16, generator=g) for h in (4, 2, 2)))
    s0, s1 = pm.slots([0, 0], [8, 9]), pm.slots([1, 1], [8, 9])
    assert not torch.equal(s0, s1)  # seq 1 has its own copy of the part-full page
    for a, b in zip(read_slots(*pools, s0, *scales), read_slots(*pools, s1, *scales)):
        assert torch.equal(a, b) and a.abs().sum() > 0
    for a, b in zip(before, read_slots(*pools, pm.slots([0] * 10, np.arange(10)), *scales)):
        assert torch.equal(a, b)
    for sc in scales:  # the copied page's scales, slot by slot
        assert torch.equal(sc[:, :, s0], sc[:, :, s1])


def test_pool_bytes_and_zeroing():
    """int8 pages hold D + 4 bytes per token and kv head (fp32 scale) against 4 D for fp32; a page
    handed out again is zeroed, scales included (a NaN left by a previous owner must not leak)."""
    c32 = PagedCache(tiny(), 1, 64, kernel="gather", num_pages=9)
    c8 = PagedCache(tiny(), 1, 64, kernel="gather", num_pages=9, kv_cache_dtype="int8")
    assert c8.kv_bytes * 4 * 16 == c32.kv_bytes * (16 + 4)
    v = c8.backend.view
    v.k_scales[0].fill_(float("nan"))
    _, _, step, _ = c8.prefill([0], [[1] * 3])
    page = int(c8.pm.page_table[0, 0])
    assert (v.k_scales[0][:, :, page * 8 : page * 8 + 8] == 0).all()


def test_bad_kv_cache_dtype_errors():
    for bad in ("int4", "fp8", None, 8):
        with pytest.raises(KVCacheDtypeError, match=r"kv_cache_dtype=.*expected one of \('auto', 'int8', "
                                                    r"'fp8_e4m3'\)"):
            tiny(kv_cache_dtype=bad)
    with pytest.raises(KVCacheDtypeError, match="'int4'"):
        Engine(tiny(), 1, 64, num_pages=16, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="flex.*8-bit"):
        PagedCache(tiny(), 1, 64, kernel="flex", kv_cache_dtype="int8")


@needs_compiler
def test_cpp_one_call_forward_quantizes_as_written():
    """The one-call forward (`fms_paged::decoder_logits`: C++ ASSIGN quantizing each head's row as
    it writes it) over int8 pages against the same forward over fp32 pages: every dequantized key
    and value within half a step of the fp32 page's (absmax / 254, + 1e-6 for the two paths' own
    fp32 round-off), every scale the fp32 row's absmax / 127 (relative 1e-5); and its logits within
    1e-3 of the modules' path over int8 pages (Python ASSIGN, the operator per layer; a value whose
    fp32 input sits on a rounding edge may land one step apart, ~1% of its row's absmax, which moves
    these logits of magnitude ~1 by far less)."""
    prompt = [[3, 9, 27, 17, 51, 4, 8, 16, 32, 1, 2, 5, 7, 11, 13, 19, 23, 29, 31, 37]]
    model = tiny()
    runs = {}
    for kv, fused in (("auto", True), ("int8", True), ("int8", False)):
        cache = PagedCache(model, 1, 64, kernel="cpp", kv_cache_dtype=kv)
        tokens, positions, step, _ = cache.prefill([0], prompt)
        step.fused = fused
        assert step.fused == fused  # (the C++ path is loaded: fused unless asked not to be)
        with torch.inference_mode():
            logits = model(tokens, positions, step)
        v = cache.backend.view
        slots = cache.pm.slots([0] * 20, list(range(20)))
        runs[kv, fused] = (logits, read_slots(v.k_pools[0], v.v_pools[0], slots, *v.scales(0)),
                           [s[:, :, slots] if s is not None else None for s in v.scales(0)])
    ref_kv, got_kv, scales = runs["auto", True][1], runs["int8", True][1], runs["int8", True][2]
    for ref, got, s in zip(ref_kv, got_kv, scales):
        amax = ref.abs().amax(-1, keepdim=True)
        assert ((got - ref).abs() <= amax / 254 + 1e-6).all()
        torch.testing.assert_close(s, amax / 127, rtol=1e-5, atol=0)
    torch.testing.assert_close(runs["int8", True][0], runs["int8", False][0], rtol=0, atol=1e-3)


@needs_compiler
def test_decode_greedy_in_one_call_on_int8_pages():
    """`CppKernel.decode_greedy` (several greedy steps in one operator call) over int8 pages gives
    the tokens that as many one-step forwards over int8 pages give (the same C++ path, step by
    step)."""
    model = tiny()
    outs = []
    for one_call in (True, False):
        cache = PagedCache(model, 1, 64, kernel="cpp", kv_cache_dtype="int8")
        tokens, positions, step, last = cache.prefill([0], [[3, 9, 27, 17, 51, 4, 8]])
        with torch.inference_mode():
            tok = model(tokens, positions, step)[0, -1].argmax().view(1)
            cache.backend.prepare_pages(cache.pm.reserve([0], [7 + 6]))
            if one_call:
                got = cache.kernel.decode_greedy(model, tok, torch.tensor([7]), torch.tensor([0]),
                                                 cache.backend.view, 6)
                assert got is not None
                outs.append(got[0].tolist())
                continue
            seq = []
            for j in range(6):
                t, p, s = cache.backend.decode_inputs([0], tok, [7 + j], [True])
                tok = model(t, p, s)[0, -1].argmax().view(1)
                seq.append(int(tok))
            outs.append(seq)
    assert outs[0] == outs[1]


def test_engine_prefix_cache_and_n_on_int8_pages():
    """Prefix caching and n > 1 (FORK, copy-on-write) on int8 pages: a request whose prompt shares
    two full pages with an earlier one (a prefix-cache hit: the cached pages and their scales read
    again) and n=2 greedy completions (forked pages, a divergent write each) give the tokens the
    same requests give with prefix caching off."""
    model = tiny("int8")
    prompt = [3, 9, 27, 17, 51, 4, 8, 16, 32, 1, 2, 5, 7, 11, 13, 19, 23]  # two full 8-token pages + 1

    def run(eng, ids, n):
        rid = eng.add_request(ids, SamplingParams(max_new_tokens=6, ignore_eos=True, n=n))
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                assert o.request_id == rid
                got.setdefault(o.index, []).extend(o.new_token_ids)
        return [got[i] for i in sorted(got)]

    outs = {}
    for prefix_caching in (True, False):
        eng = Engine(model, 4, 256, num_pages=64, compile=False, enable_prefix_caching=prefix_caching,
                     max_model_len=256)
        assert eng.backend.kv_cache_dtype == "int8"
        outs[prefix_caching] = (run(eng, prompt, 1), run(eng, prompt + [40, 41], 2))
        if prefix_caching:
            assert eng.metrics()["prefix_cache_hits"] >= 2, eng.metrics()  # pages
    assert outs[True] == outs[False]
    assert len(outs[True][1]) == 2


def test_serve_kv_cache_dtype_reaches_the_engine():
    """`fms-paged serve --kv-cache-dtype int8` builds an engine whose pages are int8; a bad value is
    a usage error naming the choices."""
    from fms_paged.cli import build_parser
    from fms_paged.serve.loop import build_engine
    from fms_paged.serve.server import engine_spec

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--device", "cpu",
                                      "--max-model-len", "256", "--kv-memory-fraction", "0.01"])
    spec = engine_spec(args)
    assert spec["kv_cache_dtype"] == "int8"
    eng = build_engine(spec)
    try:
        assert eng.backend.k_pools[0].dtype == torch.int8 and eng.backend.k_scales[0] is not None
    finally:
        eng.shutdown()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


@needs_compiler
def test_compiled_steps_on_int8_pages_give_the_eager_tokens():
    """compile=True on int8 pages: the compiled steps call `fms_paged::paged_attention_i8` (traced
    through its fake) and give the eager engine's greedy tokens."""
    model = get_model(variant="micro", attn_impl="paged", device="cpu", page_size=16)
    outs = []
    for compiled in (False, True):
        eng = Engine(model, 2, 64, num_pages=64, max_model_len=256, compile=compiled, kv_cache_dtype="int8",
                     kernel="cpp")
        eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=6, ignore_eos=True))
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]) == 6
