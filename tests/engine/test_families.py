"""The engine on every family we load: under preemption, prefix-cache hits, chunked prefill and n > 1,
each request gets the tokens it gets alone (dense `generate`, which test_families ties to
transformers), and the page pool accounts for every page after every step. For a model whose every
layer is windowed (Mistral), the pages behind the window are released as requests grow: a request
holds at most the pages of a step and the window before it, and the outputs do not change. With
lookahead decode steps (`decode_steps=4`) the tokens are the same.

The device's production kernel (cpp on the CPU), eager steps; pages of 16 tokens, a token budget
of 32 (prompts of up to 70 tokens are prefilled in chunks), a pool small enough to preempt, four
prompts sharing a 32-token prefix (two full pages: prefix hits).
"""

import pytest
import torch

from fms_paged import Engine, SamplingParams, generate, get_model
from fms_paged.kv.geometry import NULL_PAGE, page_slots, pages_held
from fms_paged.kv.paged import model_groups
from tests.conftest import FAMILY_WINDOW, HF_FAMILIES

# families whose layers keep different histories: pages held per layer group (full / sliding)
GROUPED = ("qwen2", "qwen3", "gemma2", "gemma3")

P, BUDGET, NEW = 16, 32, 24
LENGTHS = (40, 70, 45, 36)  # each after the shared 32-token prefix


def kernel_for(device: torch.device) -> str:
    return "cpp" if device.type == "cpu" else "auto"


def slices(eng: Engine) -> list[tuple[list[int], int | None]]:
    """Per layer slice of the engine's pages: (the page table row offset, its window)."""
    groups = eng.backend.groups
    return [(g * eng.pm.max_seqs, w if groups.grouped else eng.horizon) for g, w in enumerate(groups.windows)]


def check_pool(eng: Engine) -> None:
    """Every page is free, held by a running request or by the prefix cache (exactly once: pages
    counted per layer slice), and the pages behind a windowed slice's window are released."""
    pm, cache = eng.pm, eng.prefix_cache
    used = set(cache.pages) | set(cache.owner) if cache is not None else set()
    table = pm.host_table
    held_total = 0
    for r in eng.scheduler.running:
        for base, window in slices(eng):
            pages = table[base + r.seq_id, : -(-pm.length(r.seq_id) // P)].tolist()
            used |= {p for p in pages if p != NULL_PAGE}
            held = sum(p != NULL_PAGE for p in pages)
            held_total += held
            if window is not None:
                # released at the start of the step, which added at most BUDGET tokens
                behind = max(0, r.num_computed - BUDGET - window + 1) // P
                assert all(p == NULL_PAGE for p in pages[:behind]), (r.num_computed, pages)
                assert held <= pages_held(r.num_tokens, P, window, BUDGET), (held, r.num_tokens)
    assert len(used) + pm.num_free_pages == pm.num_pages - 1
    if cache is None:  # no page is shared: each held page belongs to one request's one slice
        assert held_total + pm.num_free_pages == pm.num_pages - 1


def poison_free(eng: Engine) -> None:
    """Fill every free page with NaN in every pool tensor: a kernel that read a released (or any
    unowned) page would turn a request's logits NaN and its tokens would change."""
    free = eng.pm.free_pages
    if free:
        idx = torch.as_tensor(page_slots(torch.tensor(free), P).reshape(-1), device=eng.backend.device)
        for pool in eng.backend.k_tensors + eng.backend.v_tensors:  # (8-bit pages: their scales)
            if pool.is_floating_point():
                pool.index_fill_(2, idx, float("nan"))


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_each_request_gets_its_tokens_alone(family, hf_family, device):
    _, path = hf_family(family)
    dense = get_model(model_path=path, device=device, page_size=P)
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 256, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 256, (n - 32,), generator=g).tolist() for n in LENGTHS]
    alone = [generate(dense, [p], NEW, eos_id=None)[0] for p in prompts]
    windowed = family == "mistral"
    # the KV bytes of 8 (10) pages of every layer, in pages of one layer slice (layer groups)
    groups = model_groups(paged)
    per_layers = paged.config.nlayers // groups.layers_per_slice
    num_pages = (8 if windowed else 10) * per_layers
    eng = Engine(paged, max_num_seqs=3, max_num_batched_tokens=BUDGET, num_pages=num_pages,
                 max_model_len=128, compile=False, kernel=kernel_for(device))
    assert (eng.horizon == FAMILY_WINDOW) == windowed
    assert groups.grouped == (family in GROUPED), groups
    # the second request in two completions (n=2: the second FORKs the first's pages, in every
    # layer group), greedy: each gets that prompt's tokens
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, n=2 if i == 1 else 1))
           for i, p in enumerate(prompts)]
    got: dict[int, list[int]] = {}
    forked: list[int] = []
    most = 0
    while eng.has_unfinished():
        for out in eng.step():
            (forked if out.index else got.setdefault(out.request_id, [])).extend(out.new_token_ids)
        check_pool(eng)
        most = max([most] + [sum(p != NULL_PAGE for p in eng.pm.pages_of(r.seq_id))
                             for r in eng.scheduler.running])
        poison_free(eng)
    assert [got[i] for i in ids] == alone and forked == alone[1]
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["prefix_cache_hits"] > 0
    if windowed:  # a whole request would hold 7 pages; behind the window it held at most 5
        assert most <= pages_held(70 + NEW, P, FAMILY_WINDOW, BUDGET) < pages_held(70 + NEW, P)
    eng.reset_prefix_cache()
    assert eng.pm.num_free_pages == eng.pm.num_pages - 1
    # lookahead decode steps (up to 4 greedy steps in one call once nothing waits): the same tokens
    eng = Engine(paged, max_num_seqs=3, max_num_batched_tokens=BUDGET, num_pages=num_pages,
                 max_model_len=128, compile=False, kernel=kernel_for(device), decode_steps=4)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
    got, multi = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            multi += len(out.new_token_ids) > 1
        check_pool(eng)
    assert [got[i] for i in ids] == alone and (multi > 0 or device.type != "cpu")


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_compiled_steps_give_the_eager_tokens(family, hf_family, device):
    """compile=True (the compiled decode and prefill graphs) on the families whose layers differ
    most (windows on some layers, Gemma 2's soft-caps, Gemma 3's two RoPE tables and q/k norms):
    the tokens of the eager engine, through chunked prefill and a mixed step."""
    _, path = hf_family(family)
    paged = get_model(model_path=path, device=device, page_size=P, attn_impl="paged")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (45, 3, 70)]
    outs = []
    for compile in (False, True):
        eng = Engine(paged, max_num_seqs=3, max_num_batched_tokens=BUDGET, num_pages=32, max_model_len=128,
                     compile=compile, kernel=kernel_for(device))
        assert eng.runner.compiled == compile
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
        got: dict[int, list[int]] = {}
        for out in eng.stream():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs.append([got[i] for i in ids])
    assert outs[0] == outs[1]
