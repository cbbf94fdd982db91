"""A model loaded (get_model) and run under each grad mode: `torch.inference_mode()`, `torch.no_grad()`
or neither, dense (`attn_impl="sdpa"`) and paged (the cpp kernel), against an independent reference.

Loading under `inference_mode` makes every weight an inference tensor (no version counter), the
case the packed-weight cache of `fms_paged.modules.linear` must key without `_version`. The
prompts take each CPU projection path: 300 tokens (>= PACK_MIN_ROWS: the oneDNN-packed GEMM, pinned
here whichever GEMM this CPU takes by default: its packed copies are the state kept per weight; the
GEMM kernel keeps none) and 5 tokens (<= GEMV_MAX_ROWS: the GEMV kernel); the paged model also
decodes one token for each prompt (the GEMV kernel and the attention kernel's decode rows).

Reference: the same weights (same seed) in a dense model with `linear_impl="torch"` (F.linear
everywhere: no packed copy, no GEMV kernel), loaded and run under `no_grad`. Tolerance 1e-5
absolute and relative on logits of magnitude below ~1: fp32 round-off of the paths' differently
ordered sums (oneDNN's blocked GEMM, the GEMV kernel, the paged kernel's online softmax) over at
most 128 terms per dot product, far below it; a stale or wrong weight would differ by ~0.1.

Everything runs on the test device (`--device`); off the CPU there are no packed or GEMV paths, and
the paged model runs the device's kernel (flex on CUDA), so the cells check the grad modes alone.
"""

import contextlib

import pytest
import torch

from fms_paged import get_model
from fms_paged.kv.cache import PagedCache
from fms_paged.modules import linear as L
from tests.conftest import gemm_kind

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}
LONG, SHORT = 300, 5
assert LONG >= L.PACK_MIN_ROWS and SHORT <= L.GEMV_MAX_ROWS


@pytest.fixture(autouse=True)
def packed_gemm():
    """oneDNN's packed GEMM past the GEMV's rows inside each test (module docstring)."""
    with gemm_kind("packed"):
        yield


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (LONG, SHORT)]


@pytest.fixture(scope="module")
def reference(device):
    """Per prompt: the reference logits [n, V] of its tokens, and [V] of the next token after the
    prompt and its greedy next token (which the paged model decodes)."""
    ref = get_model(variant="micro", device=device, seed=0, linear_impl="torch")
    out = []
    with torch.no_grad():
        for p in prompts():
            logits = ref(torch.tensor([p], device=device))[0]  # [n, V]
            nxt = int(logits[-1].argmax())
            out.append((logits, nxt, ref(torch.tensor([p + [nxt]], device=device))[0, -1]))
    return out


CELLS = [pytest.param(load, run, id=f"load_{load}-run_{run}") for load in MODES for run in MODES]


@pytest.mark.parametrize("load, run", CELLS)
def test_dense(load, run, reference, device):
    with MODES[load]():
        model = get_model(variant="micro", device=device, seed=0, attn_impl="sdpa")
    assert model.head.weight.is_inference() == (load == "inference_mode")
    for p, (want, _, _) in zip(prompts(), reference):
        with MODES[run]():
            got = model(torch.tensor([p], device=device))[0]
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("load, run", CELLS)
def test_paged(load, run, reference, device, paged_kernel):
    with MODES[load]():
        model = get_model(variant="micro", device=device, seed=0, attn_impl="paged", page_size=16)
    with MODES[run]():
        backend = PagedCache(model, 2, LONG + 2)
        assert backend.kernel.name == paged_kernel  # "auto": cpp on the CPU, flex on CUDA
        ps = prompts()
        for seq, (p, (want, _, _)) in enumerate(zip(ps, reference)):  # one prefill per prompt
            tokens, positions, step, _ = backend.prefill([seq], [p])  # a kernel may pad the row
            torch.testing.assert_close(model(tokens, positions, step)[0, : len(p)], want, **TOL)
        nxt = torch.tensor([r[1] for r in reference], device=device)
        tokens, positions, step = backend.decode([0, 1], nxt, [len(p) for p in ps], [True, True])
        got = model(tokens, positions, step)[:, -1]  # [2, V]
    torch.testing.assert_close(got, torch.stack([r[2] for r in reference]), **TOL)
    # the pools are a cache, never part of an autograd graph; where one was recorded (weights that
    # require grad, run with grad), a backward pass through the paged attention is refused
    assert not any(pool.requires_grad for pool in backend.backend.k_pools + backend.backend.v_pools)
    # (weights made under no_grad require grad too)
    assert got.requires_grad == (load != "inference_mode" and run == "grad")
    if got.requires_grad:
        with pytest.raises(RuntimeError, match="paged attention has no backward pass"):
            got.sum().backward()
