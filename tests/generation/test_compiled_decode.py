"""The whole decode step as one compiled graph (`compiled_decode`, gpt-fast's decode_one_token).

The paged step compiles the BlockMask build, the K/V writes into the per-layer pools and every
layer's flex_attention together; it must give the dense backend's logits (fp32 round-off, 1e-5) and
make `generate` return the same greedy tokens as the eager dense path. (That it never recompiles
over 500 steps with sequences leaving and joining is tested with the per-layer kernel in
tests/kv/test_paged_vs_dense.py.) The cases share one shape (micro model, 4 rows, a 160-page pool),
so the graph is compiled once per test process. Models on the test device (`--device`).
"""

import os
import subprocess
import sys

import torch

from fms_paged import generate, get_model
from fms_paged.engine.model_step import compiled_decode
from fms_paged.kv.cache import PagedCache, make_cache

TOL = 1e-5  # fp32: the backends sum the same products in different orders
B, NUM_PAGES, MAX_LEN = 4, 160, 160


def models(device):
    dense = get_model(variant="micro", device=device, seed=0)
    paged = get_model(variant="micro", device=device, seed=0, attn_impl="paged", page_size=16)
    return dense, paged


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def test_compiled_paged_step_matches_dense_logits(device):
    """4 rows with lengths that cross page boundaries during the run; row 2 finishes halfway (its
    pages are erased and the row keeps decoding as inactive, masked out)."""
    dense, paged = models(device)
    step_fn = compiled_decode(static_shapes=True)
    prompts = prompts_of([15, 1, 33, 16])
    dc = make_cache(dense, B, MAX_LEN)
    pc = PagedCache(paged, B, MAX_LEN, num_pages=NUM_PAGES, kernel="flex")
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


def test_generate_compiled_equals_eager_dense(device):
    """`generate(compile=True)`: greedy tokens of the compiled paged and compiled dense steps equal
    the eager dense path's, for a mixed-length batch."""
    dense, paged = models(device)
    prompts = prompts_of([3, 17, 40, 9], seed=3)
    want = generate(dense, prompts, 24, eos_id=None)
    cache = make_cache(paged, B, MAX_LEN, num_pages=NUM_PAGES, kernel="flex")
    assert generate(paged, prompts, 24, eos_id=None, cache=cache, compile=True) == want
    assert generate(dense, prompts, 24, eos_id=None, compile=True) == want


@torch.inference_mode()
def test_prepare_returns_a_new_step_and_leaves_its_input_alone(device):
    """`prepare` runs inside the compiled step: attribute writes on its input object would be
    replayed in Python after the graph on every call (for the paged step, rebuilding a BlockMask
    and its mask_mod closure). Every backend's steps must leave their input untouched; decode
    steps return a new, ready step, whose own `prepare` is then a no-op."""
    dense, paged = models(device)
    caches = [make_cache(dense, 2, 64), make_cache(paged, 2, 64, kernel="flex"),
              make_cache(paged, 2, 64, kernel="gather")]
    for cache in caches:
        steps = [cache.prefill([0, 1], prompts_of([15, 3]))[2],
                 cache.decode([0, 1], torch.tensor([5, 6], device=device), [15, 3], [True, True])[2]]
        for i, step in enumerate(steps):
            before = {k: id(v) for k, v in vars(step).items()}
            ready = step.prepare()
            assert {k: id(v) for k, v in vars(step).items()} == before, (cache, i)
            assert ready.prepare() is ready
            if i == 1:
                assert ready is not step


def test_a_compiled_decode_step_waits_for_a_first_starts_builds(tmp_path):
    """`decode_fn(..., compile=True)` in a first start (an empty kernel cache: the model's builds
    still compiling in the background, its eager steps served by torch's operations meanwhile)
    waits for the builds and loads the kernel before it traces, so the graph calls the operators
    (not their fallbacks, nor operators not registered yet) and gives the eager step's logits. In a
    fresh interpreter, whose kernel cache is `tmp_path`."""
    code = (
        "import torch\n"
        "from fms_paged import get_model, native\n"
        "from fms_paged.engine.model_step import decode_fn\n"
        "from fms_paged.kv.cache import PagedCache\n"
        "model = get_model(variant='micro', attn_impl='paged', page_size=16, seed=0, device='cpu')\n"
        "assert native.compiling()  # an empty cache: the builds started with the model\n"
        "cache = PagedCache(model, 2, 64, kernel='cpp')\n"
        "with torch.inference_mode():\n"
        "    tokens, positions, step, last = cache.prefill([0, 1], [[5, 6, 7], [8, 9]])\n"
        "    nxt = model(tokens, positions, step, logits_at=last).argmax(-1)\n"
        "    decode = decode_fn(cache, compile=True)\n"
        "    assert not native.compiling() and native.ready(torch.float32, model.config.head_dim)\n"
        "    tokens, positions, step = cache.decode([0, 1], nxt, [3, 2], [True, True])\n"
        "    got = decode(model, tokens, positions, step)\n"
        "    want = model(tokens, positions, step)[:, -1]  # eager: the same keys to the same slots\n"
        "print(float((got - want).abs().max()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FMS_PAGED_WAIT_FOR_BUILDS"}
    env["FMS_PAGED_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split()[-1]) <= TOL
