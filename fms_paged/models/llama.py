"""The decoder: an FMS-style LLaMA (config with FMS field names, RMSNorm, SwiGLU, RoPE with llama3
scaling, GQA) whose config also carries what the other families change, each a field that is off
for LLaMA:

- attention: q/k/v bias (Qwen2), an RMSNorm over each head of q and k (Qwen3, Gemma 3), the softmax
  scale (Gemma's query_pre_attn_scalar, Granite's attention multiplier), a logit soft-cap (Gemma 2),
  a sliding window on all layers (Mistral) or on some (`layer_types`: Qwen2/3, Gemma 2/3), and a
  RoPE base of their own for the sliding layers (Gemma 3);
- the block: GeGLU (Gemma), norms after attention and after the MLP too (Gemma's "sandwich"),
  a residual multiplier (Granite);
- the ends: an embedding scale (Gemma: sqrt(emb_dim), Granite: its multiplier), norms with a unit
  offset (Gemma), a logits divisor (Granite) and a final logit soft-cap (Gemma 2).

Which fields a family sets, and how its Hugging Face checkpoints map onto them, is the family's
adapter (`fms_paged.models.families`). Each layer declares its `AttentionSpec`
(`LLaMA.attention_specs()`), which every KV backend and kernel applies.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fms_paged import native
from fms_paged.kv.groups import layer_groups
from fms_paged.kv.quant import check_kv_cache_dtype
from fms_paged.kv.spec import AttentionSpec
from fms_paged.modules import (
    LINEAR_IMPLS,
    GatedLinearUnit,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
)
from fms_paged.modules.attention import AttentionStep
from fms_paged.modules.feedforward import ACTIVATIONS, swiglu_hidden_dim
from fms_paged.modules.quantized import BlockEmbedding, BlockLinear

ATTN_IMPLS = ("sdpa", "paged")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class LLaMAConfig:
    src_vocab_size: int = 32_000
    emb_dim: int = 4096
    nheads: int = 32
    kvheads: int = 0  # 0 means "same as nheads" (plain MHA)
    nlayers: int = 32
    hidden_grow_factor: float = 8 / 3
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    max_expected_seq_len: int = 4096
    tie_heads: bool = False
    attn_impl: str = "sdpa"  # "sdpa": dense contiguous cache (the baseline); "paged": page pool
    # "auto": CPU fp32 projections through oneDNN-packed weights (`fms_paged.modules.linear`);
    # "torch": F.linear everywhere (no packed copy of the weights)
    linear_impl: str = "auto"
    # tokens per KV page of the paged backend; `get_model` passes the device's default instead
    # (`fms_paged.device.DEFAULT_PAGE_SIZE`: 64 on the CPU, 16 elsewhere) unless one is given
    page_size: int = 16
    # what the paged backend's KV pages store (`fms_paged.kv.quant`, vLLM's name): "auto" the
    # model's dtype; "int8" or "fp8_e4m3" 8-bit values with fp32 scales per token and kv head
    kv_cache_dtype: str = "auto"
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2  # a tuple: each of them ends a sequence
    extra: dict[str, Any] = field(default_factory=dict)
    # ---- what the other families change (off for LLaMA); see the module docstring
    family: str = "llama"  # the checkpoint family (`fms_paged.models.families`)
    head_dim: int = 0  # 0: emb_dim // nheads
    attn_bias: bool = False  # q/k/v projections with a bias
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logit soft-cap
    sliding_window: int | None = None  # the window of the sliding layers
    # per layer "full_attention" or "sliding_attention"; None: every layer sliding when
    # `sliding_window` is set, else every layer full
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norm: bool = False  # norms after attention and after the MLP too, before the residual
    norm_unit_offset: bool = False  # norms scale by (1 + w), in fp32
    emb_scale: float = 1.0  # embeddings times this
    emb_scale_in_dtype: bool = False  # ... rounded to the model's dtype first (Gemma's normalizer)
    residual_multiplier: float = 1.0  # each block's output times this before the residual add
    logits_scaling: float = 1.0  # logits divided by this
    final_softcap: float | None = None  # final logit soft-cap
    # ---- weight-only quantization of the decoder's projections, set by `get_model(quantization=)`
    # (`fms_paged.modules.quantized`); None: the weights in the model's dtype
    quantization: str | None = None  # "int8" (per output channel) or "int4" (per group)
    quantization_group_size: int | None = None  # int4's group of input channels

    def __post_init__(self) -> None:
        if self.kvheads == 0:
            self.kvheads = self.nheads
        if self.head_dim == 0:
            if not isinstance(self.nheads, int) or self.nheads <= 0 or self.emb_dim % self.nheads:
                raise ValueError(f"emb_dim={self.emb_dim} is not divisible by nheads={self.nheads} "
                                 "(or give head_dim)")
            self.head_dim = self.emb_dim // self.nheads
        for name in ("src_vocab_size", "emb_dim", "nheads", "kvheads", "nlayers", "page_size",
                     "max_expected_seq_len", "multiple_of", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LLaMAConfig.{name} must be a positive int, got {value!r}")
        if self.nheads % self.kvheads:
            raise ValueError(f"nheads={self.nheads} is not a multiple of kvheads={self.kvheads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}; expected one of {ATTN_IMPLS}")
        if self.linear_impl not in LINEAR_IMPLS:
            raise ValueError(f"linear_impl={self.linear_impl!r}; expected one of {LINEAR_IMPLS}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization={self.quantization!r}; expected 'int8', 'int4' or None")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; expected one of {sorted(ACTIVATIONS)}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window={w!r}; expected an int >= 1 or None")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if len(self.layer_types) != self.nlayers or bad:
                raise ValueError(f"layer_types={list(self.layer_types)}; expected {self.nlayers} entries of "
                                 f"{LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and w is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"LLaMAConfig.{name}={v!r}; expected a finite float > 0 or None")

    @property
    def hidden_dim(self) -> int:
        return swiglu_hidden_dim(self.emb_dim, self.hidden_grow_factor, self.multiple_of)

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return self.sliding_window is not None

    def attention_spec(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s scale, window and soft-cap."""
        scale = self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale
        return AttentionSpec(scale=scale, window=self.sliding_window if self.sliding(layer) else None,
                             softcap=self.attn_softcap)

    def updated(self, **overrides: Any) -> LLaMAConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            known = sorted(f.name for f in dataclasses.fields(self))
            raise TypeError(f"unknown LLaMAConfig field(s) {sorted(unknown)}; known fields: {known}")
        if "head_dim" not in overrides and self.head_dim == self.emb_dim // self.nheads:
            overrides["head_dim"] = 0  # derived: derived again from the new emb_dim / nheads
        return dataclasses.replace(self, **overrides)


class LLaMABlock(nn.Module):
    def __init__(self, config: LLaMAConfig, layer_idx: int):
        super().__init__()
        c = config

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, c.norm_eps, c.norm_unit_offset)

        self.ln = norm(c.emb_dim)
        self.attn = MultiHeadAttention(
            c.emb_dim, c.nheads, c.kvheads, layer_idx, head_dim=c.head_dim, bias=c.attn_bias,
            qk_norm=norm(c.head_dim) if c.qk_norm else None, spec=c.attention_spec(layer_idx))
        self.ff_ln = norm(c.emb_dim)
        self.ff_sub_module = GatedLinearUnit(c.emb_dim, c.hidden_dim, c.activation)
        self.post_attn_ln = norm(c.emb_dim) if c.sandwich_norm else None
        self.post_ff_ln = norm(c.emb_dim) if c.sandwich_norm else None
        self.residual_multiplier = c.residual_multiplier
        # which of the model's RoPE tables the layer reads (1: the sliding layers' own base)
        self.rope_index = int(c.rope_local_theta is not None and c.sliding(layer_idx))

    def forward(self, x, cos, sin, step: AttentionStep | None = None) -> torch.Tensor:
        h = self.attn(self.ln(x), cos, sin, step)
        if self.post_attn_ln is not None:
            h = self.post_attn_ln(h)
        x = x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h
        h = self.ff_sub_module(self.ff_ln(x))
        if self.post_ff_ln is not None:
            h = self.post_ff_ln(h)
        return x + h * self.residual_multiplier if self.residual_multiplier != 1.0 else x + h

    def fused_weights(self) -> list[torch.Tensor | None] | None:
        """The block's weights in the order of a `fms_paged::DecoderStack` (None where the family
        has none), or None where its projections are not this module's own packed CPU `Linear`s
        (a rank's split ones: `fms_paged.parallel`; `linear_impl="torch"`) or only some of q/k/v
        have a bias. A projection held as GGUF blocks (`BlockLinear`) gives its blocks (the stack
        runs them by the qgemv kernel), where q/k/v are all held so or none, and gate/up alike."""
        a, f = self.attn, self.ff_sub_module
        qkv = a.in_proj
        projections = (qkv.query, qkv.key, qkv.value, a.dense, f.wg, f.w1, f.w2)
        if not all((type(m) is Linear and m.pack) or type(m) is BlockLinear for m in projections):
            return None
        blocks = [type(m) is BlockLinear for m in projections]
        if len(set(blocks[:3])) > 1 or blocks[4] != blocks[5]:
            return None
        biases = [m.bias for m in projections[:3]]
        if len({b is None for b in biases}) > 1:
            return None
        norms = (a.q_norm, a.k_norm, self.post_attn_ln, self.post_ff_ln)
        qn, kn, pa, pf = (None if m is None else m.weight for m in norms)
        w = [m.blocks if type(m) is BlockLinear else m.weight for m in projections]
        return [self.ln.weight, *w[:3], *biases, qn, kn, w[3], pa, self.ff_ln.weight, *w[4:], pf]


# Each model's DecoderStack and whether its ends are set (`LLaMA._stack`), as made since the last
# parameter or submodule registered on any module of the process (torch's global registration
# hooks: an assignment, `load_state_dict(assign=True)`, a rank's split), which forgets them all:
# a stack made before a registration is made again at its model's next step. A tensor changed in
# place needs nothing: the stack holds the tensors themselves. The hooks are registered when the
# process makes its first stack (`_watch_registrations`), not at import: a process that never runs
# the cpp kernel's one-call forward has none.
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (stack, ends)
_WATCHING: list[bool] = []  # [True] once the hooks are registered


def _registered(*_) -> None:
    _STACKS.clear()


def _watch_registrations() -> None:
    """Register the hooks that forget every stack at a registration (`_STACKS`), once per process."""
    if not _WATCHING:
        nn.modules.module.register_module_parameter_registration_hook(_registered)
        nn.modules.module.register_module_module_registration_hook(_registered)
        _WATCHING.append(True)


class LLaMA(nn.Module):
    """Decoder-only model of every family we load. `forward(tokens, positions, step)` -> logits.

    The KV cache is not hidden inside the model: a backend (`fms_paged.kv`) builds an
    `AttentionStep` for each forward call and the caller passes it in explicitly.
    """

    # each layer attends through `step.attend(layer_idx, ...)`: a paged backend may hold its pages
    # per layer group (`fms_paged.kv.groups`)
    attends_by_layer = True

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.config = c = config
        # nn.Embedding's own init (normal(0, 1)), drawn where the weight exists: on the meta device
        # (where the loaders build a model before its weights arrive) there is nothing to draw, and
        # torch's meta normal_ imports torch._dynamo (~1 s of every start)
        weight = torch.empty(c.src_vocab_size, c.emb_dim)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embedding = nn.Embedding(c.src_vocab_size, c.emb_dim, _weight=weight)
        self.layers = nn.ModuleList(LLaMABlock(c, i) for i in range(c.nlayers))
        self.dec_norm = RMSNorm(c.emb_dim, c.norm_eps, c.norm_unit_offset)
        self.head = Linear(c.emb_dim, c.src_vocab_size, bias=False)
        if c.tie_heads:
            self.head.weight = self.embedding.weight
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack = c.linear_impl == "auto"
        ropes = [RotaryEmbedding(c.head_dim, c.max_expected_seq_len, c.rope_theta, c.rope_scaling)]
        if c.rope_local_theta is not None:  # the sliding layers' own base, unscaled
            ropes.append(RotaryEmbedding(c.head_dim, c.max_expected_seq_len, c.rope_local_theta, None))
        self.ropes = nn.ModuleList(ropes)
        self.tp = None  # this rank's part, once split over ranks (`fms_paged.parallel.shard`)

    @property
    def rot_emb(self) -> RotaryEmbedding:
        """The RoPE table of the full-attention layers."""
        return self.ropes[0]

    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        """Each layer's `AttentionSpec`: what every KV backend and kernel applies for it."""
        return tuple(layer.attn.spec for layer in self.layers)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (normal(0, std) for matrices and biases, a norm's identity scale);
        deterministic under a seed."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.normal_(module.bias, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        for rope in self.ropes:
            rope.reset_buffers(self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        step: AttentionStep | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # tokens, positions: [B, S] int64 -> logits: [B, S, V]
        # logits_at: [K] indices into the flattened [B * S] positions -> logits of those only: [K, V]
        # (a prefill needs the logits of each sequence's last token, not of the whole prompt)
        # a step whose kernel runs the whole forward in one call of its own does (the cpp kernel's:
        # `CppStep.forward_model`); every other step, and a forward it declines, runs the layers
        forward_model = getattr(step, "forward_model", None)
        logits = None if forward_model is None else forward_model(self, tokens, positions, logits_at)
        if logits is not None:
            return logits
        return self.logits(self.hidden(tokens, positions, step), logits_at)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               step: AttentionStep | None = None) -> torch.Tensor:
        """The layers' output before the final norm: tokens, positions [B, S] -> [B, S, D]."""
        x, ropes = self.embed(tokens, positions)
        if step is not None:
            step = step.prepare()  # per-step metadata (slots, masks), built once for all layers
        # (the cpp kernel's steps run every block in one call of their own: `CppStep.run_blocks`)
        run_blocks = getattr(step, "run_blocks", None)
        out = None if run_blocks is None else run_blocks(self, x, ropes)
        if out is not None:
            return out
        for layer in self.layers:
            x = layer(x, *ropes[layer.rope_index], step)
        return x

    def decoder_stack(self):
        """The blocks' weights, RoPE tables and attention specs as one `fms_paged::DecoderStack`
        (checked once, when made), or None where a block has no fused form (`fused_weights`). Kept
        from step to step: a step hands the operator this one object instead of every block's
        weights. Made again after a parameter or submodule is registered anywhere
        (`_STACKS`) or the model is converted (`_apply`: `.to`, `.half`)."""
        return (_STACKS.get(self) or self._stack())[0]

    def logits_stack(self):
        """`decoder_stack()` where its ends are set too (the embedding, final norm and head, which
        `fms_paged::decoder_logits` and `decode_greedy` run around the blocks), else None."""
        stack, ends = _STACKS.get(self) or self._stack()
        return stack if ends else None

    def rope_tables(self, upto: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each RoPE table's cos and sin [n, D], as the fused operators take them, grown first to
        hold positions 0 .. upto - 1 (`RotaryEmbedding.ensure`: IndexError past
        max_expected_seq_len). The operators refuse a position past a table's rows."""
        for r in self.ropes:
            r.ensure(upto)
        return [r.cos for r in self.ropes], [r.sin for r in self.ropes]

    def _stack(self):
        """Make (`decoder_stack()`, whether its ends are set: the embedding, final norm and head,
        which `fms_paged::decoder_logits` runs around the blocks; set where the head is a packed
        `Linear` without a bias and the ends are contiguous in the blocks' dtype), kept in `_STACKS`
        until a registration or a conversion forgets it."""
        _watch_registrations()  # (before the stack is made: every later registration forgets it)
        weights, ends = [], False
        for layer in self.layers:
            w = layer.fused_weights()
            if w is None:
                weights = None
                break
            weights += w
        if weights is not None and any(w is not None and w.dtype == torch.uint8 for w in weights):
            # GGUF blocks: the stack runs them by the qgemv kernel, for the activations' dtype
            if native.load_qgemv(self.dtype) is not None:
                weights = None
        if weights is not None:
            c, specs = self.config, self.attention_specs()
            stack = torch.classes.fms_paged.DecoderStack(
                [w if w is not None else torch.empty(0) for w in weights], c.head_dim,
                [layer.rope_index for layer in self.layers], [s.scale for s in specs],
                [s.window or 0 for s in specs], [s.softcap or 0.0 for s in specs],
                [None if s.sinks is None else s.sinks.float().contiguous() for s in specs], c.norm_eps,
                c.norm_unit_offset, c.residual_multiplier, int(c.activation != "silu"))
            groups = layer_groups(specs, grouped=self.attends_by_layer)
            if groups.grouped:  # each layer's page-table slice (a paged backend holds pages per group)
                stack.set_slices(list(groups.slice_of))
            # (GGUF blocks: the embedding's rows dequantized per lookup, the head by the qgemv kernel)
            emb = self.embedding.blocks if type(self.embedding) is BlockEmbedding else self.embedding.weight
            norm = self.dec_norm.weight
            head = self.head.blocks if type(self.head) is BlockLinear else self.head.weight
            blocks = (type(self.head) is BlockLinear or type(self.embedding) is BlockEmbedding)
            if blocks and native.load_qgemv(self.dtype) is not None:
                head = None
            ends = head is not None and (type(self.head) is BlockLinear or (
                type(self.head) is Linear and self.head.pack)) and self.head.bias is None and all(
                (w.dtype == weights[0].dtype or w.dtype == torch.uint8) and w.is_contiguous()
                for w in (emb, norm, head))
            if ends:
                stack.set_ends(emb, float(c.emb_scale), bool(c.emb_scale_in_dtype), norm, head,
                               float(c.logits_scaling), float(c.final_softcap or 0.0))
        else:
            stack = None
        _STACKS[self] = (stack, ends)
        return stack, ends

    def _apply(self, fn, recurse=True):
        _STACKS.pop(self, None)  # its weights may change dtype or device
        return super()._apply(fn, recurse)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        """The first layer's input [B, S, D] and, per RoPE table, its (cos, sin) at `positions`
        (a layer reads table `layer.rope_index`)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        ropes = tuple(rope(positions) for rope in self.ropes)
        # the lookup alone: nn.Embedding.forward hands F.embedding its float `norm_type`, which a
        # graph compiled with dynamic shapes (the prefill step) first traced as a symbolic float
        # and then traced again (a restart, seconds per 30-layer graph)
        if type(self.embedding) is BlockEmbedding:  # GGUF blocks: the rows dequantized
            x = self.embedding(tokens)
        else:
            x = F.embedding(tokens, self.embedding.weight)
        c = self.config
        if c.emb_scale != 1.0:
            scale = torch.tensor(c.emb_scale, dtype=x.dtype) if c.emb_scale_in_dtype else c.emb_scale
            x = x * scale
        return x, ropes

    def logits(self, x: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden`'s output [B, S, D] -> logits [B, S, V], or [K, V] at `logits_at`."""
        if logits_at is not None:
            x = x.flatten(0, 1).index_select(0, logits_at)  # [K, D]
        logits = self.head(self.dec_norm(x))
        c = self.config  # (fms_paged::decoder_logits scales and soft-caps them as here)
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    @property
    def device(self) -> torch.device:
        return self.dec_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's, or the final norm's where the embedding is
        held as GGUF blocks)."""
        emb = self.embedding
        return emb.dtype if type(emb) is BlockEmbedding else emb.weight.dtype


# Presets: shapes of the public checkpoints, plus `micro` for tests.
_LLAMA_VARIANTS: dict[str, LLaMAConfig] = {
    "micro": LLaMAConfig(
        src_vocab_size=256, emb_dim=64, nheads=4, kvheads=2, nlayers=2, hidden_grow_factor=2.0,
        multiple_of=16, max_expected_seq_len=2048,
    ),
    "7b": LLaMAConfig(),
    "2-7b": LLaMAConfig(norm_eps=1e-5),
    "3-8b": LLaMAConfig(
        src_vocab_size=128_256, kvheads=8, hidden_grow_factor=3.5, multiple_of=1024,
        rope_theta=500_000.0, max_expected_seq_len=8192, bos_token_id=128_000, eos_token_id=128_001,
    ),
    "3.1-8b": LLaMAConfig(
        src_vocab_size=128_256, kvheads=8, hidden_grow_factor=3.5, multiple_of=1024,
        rope_theta=500_000.0, max_expected_seq_len=131_072, bos_token_id=128_000,
        eos_token_id=128_001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}
_LLAMA_VARIANTS["7b"].norm_eps = 1e-6
_LLAMA_VARIANTS["7b"].max_expected_seq_len = 2048
