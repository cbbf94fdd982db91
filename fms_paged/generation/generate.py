"""Batch generation: `attn_impl="paged"` runs on the continuous-batching `Engine`; the dense
backend (`attn_impl="sdpa"`) is the static-batch baseline (prefill once, then one token per step
for the whole batch, finished rows kept in place).

Both give the same greedy tokens, and the same sampled tokens for a seed: every prompt samples from
a generator of its own seeded with `seed`, so a prompt's tokens do not depend on the rest of the
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fms_paged.engine import Engine, SamplingParams
from fms_paged.engine.model_step import compiled_decode, decode_fn, decode_one_token
from fms_paged.engine.request import check_prompt
from fms_paged.engine.sampling import sample_each
from fms_paged.engine.tensor_parallel import run_worker
from fms_paged.kv.cache import KVCacheBackend, make_cache
from fms_paged.kv.geometry import min_pool_pages, pages_for
from fms_paged.kv.paged import model_groups

__all__ = ["compiled_decode", "decode_fn", "decode_one_token", "generate", "validate_prompts"]

_MODEL_EOS: Any = object()
MAX_PREFILL_TOKENS = 8192  # the engine's token budget per forward when generate() drives it


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int,
                     max_new_tokens: int = 0) -> list[list[int]]:
    """Return prompts as lists of Python ints, or raise a typed error naming the offending value."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    out = []
    for i, prompt in enumerate(prompts):
        ids = check_prompt(prompt, vocab_size, f"prompt {i}")
        if len(ids) + max_new_tokens > max_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's maximum sequence length {max_len}"
            )
        out.append(ids)
    return out


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = _MODEL_EOS,
    on_token: Callable[[int, int], None] | None = None,
    cache: KVCacheBackend | None = None,
    compile: bool = False,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` new tokens for each prompt; returns only the new tokens.

    Greedy by default; `temperature > 0` samples (optionally top-k / top-p), each prompt from a
    generator of its own seeded with `seed` (the global RNG when `seed` is None). A sequence stops
    after emitting an EOS token (`eos_id`; default: the model config's `eos_token_id`; `None`
    disables). `on_token(prompt_index, token)` streams tokens as they come.
    `attn_impl="paged"`: the prompts are requests of an `Engine` (continuous batching; its pool is
    sized by memory, see `fms_paged.kv.budget.kv_cache_budget`, or is `cache`'s). Dense: one
    static batch in `cache` (made by `fms_paged.kv.make_cache`) or in a cache made for this call.
    `compile=True` runs each decode step as one compiled graph (`compiled_decode`); the first call
    compiles it (tens of seconds on a CPU), later calls with the same shapes reuse it.
    A model split over tensor-parallel ranks (`fms_paged.parallel.shard`, under torchrun): every
    rank calls `generate` with the same arguments and gets the same tokens; rank 0 runs the
    engine (and `on_token`), the others follow it.
    `num_beams > 1`: beam search on the engine (`SamplingParams(use_beam_search=True)`, with
    `length_penalty` and `early_stopping` as Hugging Face's); each prompt's best hypothesis is
    returned, and `on_token` sees its tokens once the search ends. Paged models only, greedy.
    """
    config = model.config
    # validates max_new_tokens and the sampling values, with the engine's messages
    beams = num_beams if isinstance(num_beams, int) and not isinstance(num_beams, bool) else None
    if beams is None or beams < 1:
        raise ValueError(f"num_beams={num_beams!r}; expected an int >= 1")
    search = dict(n=beams, use_beam_search=True, length_penalty=length_penalty,
                  early_stopping=early_stopping) if beams > 1 else {}
    SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, **search)
    if search and config.attn_impl != "paged":
        raise ValueError(f"num_beams={num_beams} runs on the engine: load the model with attn_impl='paged' "
                         f"(got {config.attn_impl!r})")
    prompts = validate_prompts(prompts, config.src_vocab_size, config.max_expected_seq_len,
                               max_new_tokens)
    if eos_id is _MODEL_EOS:
        eos_id = config.eos_token_id
    eos = set() if eos_id is None else ({eos_id} if isinstance(eos_id, int) else set(eos_id))

    if config.attn_impl == "paged":
        return _generate_on_engine(model, prompts, max_new_tokens, eos, on_token, cache, compile,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **search)
    return _generate_static(model, prompts, max_new_tokens, eos, on_token, cache, compile,
                            (temperature, top_k, top_p, seed))


def _generate_on_engine(model, prompts, max_new_tokens, eos, on_token, cache, compile,
                        **sampling) -> list[list[int]]:
    """Every prompt a request of an `Engine` (on `cache`'s pool, or a pool of its own).

    The engine's max_model_len is what these prompts need, rounded up to a power of two (>= 1024,
    at most the model's): a long-context model is not refused for a budget its prompts never use,
    and few page-table widths (compiled shapes) come up from call to call. Its own pool holds every
    request whole (no preemption) and one sequence of max_model_len, in a power-of-two number of
    pages (few pool shapes from call to call): what the call needs, not a share of the device's
    memory, which on a GPU would be most of it on every call."""
    n, k = len(prompts), sampling.get("n", 1)  # (k beams: a row each)
    rows = n * k if cache is None else max(k, min(n * k, cache.max_batch))
    budget = max(rows, min(sum(map(len, prompts)), MAX_PREFILL_TOKENS))
    need = max(map(len, prompts)) + max_new_tokens
    max_model_len = min(model.config.max_expected_seq_len, max(1024, 1 << (need - 1).bit_length()))
    if cache is not None:
        cache.reset()
    num_pages = None
    if cache is None:
        P = model.config.page_size
        # every request whole in every layer slice (`fms_paged.kv.groups`) and the null page, and
        # at least what one sequence of max_model_len needs (every page held: no window release
        # counted), rounded up to a power of two
        G = model_groups(model).num_slices
        need = max(G * sum(k * pages_for(len(p) + max_new_tokens, P) + (k > 1) for p in prompts) + 1,
                   G * (min_pool_pages(max_model_len, P) - 1) + 1)
        num_pages = 1 << (need - 1).bit_length()
    engine = Engine(model, max_num_seqs=rows, max_num_batched_tokens=budget, compile=compile,
                    max_model_len=max_model_len, backend=cache, num_pages=num_pages)
    if engine.tp_rank != 0:  # a split model on a rank other than 0: follow rank 0, get its tokens
        out = run_worker(engine)
        engine.shutdown()
        return out
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(eos),
                            ignore_eos=True, **sampling)
    index = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in range(n)]
    for o in engine.stream():
        if o.index:  # (beam search: the best hypothesis, index 0)
            continue
        i = index[o.request_id]
        out[i] += o.new_token_ids
        if on_token is not None:
            for t in o.new_token_ids:
                on_token(i, t)
    if engine.control is not None:  # split: every rank returns these tokens
        engine.shutdown(result=out)
    else:
        engine.reset_prefix_cache()  # a given cache's pages all go back to its pool
    return out


def _generate_static(model, prompts, max_new_tokens, eos, on_token, cache, compile,
                     sampling) -> list[list[int]]:
    """The dense baseline: one static batch, prefilled at once, decoded until every row is done."""
    temperature, top_k, top_p, seed = sampling
    n = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    if cache is None:
        cache = make_cache(model, max_batch=n, max_seq_len=max_len)
    settings = []
    for _ in range(n):  # each row's own generator: its tokens do not depend on the other rows
        generator = None
        if temperature > 0 and seed is not None:
            generator = torch.Generator(device=model.device).manual_seed(seed)
        settings.append((temperature, top_k, top_p, generator))

    seq_ids = list(range(n))
    decode = decode_fn(cache, compile)
    cache.reset()
    tokens, positions, step, last = cache.prefill(seq_ids, prompts)
    logits = model(tokens, positions, step, logits_at=last)  # [B, V]: last prompt tokens only
    next_tok = sample_each(logits.float(), settings)

    out: list[list[int]] = [[] for _ in range(n)]
    lengths = [len(p) for p in prompts]  # tokens in the cache per sequence
    active = [True] * n
    for _ in range(max_new_tokens):
        host_tok = next_tok.tolist()  # the one host sync per step: EOS checks and streaming
        for i in range(n):
            if not active[i]:
                continue
            out[i].append(host_tok[i])
            if on_token is not None:
                on_token(i, host_tok[i])
            if host_tok[i] in eos or len(out[i]) == max_new_tokens:
                active[i] = False
                cache.release([i])
        if not any(active):
            break
        tokens, positions, step = cache.decode(seq_ids, next_tok, lengths, active)
        for i in range(n):
            lengths[i] += active[i]
        logits = decode(model, tokens, positions, step)  # [B, V]
        next_tok = sample_each(logits.float(), settings)
    cache.release([i for i in range(n) if active[i]])
    return out
