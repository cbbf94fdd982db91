"""Our paged KV cache as a registered attention op of IBM Foundation Model Stack (`ibm-fms`).

`register()` adds the op `"paged_flex"` to FMS's attention registry (`fms.modules.attention`); an
FMS model then runs it per forward call with `attn_name="paged_flex"`:
- store op: ASSIGN the step's keys and values into the layer's page pools (the layer's
  `past_key_value_state` is its pair of pools);
- compute op: the device's paged kernel (cpp on the CPU, compiled FlexAttention elsewhere, or the
  GATHER + SDPA fallback) over those pools through the block table, with the step's metadata
  shared by every layer, under the attention FMS asks for in the call: its `scale_factor`
  (Granite's attention multiplier), and where FMS passes them (models with attention sinks:
  gpt-oss) the `sinks` and the layer's `sliding_window`.
The step itself (slots, chunk list or BlockMask: `fms_paged.kv.kernels.PoolStep`) travels in the
attention kwargs as `paged_step`, built once per forward by our `PagedBackend` from its `PageManager`.

Two ways to drive it:
- `PagedFMSCache` with FMS's own `fms.utils.generation.generate` (a rectangular, left-padded batch);
- `paged_model(model)`, an adapter with our model's interface, so `fms_paged.Engine` serves an FMS
  LLaMA with continuous batching (`Engine(fms_model)` wraps it itself).

With tensor parallelism (`distributed_strategy="tp"`), each rank's attention modules hold its
share of the heads; the pools are sized from those modules, so each rank's pool holds its heads'
slice of every page, and every rank runs the same page-manager calls, hence the same page table.

ibm-fms is imported lazily: `pip install 'fms_paged[fms]'` (ImportError naming that otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping, Sequence

import torch
from torch import nn

from fms_paged.device import default_page_size
from fms_paged.kv.cache import PagedCache
from fms_paged.kv.kernels import PoolStep
from fms_paged.kv.spec import AttentionSpec

ATTN_NAME = "paged_flex"
STEP_KWARG = "paged_step"
CACHE_KWARG = "paged_cache"


def _fms_attention():
    try:
        import fms.modules.attention as fms_attention
    except ImportError as e:
        raise ImportError(
            "fms_paged.integrations.fms needs IBM Foundation Model Stack: pip install 'fms_paged[fms]' "
            f"(the ibm-fms package) ({e})"
        ) from None
    return fms_attention


def register() -> str:
    """Register the `"paged_flex"` attention op with FMS (idempotent) -> its name."""
    fms_attention = _fms_attention()
    try:
        fms_attention.register_attention_op(
            ATTN_NAME, _store_op, _compute_op,
            update_attn_kwargs_op=_update_attn_kwargs_op,
            validate_attn_kwargs_op=_validate_attn_kwargs_op,
        )
    except KeyError:  # registered already: by this module (maybe a reloaded copy of it), or not
        store = fms_attention.get_attention_type(attn_name=ATTN_NAME)["store"]
        if getattr(store, "__qualname__", None) != _store_op.__qualname__ or (
            store.__module__ != _store_op.__module__
        ):
            raise KeyError(
                f"an FMS attention op named {ATTN_NAME!r} is registered already, by "
                f"{store.__module__}, not by fms_paged"
            ) from None
    return ATTN_NAME


# ---------------------------------------------------------------------------------- the op
def _step(kwargs: MutableMapping) -> PoolStep:
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, PoolStep):
        raise ValueError(
            f"attn_name={ATTN_NAME!r} needs the attention kwarg {STEP_KWARG!r} (a prepared "
            f"fms_paged step), got {type(step).__name__}: drive the model through "
            "fms_paged.integrations.fms.PagedFMSCache (with fms generate) or fms_paged.Engine"
        )
    return step


def _scales(step, key_cache: torch.Tensor) -> tuple:
    """The 8-bit pages' (k_scales, v_scales) of the layer whose pool `key_cache` is (FMS hands the
    ops a layer's pools, or views of them, not its index), (None, None) for 16/32-bit pools."""
    view = step.view
    if not view.k_scales or view.k_scales[0] is None:
        return None, None
    ptr = key_cache.data_ptr()
    layer = next(i for i, pool in enumerate(view.k_pools) if pool.data_ptr() == ptr)
    return view.scales(layer)


@torch.no_grad()  # an inference cache: no autograd through the pools (nor flex on the CPU)
def _store_op(keys, values, key_cache, value_cache, **kwargs):
    # keys, values: [b, q, kvh, d]; key_cache, value_cache: this layer's pools [1, kvh, NP, d]
    step = _step(kwargs)
    if key_cache is None or value_cache is None:
        raise ValueError(
            f"attn_name={ATTN_NAME!r} needs past_key_value_states = the page pools (one (k, v) "
            "pair per layer), got None"
        )
    step.store(key_cache, value_cache, keys.detach().transpose(1, 2), values.detach().transpose(1, 2),
               _scales(step, key_cache))
    # returned as views: FMS's generate marks the returned cache's dim 2 dynamic, which must not
    # reach the pools themselves (our compiled kernels are specialised on the pool's size); the
    # hook hands the pools in again each step
    return key_cache, value_cache, key_cache.view(key_cache.shape), value_cache.view(value_cache.shape)


@torch.no_grad()
def _compute_op(query, key_cache, value_cache, nheads, kvheads, p_dropout, scale_factor, **kwargs):
    # query: [b, q, h, d] -> [b, q, h, d]
    step = _step(kwargs)
    if p_dropout:
        raise ValueError(f"attn_name={ATTN_NAME!r} is for inference: p_dropout={p_dropout}, expected 0")
    spec = call_spec(query.shape[-1], scale_factor, kwargs)
    # a 4-D buffer of its own: under torch.compile, FMS's RoPE leaves q as a view of a 5-D buffer,
    # which inductor's CPU flex_attention lowering rejects (it reads q's storage layout as 4-D);
    # a plain clone is dropped as a no-op, a clone to another memory format is not
    query = query.detach().clone(memory_format=torch.channels_last).contiguous()
    return step.attention(query.transpose(1, 2), key_cache, value_cache, spec,
                          _scales(step, key_cache)).transpose(1, 2).contiguous()


def call_spec(head_dim: int, scale_factor: float | None, kwargs: MutableMapping) -> AttentionSpec:
    """The attention an FMS layer asks for in a call: its scale (None: 1/sqrt(head_dim)), and the
    sinks and sliding window FMS passes to models with sinks (a window of 0: none)."""
    window = kwargs.get("sliding_window") or None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attn_name={ATTN_NAME!r}: sliding_window={window!r}; expected an int >= 0")
    sinks = kwargs.get("sinks")
    return AttentionSpec(scale=head_dim**-0.5 if scale_factor is None else float(scale_factor), window=window,
                         sinks=None if sinks is None else sinks.detach())


def _update_attn_kwargs_op(**kwargs):
    """Between steps of FMS's generate: the decode step of the batch's next token."""
    cache = kwargs.get(CACHE_KWARG)
    if isinstance(cache, PagedFMSCache):
        kwargs[STEP_KWARG] = cache.advance()
    return kwargs


def _validate_attn_kwargs_op(input_ids, position_ids, past_key_value_states=None, **kwargs):
    _step(kwargs)
    if position_ids is None:
        raise ValueError(
            f"attn_name={ATTN_NAME!r} needs position_ids (token positions cannot be inferred "
            "from a page pool's shape)"
        )


class _Relayout(PoolStep):
    """A backend step run on FMS's rectangular left-padded batch [B, S]: the real tokens (in
    sequence order) move to the backend's layout [B', S'] and back; pad tokens are neither stored
    nor attended, and their outputs are 0. src / dst: [T] flat indices of the real tokens in each."""

    def __init__(self, step: PoolStep, src: torch.Tensor, dst: torch.Tensor, shape: tuple[int, int]):
        self.step, self.src, self.dst, self.shape = step, src, dst, shape
        self.view, self.slots = step.view, step.slots

    def _to_backend(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, H, S, D] -> [B', H, S', D]
        B, H, S, D = x.shape
        flat = x.transpose(1, 2).reshape(B * S, H, D).index_select(0, self.src)
        out = flat.new_zeros(self.shape[0] * self.shape[1], H, D).index_copy_(0, self.dst, flat)
        return out.view(*self.shape, H, D).transpose(1, 2)

    def store(self, kp, vp, k, v, scales=(None, None)) -> None:
        self.step.store(kp, vp, self._to_backend(k), self._to_backend(v), scales)

    def attention(self, q, kp, vp, spec, scales=(None, None)) -> torch.Tensor:
        B, H, S, D = q.shape
        out = self.step.attention(self._to_backend(q), kp, vp, spec, scales)  # [B', H, S', D]
        flat = out.transpose(1, 2).reshape(-1, H, D).index_select(0, self.dst)
        back = flat.new_zeros(B * S, H, D).index_copy_(0, self.src, flat)
        return back.view(B, S, H, D).transpose(1, 2)


# ---------------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class FMSPagedConfig:
    """What our backend and engine read of a model's config, taken from an FMS model (heads per
    rank under tensor parallelism)."""

    nlayers: int
    nheads: int
    kvheads: int
    head_dim: int
    src_vocab_size: int
    max_expected_seq_len: int
    page_size: int = 16
    eos_token_id: int | tuple[int, ...] | None = None
    attn_impl: str = "paged"


def refusal(model: nn.Module) -> str | None:
    """Why our adapter cannot compute an FMS model exactly (None if it can): a model that is not a
    decoder of attention layers (base_model + head), a multimodal one (its text decoder, the
    `language_model`, can be served on its own), layers without attention (Mamba: their
    recurrent state is not a page pool), or blocks that replace an attention op named like ours
    by one of their own."""
    name = f"{type(model).__module__}.{type(model).__name__}"
    if hasattr(model, "language_model") and hasattr(model, "vision_tower"):
        return (f"{name} is multimodal (vision_tower + language_model): Engine serves its text decoder, "
                "`model.language_model`, on token prompts")
    mha = _fms_attention().MultiHeadAttention
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is None or not hasattr(model, "head") or not any(isinstance(m, mha) for m in model.modules()):
        return (f"expected an FMS decoder model (base_model.layers + head, with fms MultiHeadAttention "
                f"layers), got {name}")
    plain = [i for i, block in enumerate(layers) if not any(isinstance(m, mha) for m in block.modules())]
    if plain:
        return (f"{name}: layers {plain[:8]} have no attention (Mamba mixers, attn_layer_indices): their "
                "recurrent state is not held in a KV page pool")
    if any(hasattr(block, "window_length") for block in layers):
        return (f"{name}: its blocks (window_length) run their own attention op in place of any op whose "
                "name contains 'paged' (spyre_paged_attn_with_sinks), not ours")
    return None


class PagedFMSModel(nn.Module):
    """An FMS decoder behind our model's interface (`forward(tokens, positions, step, logits_at)`),
    with its attention run by the `"paged_flex"` op, so that `PagedBackend` and `Engine` drive it.
    The FMS model itself is unchanged (and still serves other attention ops). Each layer's
    `AttentionSpec` (`attention_specs`) is what its FMS attention module asks for: its
    `scale_factor`, its sinks, and its block's sliding window (gpt-oss's `layer_sliding_window`),
    so that a step prepares the masks of every window the layers use. TypeError for a model it
    cannot compute exactly (`refusal`)."""

    def __init__(self, model: nn.Module, page_size: int | None = None,
                 eos_token_id: int | tuple[int, ...] | None = None):
        super().__init__()
        register()
        why = refusal(model)
        if why is not None:
            raise TypeError(why)
        mha = _fms_attention().MultiHeadAttention
        attns = [m for m in model.modules() if isinstance(m, mha)]
        if page_size is None:
            page_size = default_page_size(next(model.parameters()).device)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r}; expected an int >= 1 or None (the device's default)")
        a, c = attns[0], model.config
        self.fms_model = model
        self.tp = _tensor_parallel(model)  # FMS's own split ("tp"): the Engine's ranks follow it
        windows = [getattr(block, "layer_sliding_window", 0) or None for block in model.base_model.layers]
        self._specs = tuple(
            AttentionSpec(scale=m.emb_kq_per_head**-0.5 if m.scale_factor is None else float(m.scale_factor),
                          window=w, sinks=m.sinks.detach() if getattr(m, "has_sinks", False) else None)
            for m, w in zip(attns, windows))
        # logits divided by this after the head (Granite's forward does so; base_model + head don't)
        self.logits_scaling = float(getattr(c, "logits_scaling", 1.0) or 1.0)
        self.config = FMSPagedConfig(
            nlayers=len(attns), nheads=a.nheads, kvheads=a.kvheads, head_dim=a.emb_kq_per_head,
            src_vocab_size=c.src_vocab_size, max_expected_seq_len=c.max_expected_seq_len,
            page_size=page_size, eos_token_id=eos_token_id,
        )

    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        return self._specs

    @property
    def device(self) -> torch.device:
        return next(self.fms_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.fms_model.parameters()).dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                step: PoolStep | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        # tokens, positions: [B, S] -> logits [B, S, V], or [K, V] at `logits_at` (flat indices)
        m = self.fms_model
        if step is None:  # no cache: FMS's own causal attention (a profiling forward, perplexity)
            x, _ = m.base_model(tokens, positions, None, False)
        else:
            step = step.prepare()
            pools = list(zip(step.view.k_pools, step.view.v_pools))
            x, _ = m.base_model(tokens, positions, pools, True, attn_name=ATTN_NAME,
                                **{STEP_KWARG: step})
        if logits_at is not None:
            x = x.flatten(0, 1).index_select(0, logits_at)  # [K, D]
        logits = m.head(x)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits


def _tensor_parallel(model: nn.Module):
    """`fms_paged.parallel.TensorParallel` of an FMS model split by FMS (`distributed_strategy=
    "tp"`, over more than one rank): its rank and group, so that `Engine(fms_model)` runs rank 0's
    scheduler on every rank (`fms_paged.engine.tensor_parallel`) over FMS's own collectives; else
    None."""
    from fms.distributed.strategy import TensorParallelStrategy

    from fms_paged.parallel import TensorParallel

    strategy = getattr(model, "distributed_strategy", None)
    if not isinstance(strategy, TensorParallelStrategy):
        return None
    group = strategy.group
    size = torch.distributed.get_world_size(group)
    return TensorParallel(torch.distributed.get_rank(group), size, group) if size > 1 else None


def paged_model(model: nn.Module, page_size: int | None = None,
                eos_token_id: int | tuple[int, ...] | None = None) -> PagedFMSModel:
    """An FMS model -> the adapter our `Engine` and backends drive (the model is shared, not
    copied)."""
    return model if isinstance(model, PagedFMSModel) else PagedFMSModel(model, page_size, eos_token_id)


# ---------------------------------------------------------------------------------- FMS generate
class PagedFMSCache:
    """Our page pool and page manager, driven by FMS's own `generate`:

        cache = PagedFMSCache(model, max_batch=4, max_seq_len=256)
        input_ids, extra = cache.pad_input_ids([torch.tensor(p) for p in prompts])
        out = fms.utils.generation.generate(
            model, input_ids, max_new_tokens=32, use_cache=True, do_sample=False,
            extra_kwargs=extra, prepare_model_inputs_hook=cache.prepare_model_inputs_hook)

    Why a hook: FMS's generate starts every call with `past_key_value_states=None`, and its store
    op gets a layer's cache but not the layer's index, so the hook installs the pools (one (k, v)
    pair per layer) before every forward, and the prefill step at iteration 0. Between steps FMS
    calls the op's `update_attn_kwargs`, which RESERVEs each row's next slot and builds the decode
    step (one BlockMask for all layers). The batch stays FMS's rectangular left-padded one: pad tokens are
    not stored (each sequence's pages hold only its own tokens, at positions 0..n-1) and attend
    to nothing. Every row decodes until generate stops (FMS has no per-row finishing); for
    per-request lengths, arrivals and preemption, serve the model with `fms_paged.Engine`.
    """

    def __init__(self, model: nn.Module, max_batch: int, max_seq_len: int, *, page_size: int | None = None,
                 num_pages: int | None = None, kernel: str = "auto"):
        self.model = paged_model(model, page_size)
        self.cache = PagedCache(self.model, max_batch, max_seq_len, num_pages=num_pages, kernel=kernel)
        self.backend = self.cache.backend
        self.lengths: list[int] = []  # tokens cached per row of the current batch
        self._pending: list[torch.Tensor] | None = None  # prompts of a batch not yet prefilled

    @property
    def pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """past_key_value_states for FMS: each layer's (k pool, v pool), [1, Hkv, NP * P, D]."""
        return list(zip(self.backend.k_pools, self.backend.v_pools))

    def pad_input_ids(self, prompts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Start a batch: FMS's left-padded input_ids [B, S] and the extra kwargs for generate
        (attn_name, position_ids, this cache). The previous batch's pages are freed."""
        from fms.utils.generation import pad_input_ids

        if not prompts or len(prompts) > self.backend.max_batch:
            raise ValueError(f"got {len(prompts)} prompts; expected 1..{self.backend.max_batch} "
                             "(the cache's max_batch)")
        prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
        for i, p in enumerate(prompts):
            if p.numel() == 0:
                raise ValueError(f"prompt {i} is empty: each prompt needs >= 1 token")
        self.cache.reset()
        self.lengths, self._pending = [], prompts
        input_ids, extra = pad_input_ids(prompts)
        extra.pop("mask")  # ours is the BlockMask, built from the page table
        extra.update(attn_name=register(), **{CACHE_KWARG: self})
        return input_ids.to(self.model.device), extra

    def prepare_model_inputs_hook(self, i: int, input_ids: torch.Tensor,
                                  kwargs: MutableMapping) -> tuple[torch.Tensor, MutableMapping]:
        """FMS generate's hook: the pools as the cache, and at iteration 0 the prefill step."""
        kwargs["past_key_value_states"] = self.pools
        if i == 0:
            kwargs[STEP_KWARG] = self.prefill(input_ids.shape[1])
        return input_ids, kwargs

    def prefill(self, width: int) -> PoolStep:
        """RESERVE the pending prompts' pages -> the step for their left-padded batch [B, width]."""
        if self._pending is None:
            raise ValueError("no batch to prefill: call pad_input_ids first")
        prompts, self._pending = self._pending, None
        B, counts = len(prompts), [len(p) for p in prompts]
        if width < max(counts):
            raise ValueError(f"input width {width} < the longest prompt ({max(counts)} tokens)")
        # the backend's layout [B', S'] (flex: one packed row; GATHER: a right-padded row per
        # sequence); `last`: each sequence's last token in it, its tokens being contiguous
        tokens, _, step, last = self.cache.prefill(list(range(B)), [p.tolist() for p in prompts])
        step = step.prepare()
        dev = self.model.device
        src = torch.cat([torch.arange(width - n, width) + b * width for b, n in enumerate(counts)])
        dst = torch.cat([torch.arange(int(e) - n + 1, int(e) + 1) for e, n in zip(last.tolist(), counts)])
        self.lengths = counts
        return _Relayout(step, src.to(dev), dst.to(dev), tuple(tokens.shape))

    def advance(self) -> PoolStep:
        """RESERVE each row's next token -> the decode step for FMS's [B, 1] input."""
        B = len(self.lengths)
        if not B:
            raise ValueError("no batch to decode: prefill one first")
        _, _, step = self.cache.decode(list(range(B)), torch.zeros(B, dtype=torch.long),
                                       self.lengths, [True] * B)
        self.lengths = [n + 1 for n in self.lengths]
        return step.prepare()
