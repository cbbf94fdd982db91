"""The whole decode step as one compiled graph (`compiled_decode`, gpt-fast's decode_one_token).

The paged step compiles the BlockMask build, the K/V writes into the per-layer pools and every
layer's flex_attention together; it must give the dense backend's logits (fp32 round-off, 1e-5),
never recompile while lengths grow and sequences leave and join, and make `generate` return the
same greedy tokens as the eager dense path. All cases share one shape (micro model, 4 rows, a
160-page pool), so the graph is compiled once per test process.
"""

import numpy as np
import torch

from fms_paged import generate, get_model
from fms_paged.generation.generate import compiled_decode
from fms_paged.kv.cache import make_cache
from fms_paged.kv.paged import PagedBackend

TOL = 1e-5  # fp32: the backends sum the same products in different orders
B, NUM_PAGES, MAX_LEN = 4, 160, 160


def models():
    dense = get_model(variant="micro", device="cpu", seed=0)
    paged = get_model(variant="micro", device="cpu", seed=0, attn_impl="paged", page_size=16)
    return dense, paged


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def test_compiled_paged_step_matches_dense_logits():
    """4 rows with lengths that cross page boundaries during the run; row 2 finishes halfway (its
    pages are erased and the row keeps decoding as inactive, masked out)."""
    dense, paged = models()
    step_fn = compiled_decode(static_shapes=True)
    prompts = prompts_of([15, 1, 33, 16])
    dc = make_cache(dense, B, MAX_LEN)
    pc = PagedBackend(paged, B, MAX_LEN, num_pages=NUM_PAGES, kernel="flex")
    t, p, s, last = dc.prefill(list(range(B)), prompts)
    tok = dense(t, p, s).flatten(0, 1)[last].argmax(-1)
    t, p, s, _ = pc.prefill(list(range(B)), prompts)
    paged(t, p, s)
    lengths, active = [len(q) for q in prompts], [True] * B
    worst = 0.0
    for i in range(40):
        if i == 20:
            active[2] = False
            pc.release([2])
        t, p, s = dc.decode(list(range(B)), tok, lengths, [True] * B)
        d = dense(t, p, s)[:, -1]
        t, p, s = pc.decode(list(range(B)), tok, lengths, active)
        g = step_fn(paged, t, p, s)
        rows = [b for b in range(B) if active[b]]
        worst = max(worst, (g[rows] - d[rows]).abs().max().item())
        assert torch.isfinite(g).all()
        lengths = [n + 1 for n in lengths]
        tok = d.argmax(-1)
    assert worst <= TOL


@torch.inference_mode()
def test_compiled_paged_step_never_recompiles():
    """After warm-up, 500 compiled decode steps with growing lengths and sequences leaving and
    joining (new prompts prefilled into freed rows): Dynamo raises on any recompilation, and
    fullgraph=True on any graph break."""
    import torch._dynamo

    _, paged = models()
    step_fn = compiled_decode(static_shapes=True)
    pc = PagedBackend(paged, B, MAX_LEN, num_pages=NUM_PAGES, kernel="flex")
    rng = np.random.default_rng(1)
    lengths, budget = [0] * B, [0] * B

    def join(row):
        n = int(rng.integers(1, 40))
        t, p, s, _ = pc.prefill([row], [rng.integers(3, 256, n).tolist()])
        paged(t, p, s)
        lengths[row], budget[row] = n, int(rng.integers(5, MAX_LEN - n))

    for row in range(B):
        join(row)
    t, p, s = pc.decode(list(range(B)), torch.ones(B, dtype=torch.long), lengths, [True] * B)
    step_fn(paged, t, p, s)  # warm-up: compiles the step (or reuses it)
    lengths = [n + 1 for n in lengths]
    leaves = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(500):
            for row in range(B):
                if budget[row] <= 0:
                    pc.release([row])
                    leaves += 1
                    join(row)
            tok = torch.randint(3, 256, (B,))
            t, p, s = pc.decode(list(range(B)), tok, lengths, [True] * B)
            step_fn(paged, t, p, s)
            lengths = [n + 1 for n in lengths]
            budget = [b - 1 for b in budget]
    assert leaves > 5


def test_generate_compiled_equals_eager_dense():
    """`generate(compile=True)`: greedy tokens of the compiled paged and compiled dense steps equal
    the eager dense path's, for a mixed-length batch."""
    dense, paged = models()
    prompts = prompts_of([3, 17, 40, 9], seed=3)
    want = generate(dense, prompts, 24, eos_id=None)
    cache = make_cache(paged, B, MAX_LEN, num_pages=NUM_PAGES, kernel="flex")
    assert generate(paged, prompts, 24, eos_id=None, cache=cache, compile=True) == want
    assert generate(dense, prompts, 24, eos_id=None, compile=True) == want
