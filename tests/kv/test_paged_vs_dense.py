"""attn_impl="paged" against the dense SDPA backend on the same weights (fp32).

Lockstep: both backends prefill the same prompts, then decode the same tokens; the logits of every
prompt position and of every decode step must agree to 1e-5 (fp32 round-off: the two paths sum the
same products in different orders). Wide parametrizations use the kernels that need no compile
(cpp runs as an op, gather is eager); compiled flex cases share one pool size so they share compiled
kernels. `flex_prefill=True` runs the flex kernel's BlockMask prefill (CUDA's path) on the CPU.
Models run on the test device (`--device`); off the CPU the cpp cases skip (a CPU kernel), and flex
needs pages of whole Triton tiles (16 tokens). The HF reference stays on the CPU.
"""

import random

import numpy as np
import pytest
import torch

from fms_paged import generate, get_model
from fms_paged.kv.cache import PagedCache, make_cache
from fms_paged.kv.kernels import choose_kernel, flex_kernel_options, flex_unavailable_reason
from fms_paged.kv.spec import AttentionSpec

TOL = 1e-5
NUM_PAGES = 160  # compiled cases all use this pool so they share kernels


def pair(device, **cfg):
    dense = get_model(variant="micro", device=device, seed=0, **cfg)
    paged = get_model(variant="micro", device=device, seed=0, attn_impl="paged", **cfg)
    assert all(
        torch.equal(a, b) for a, b in zip(dense.state_dict().values(), paged.state_dict().values())
    )
    return dense, paged


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def lockstep(
    dense,
    paged,
    prompts,
    steps,
    *,
    kernel,
    num_pages=None,
    seq_ids=None,
    max_batch=None,
    before=None,
    flex_prefill=None,
):
    """Max |logit difference| over all prompt positions and `steps` decode steps."""
    B = len(prompts)
    seq_ids = seq_ids or list(range(B))
    max_len = max(map(len, prompts)) + steps + 1
    dc = make_cache(dense, B, max_len)
    pc = PagedCache(paged, max_batch or B, max_len, num_pages=num_pages, kernel=kernel)
    if flex_prefill is not None:
        pc.kernel.blockmask_prefill = flex_prefill
    if before is not None:
        before(pc)
    t, p, s, _ = dc.prefill(list(range(B)), prompts)
    d_logits = dense(t, p, s)  # [B, S, V]
    t, p, s, _ = pc.prefill(seq_ids, prompts)
    p_logits = paged(t, p, s)  # packed [1, T', V]
    worst = 0.0
    off = 0
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        got = p_logits[0, off : off + n]
        worst = max(worst, (got - d_logits[b, :n]).abs().max().item())
        off += n
    lengths = [len(q) for q in prompts]
    tok = torch.stack([d_logits[b, n - 1].argmax() for b, n in enumerate(lengths)])
    for _ in range(steps):
        t, p, s = dc.decode(list(range(B)), tok, lengths, [True] * B)
        d = dense(t, p, s)[:, -1]
        t, p, s = pc.decode(seq_ids, tok, lengths, [True] * B)
        g = paged(t, p, s)[:, -1]
        assert torch.isfinite(g).all()
        worst = max(worst, (g - d).abs().max().item())
        lengths = [n + 1 for n in lengths]
        tok = d.argmax(-1)
    return worst


LENGTHS = [1, 15, 17, 232, 1000]


@pytest.mark.parametrize("kernel", ["cpp", "gather"])
@pytest.mark.parametrize("P", [16, 32, 64, 128])
def test_matches_dense_all_page_sizes(P, kernel, device, require_kernel):
    require_kernel(kernel, P)
    dense, paged = pair(device, page_size=P)
    assert lockstep(dense, paged, prompts_of(LENGTHS), steps=P + 2, kernel=kernel) <= TOL


KERNEL_CASES = [("cpp", None), ("flex", True), ("flex", None), ("gather", None)]
KERNEL_IDS = ["cpp", "flex-blockmask-prefill", "flex", "gather"]


@pytest.mark.parametrize("kernel,flex_prefill", KERNEL_CASES, ids=KERNEL_IDS)
def test_kernels_match_dense(kernel, flex_prefill, device, require_kernel):
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)
    worst = lockstep(
        dense,
        paged,
        prompts_of([1, 15, 17, 232, 100]),
        steps=20,
        kernel=kernel,
        num_pages=NUM_PAGES,
        max_batch=8,
        flex_prefill=flex_prefill,
    )
    assert worst <= TOL


def test_gqa_4_to_1(device):
    """(head_dim 8 here: the cpp kernel's GQA cases are in test_cpu_kernel.)"""
    dense, paged = pair(device, page_size=16, nheads=8, kvheads=2)
    assert lockstep(dense, paged, prompts_of([17, 40, 3]), steps=10, kernel="gather") <= TOL


@pytest.mark.parametrize("kernel", ["cpp", "flex"])
def test_shuffled_pages_and_noncontiguous_rows(kernel, device, require_kernel):
    """Scattered physical pages, and sequences held in rows 5, 2, 7 of an 8-row backend."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)

    def scatter(pc):
        random.Random(0).shuffle(pc.pm._free)

    worst = lockstep(
        dense,
        paged,
        prompts_of([40, 9, 70]),
        steps=20,
        kernel=kernel,
        num_pages=NUM_PAGES,
        seq_ids=[5, 2, 7],
        max_batch=8,
        before=scatter,
    )
    assert worst <= TOL


@pytest.mark.parametrize("kernel", ["cpp", "flex", "gather"])
def test_nan_filled_pages_are_reused_safely(kernel, device, require_kernel):
    """Pages of an erased sequence, filled with NaN, are handed to new sequences: the output stays
    finite and equal to dense (flex and gather zero new pages on RESERVE; the cpp kernel reads no
    slot past a row's position; freed pages are never listed)."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)

    def poison(pc):
        pc.prefill([0, 1], prompts_of([80, 37], seed=9))
        pc.release([0, 1])
        for pool in pc.k_pools + pc.v_pools:
            pool[:, :, 16:] = float("nan")  # every page but the null page
        pc.pm._free.rotate(3)  # reuse in a different order

    worst = lockstep(
        dense,
        paged,
        prompts_of([30, 5, 64]),
        steps=20,
        kernel=kernel,
        num_pages=NUM_PAGES,
        max_batch=8,
        before=poison,
    )
    assert worst <= TOL


@pytest.mark.parametrize("kernel,flex_prefill", KERNEL_CASES, ids=KERNEL_IDS)
def test_chunked_prefill_through_pages(kernel, flex_prefill, device, require_kernel):
    """A prompt fed in chunks (each chunk reads the earlier ones from the pool) equals dense."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)
    x = prompts_of([150])[0]
    pc = PagedCache(paged, 1, 160, num_pages=NUM_PAGES, kernel=kernel)
    if flex_prefill is not None:
        pc.kernel.blockmask_prefill = flex_prefill
    outs = []
    with torch.inference_mode():
        for start in range(0, 150, 37):
            t, p, s, _ = pc.prefill([0], [x[start : start + 37]], [start])
            outs.append(paged(t, p, s)[0, : len(x[start : start + 37])])
        ref = dense(torch.tensor([x], device=device))[0]
    assert (torch.cat(outs) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("kernel,flex_prefill", KERNEL_CASES, ids=KERNEL_IDS)
def test_mixed_step_decodes_and_chunks_match_dense(kernel, flex_prefill, device, require_kernel):
    """One forward holding 3 decode rows (padded to 4) and 2 prefill chunks (one of them the middle
    of a prompt): every logit equals the dense model run without a cache over each whole sequence."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)
    prompts = prompts_of([20, 33, 16, 50, 70], seed=4)
    pc = PagedCache(paged, 8, 160, num_pages=NUM_PAGES, kernel=kernel)
    if flex_prefill is not None:
        pc.kernel.blockmask_prefill = flex_prefill
    with torch.inference_mode():
        t, p, s, _ = pc.prefill([0, 1, 2], prompts[:3])  # the decoding sequences' prompts
        paged(t, p, s)
        t, p, s, _ = pc.prefill([4], [prompts[4][:30]])  # a prompt half prefilled
        paged(t, p, s)
        new_tok = [7, 8, 9]
        dec_ids, lengths = [0, 1, 2, 0], [20, 33, 16, 0]
        chunks, starts = [prompts[3], prompts[4][30:]], [0, 30]
        t, p, s, last = pc.mixed(dec_ids, torch.tensor(new_tok + [0], device=device), lengths,
                                 [True] * 3 + [False], [3, 4], chunks, starts)
        logits = paged(t, p, s)[0]  # [4 + Tp, V]
        worst = 0.0
        for row, prompt in enumerate(prompts[:3]):
            ref = dense(torch.tensor([prompt + [new_tok[row]]], device=device))[0, -1]
            worst = max(worst, (logits[row] - ref).abs().max().item())
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            ref = dense(torch.tensor([prompts[3 + i]], device=device))[0, start:]
            got = logits[int(last[i]) - len(chunk) + 1 : int(last[i]) + 1]
            worst = max(worst, (got - ref).abs().max().item())
    assert worst <= TOL


@pytest.mark.parametrize("kernel", ["cpp", "flex", "gather"])
def test_forked_sequences_diverge_correctly(kernel, device, require_kernel):
    """FORK shares the prompt's pages; each branch then decodes its own tokens (copy-on-write of
    the partial last page) and matches a dense run of its own full sequence."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)
    prompt = prompts_of([21])[0]
    pc = PagedCache(paged, 8, 64, num_pages=NUM_PAGES, kernel=kernel)
    with torch.inference_mode():
        t, p, s, _ = pc.prefill([0], [prompt])
        paged(t, p, s)
        pc.pm.fork(0, 1)
        shared = set(pc.pm.pages_of(0)) & set(pc.pm.pages_of(1))
        assert len(shared) == 2
        branches = {0: [7, 8, 9], 1: [100, 101, 102]}
        got = {0: [], 1: []}
        for k in range(3):
            tok = torch.tensor([branches[0][k], branches[1][k]], device=device)
            t, p, s = pc.decode([0, 1], tok, [21 + k] * 2, [True, True])
            logits = paged(t, p, s)[:, -1]
            for b in (0, 1):
                got[b].append(logits[b])
        for b in (0, 1):
            ref = dense(torch.tensor([prompt + branches[b]], device=device))[0, 21:]
            assert (torch.stack(got[b]) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("kernel,whole_step", [("flex", False), ("flex", True), ("cpp", True)],
                         ids=["flex-per-layer", "flex-compiled-step", "cpp-compiled-step"])
def test_zero_recompiles_over_500_decode_steps(kernel, whole_step, device, require_kernel):
    """After warm-up, 500 decode steps with growing lengths and sequences leaving and joining (new
    prompts prefilled into freed rows) run without a single recompilation (Dynamo raises if one
    happens) and without graph breaks (fullgraph=True): with the model run op by op (the flex
    kernel compiled per layer), and with the whole decode step one compiled graph (flex, and the
    cpp kernel as an opaque op)."""
    require_kernel(kernel)
    import torch._dynamo

    from fms_paged.engine.model_step import compiled_decode, decode_one_token

    _, paged = pair(device, page_size=16)
    step_fn = compiled_decode(static_shapes=True) if whole_step else decode_one_token
    B, max_len = 4, 160
    pc = PagedCache(paged, B, max_len, num_pages=NUM_PAGES, kernel=kernel)
    rng = np.random.default_rng(0)
    lengths, budget = [0] * B, [0] * B

    def join(row):
        n = int(rng.integers(1, 40))
        t, p, s, _ = pc.prefill([row], [rng.integers(3, 256, n).tolist()])
        paged(t, p, s)
        lengths[row], budget[row] = n, int(rng.integers(5, max_len - n))

    with torch.inference_mode():
        for row in range(B):  # warm-up: compiles the decode shape and the 128-token prefill bucket
            join(row)
        t, p, s = pc.decode(list(range(B)), torch.ones(B, dtype=torch.long, device=device), lengths,
                            [True] * B)
        step_fn(paged, t, p, s)
        lengths = [n + 1 for n in lengths]
        leaves = joins = 0
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(500):
                for row in range(B):
                    if budget[row] <= 0:
                        pc.release([row])
                        leaves += 1
                        join(row)
                        joins += 1
                tok = torch.randint(3, 256, (B,), device=device)
                t, p, s = pc.decode(list(range(B)), tok, lengths, [True] * B)
                step_fn(paged, t, p, s)
                lengths = [n + 1 for n in lengths]
                budget = [b - 1 for b in budget]
    assert leaves > 5 and joins > 5


def test_decode_with_wrong_lengths_raises_and_changes_nothing(device):
    """A decode step whose lengths disagree with what the sequences hold is refused with a typed
    error naming the sequence, before any page or length changes (row 0 alone would be fine)."""
    _, paged = pair(device, page_size=16)
    pc = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="gather")
    pc.prefill([0, 1], prompts_of([5, 16]))
    free, lens, table = pc.pm.num_free_pages, pc.pm.seq_lens.clone(), pc.pm.page_table.clone()
    with pytest.raises(ValueError, match="seq 1 holds 16 tokens"):
        pc.decode([0, 1], torch.tensor([3, 4], device=device), [5, 17], [True, True])
    assert pc.pm.num_free_pages == free
    assert torch.equal(pc.pm.seq_lens, lens) and torch.equal(pc.pm.page_table, table)


def test_forced_fallback_is_announced_and_equal(monkeypatch, device):
    dense, paged = pair(device, page_size=16)
    monkeypatch.setenv("FMS_PAGED_FORCE_GATHER", "1")
    prompts = prompts_of([5, 30, 12])
    with pytest.warns(UserWarning, match="falls back to GATHER"):
        cache = make_cache(paged, 3, 64)
    assert cache.kernel.name == "gather"
    assert generate(paged, prompts, 16, eos_id=None, cache=cache) == generate(
        dense, prompts, 16, eos_id=None
    )


def test_python_without_headers_falls_back_before_compiling(monkeypatch, tmp_path):
    """Inductor's CPU kernels include Python.h: a Python without its headers (a distro base image
    without python3-dev) must fall back, announced, instead of dying in the first compile; and the
    probe `fms-paged info` runs compiles a real call where the headers are there. (The CPU's
    compile path whatever the test device.)"""
    import sysconfig

    from fms_paged.kv import kernels as paged_mod

    assert paged_mod.probe_compiled_flex(torch.device("cpu")) is None
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path)})
    reason = paged_mod.flex_unavailable_reason(torch.device("cpu"))
    assert f"no Python.h in {tmp_path}" in reason and "python3-dev" in reason
    assert paged_mod.probe_compiled_flex(torch.device("cpu")) == reason
    with pytest.warns(UserWarning, match="falls back to GATHER \\+ SDPA: no Python.h"):
        assert paged_mod.choose_kernel("auto", torch.device("cpu")).name == "gather"


@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 96, 128, 256, 384])
def test_cuda_flex_tile_divides_the_page(page_size):
    """Triton's flex kernels need each KV block (one page) to be whole BLOCK_N tiles of >= 16
    columns; inductor's default BLOCK_N (up to 128) is kept only where it divides every page.
    (Checked on the options: this machine has no GPU.)"""
    opts = flex_kernel_options(torch.device("cuda"), page_size)
    if page_size % 128 == 0:
        assert opts is None
    else:
        assert 16 <= opts["BLOCK_N"] <= 64 and page_size % opts["BLOCK_N"] == 0
    assert flex_kernel_options(torch.device("cpu"), page_size) is None  # the C++ kernel's tile is the page
    assert flex_unavailable_reason(torch.device("cuda"), page_size) != (
        f"page_size={page_size} is not a multiple of 16 (Triton's smallest KV tile)"
    )


@pytest.mark.parametrize("page_size", [1, 4, 8, 24])
def test_cuda_pages_below_a_triton_tile_fall_back(page_size):
    reason = flex_unavailable_reason(torch.device("cuda"), page_size)
    assert reason == f"page_size={page_size} is not a multiple of 16 (Triton's smallest KV tile)"


def test_cuda_heads_below_16_fall_back_or_are_refused():
    """Inductor's Triton flex lowering refuses heads under 16 wide (NotImplementedError at compile
    time, as a GPU run found): "auto" announces GATHER + SDPA for them, "flex" is a ValueError."""
    cuda = torch.device("cuda")
    assert "head_dim=8" in flex_unavailable_reason(cuda, 16, head_dim=8)
    with pytest.warns(UserWarning, match="head_dim=8"):
        assert choose_kernel("auto", cuda, 16, head_dim=8, dtype=torch.float32).name == "gather"
    with pytest.raises(ValueError, match="head_dim=8"):
        choose_kernel("flex", cuda, 16, head_dim=8, dtype=torch.float32)
    assert choose_kernel("flex", cuda, 16, head_dim=16, dtype=torch.float32).name == "flex"


def test_generate_paged_equals_dense_and_hf(hf_checkpoint, hf_greedy, device):
    """8 mixed-length prompts x 64 new tokens: identical greedy tokens for paged, dense and HF (on
    the CPU, fp32)."""
    hf, path = hf_checkpoint("gqa")
    dense = get_model(model_path=path, device=device)
    paged = get_model(model_path=path, device=device, attn_impl="paged", page_size=16)
    prompts = prompts_of([3, 17, 9, 33, 1, 24, 16, 48], seed=4)
    got = generate(paged, prompts, 64, eos_id=None)
    assert got == generate(dense, prompts, 64, eos_id=None)
    assert got == hf_greedy(hf, prompts, 64)


def test_finished_sequence_pages_are_freed_at_once(device):
    _, paged = pair(device, page_size=16)
    cache = make_cache(paged, 2, 80, kernel="gather")
    free0 = cache.pm.num_free_pages
    seen = []

    def on_token(i, tok):
        seen.append((i, cache.pm.num_free_pages))

    eos = generate(paged, [[5, 6, 7]], 8, eos_id=None)[0][2]  # seq 0 emits this at step 3
    generate(paged, [[5, 6, 7], [9] * 40], 8, eos_id=eos, on_token=on_token, cache=cache)
    assert cache.pm.num_free_pages == free0  # everything returned at the end
    # right after seq 0 finished (its 3rd token), its page was back in the pool
    after = [n for i, n in seen if i == 1]
    assert max(after[3:]) > min(after[:2])


@pytest.mark.parametrize("kernel", ["flex", "gather"])
def test_bf16_agreement(kernel, device, require_kernel):
    """bf16: paged and dense differ only by accumulation order. Both are compared with the fp32
    dense reference; paged must be no further from it than dense bf16 plus bf16 rounding of the
    logits (2**-8 relative, ~ 0.4% of the largest logit)."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16, dtype=None)
    prompts = prompts_of([30, 7, 64])
    ref = lockstep_logits(dense, prompts)
    dense16 = dense.to(torch.bfloat16)
    paged16 = paged.to(torch.bfloat16)
    d = lockstep_logits(dense16, prompts)
    p = lockstep_logits(paged16, prompts, kernel=kernel)
    scale = ref.abs().max().item()
    err_dense = (d - ref).abs().max().item()
    err_paged = (p - ref).abs().max().item()
    assert err_paged <= err_dense + 2**-8 * scale
    assert (p - d).abs().max().item() <= 2 * err_dense + 2**-8 * scale


@torch.inference_mode()
def lockstep_logits(model, prompts, kernel=None):
    kw = {} if model.config.attn_impl == "sdpa" else {"kernel": kernel, "num_pages": NUM_PAGES}
    cache = make_cache(model, len(prompts), 80, **kw)
    t, p, s, last = cache.prefill(list(range(len(prompts))), prompts)
    return model(t, p, s).flatten(0, 1)[last].float()


def test_user_score_mod_same_in_packed_decode_and_prefill(device, require_kernel):
    """A user score_mod in logical coordinates (head- and distance-dependent) gives the same logits
    whether a token is decoded (GQA groups packed into the query) or prefilled (one query per head):
    the wrapper maps packed (kv head, group index) back to the query head and positions to logical.
    (Heads of 16: Triton's flex compiles no smaller.)"""
    _, paged = pair(device, page_size=16, emb_dim=128, nheads=8, kvheads=2)

    def bias(score, b, h, q_pos, kv_pos):
        return score + 0.05 * h - 0.02 * (q_pos - kv_pos)

    require_kernel("flex")
    x = prompts_of([40])[0]
    with torch.inference_mode():
        full = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex", score_mod=bias)
        t, p, s, _ = full.prefill([0], [x])
        ref = paged(t, p, s)[0, len(x) - 1]
        inc = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex", score_mod=bias)
        t, p, s, _ = inc.prefill([0], [x[:-1]])
        paged(t, p, s)
        t, p, s = inc.decode([0, 1], torch.tensor([x[-1], 0], device=device), [len(x) - 1, 0],
                             [True, False])
        got = paged(t, p, s)[0, -1]
        plain = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex")
        t, p, s, _ = plain.prefill([0], [x])
        unbiased = paged(t, p, s)[0, len(x) - 1]
    assert (got - ref).abs().max().item() <= TOL
    assert (ref - unbiased).abs().max().item() > 1e-2  # the score_mod really changed the result


def test_padded_prefill_hands_the_model_valid_positions(device, require_kernel):
    """The flex kernel's BlockMask prefill pads its packed row to a bucket: the pad tokens'
    positions, handed to the model, are 0 (-1 is the masks' "no query" alone: a model with a
    position-embedding table indexed with it hit a device-side assert on CUDA)."""
    require_kernel("flex")
    _, paged = pair(device, page_size=16)
    cache = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex",
                       score_mod=lambda score, b, h, q, kv: score)  # the BlockMask path on the CPU too
    tokens, positions, _, _ = cache.prefill([0, 1], prompts_of([5, 9]))
    assert tokens.shape == positions.shape and positions.shape[1] > 14  # padded
    assert positions[0, :14].tolist() == [*range(5), *range(9)]
    assert positions[0, 14:].eq(0).all()


def test_prefill_path_choice_and_score_mod_errors(device, require_kernel):
    """CPU: the flex kernel prefills by GATHER + SDPA per chunk unless a score_mod needs its
    BlockMask path (elsewhere always the BlockMask path); a score_mod with a kernel that cannot
    apply it is refused."""
    require_kernel("flex")
    _, paged = pair(device, page_size=16)
    plain = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex")
    assert plain.kernel.blockmask_prefill == (device.type != "cpu")
    with_mod = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex",
                          score_mod=lambda score, b, h, q, kv: score)
    assert with_mod.kernel.blockmask_prefill
    for kernel in ("gather", "cpp"):
        with pytest.raises(ValueError, match="score_mod"):
            PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel=kernel,
                       score_mod=lambda score, b, h, q, kv: score)
    with pytest.raises(ValueError, match="kernel='flex-eager'"):
        PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel="flex-eager")


@pytest.mark.parametrize("kernel,flex_prefill", KERNEL_CASES, ids=KERNEL_IDS)
def test_steps_assign_through_the_checked_write_and_gather_reads_it_back(kernel, flex_prefill, device,
                                                                          require_kernel):
    """Every kernel's step ASSIGNs through the page manager's validated `write_slots` (a wrong
    dtype or shape is refused with a typed error, the pool unchanged), and the page manager's
    GATHER reads back exactly what was written, in logical order."""
    require_kernel(kernel)
    _, paged = pair(device, page_size=16)
    pc = PagedCache(paged, 2, 64, num_pages=NUM_PAGES, kernel=kernel)
    if flex_prefill is not None:
        pc.kernel.blockmask_prefill = flex_prefill
    tokens, _, step, _ = pc.prefill([1], [prompts_of([21])[0]])
    step = step.prepare()
    T = tokens.shape[1]  # 21, or flex's BlockMask prefill bucket (its padding writes the null page)
    kp, vp = pc.k_pools[0], pc.v_pools[0]
    k = torch.randn(1, kp.shape[1], T, kp.shape[3], device=device)
    before = kp.clone()
    with pytest.raises(TypeError, match="dtype"):
        step.store(kp, vp, k.double(), k.double())
    with pytest.raises(ValueError, match="shape"):
        step.store(kp, vp, k[:, :, : T - 1], k[:, :, : T - 1])
    torch.testing.assert_close(kp, before, rtol=0, atol=0, equal_nan=True)  # unwritten slots: stale
    step.store(kp, vp, k, 2 * k)
    got_k, got_v, lens = pc.pm.gather([1], kp, vp)
    assert lens.tolist() == [21]
    assert torch.equal(got_k[0], k[0, :, :21]) and torch.equal(got_v[0], 2 * k[0, :, :21])


SPEC_CASES = {  # every variant an AttentionSpec carries, on the micro model's 2 layers
    "window": lambda D: (AttentionSpec(D**-0.5, window=20), AttentionSpec(D**-0.5)),
    "softcap-scale": lambda D: (AttentionSpec(0.9, softcap=1.5), AttentionSpec(0.6, window=7, softcap=2.0)),
    "sinks": lambda D: (AttentionSpec(D**-0.5, sinks=torch.tensor([0.5, -1.0, 3.0, 0.0])),
                        AttentionSpec(D**-0.5, window=9, sinks=torch.tensor([2.0, 1.0, -2.0, 4.0]))),
}


@pytest.mark.parametrize("kernel", ["cpp", "flex", "gather"])
@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_every_kernel_applies_the_layer_specs(case, kernel, device, require_kernel, monkeypatch):
    """Per-layer specs (windows, soft-caps, scales, sinks) on each kernel against the dense cache,
    whose attention is the same math written out in fp32 (`fms_paged.kv.spec.attend`): prompts
    past the windows, decode steps across them. Flex on the CPU applies sinks only through an
    eager flex_attention here (inductor's CPU flex returns no log-sum-exp, so `choose_kernel`
    refuses it there): the correction itself, which CUDA runs compiled, is what is checked."""
    require_kernel(kernel)
    dense, paged = pair(device, page_size=16)
    specs = SPEC_CASES[case](paged.config.head_dim)
    for model in (dense, paged):
        monkeypatch.setattr(model, "attention_specs", lambda: specs, raising=False)
    before = None
    if kernel == "flex" and case == "sinks" and device.type == "cpu":
        from torch.nn.attention.flex_attention import flex_attention

        from fms_paged.kv.kernels import flex as flex_mod

        monkeypatch.setattr(flex_mod, "compiled_flex", lambda dynamic: flex_attention)

        def before(pc):  # a flex kernel where `choose_kernel` refuses one
            pc.backend.kernel = pc.kernel = flex_mod.FlexKernel(device, 16)
            # eager flex_attention scores the whole pool, masked slots included (0 x NaN is NaN):
            # the pool starts zeroed, not with whatever the allocator reused
            for pool in (*pc.k_pools, *pc.v_pools):
                pool.zero_()

        kernel = "gather"
    worst = lockstep(dense, paged, prompts_of([30, 5, 47]), steps=16, kernel=kernel, num_pages=NUM_PAGES,
                     max_batch=8, before=before)
    assert worst <= TOL
