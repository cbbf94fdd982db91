"""An FMS-style LLaMA: config with FMS field names, RMSNorm, SwiGLU, RoPE (+llama3 scaling), GQA."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fms_paged.modules import (
    LINEAR_IMPLS,
    GatedLinearUnit,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
)
from fms_paged.modules.attention import AttentionStep
from fms_paged.modules.feedforward import swiglu_hidden_dim

ATTN_IMPLS = ("sdpa", "paged")


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
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kvheads == 0:
            self.kvheads = self.nheads
        for name in ("src_vocab_size", "emb_dim", "nheads", "kvheads", "nlayers", "page_size",
                     "max_expected_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LLaMAConfig.{name} must be a positive int, got {value!r}")
        if self.emb_dim % self.nheads:
            raise ValueError(f"emb_dim={self.emb_dim} is not divisible by nheads={self.nheads}")
        if self.nheads % self.kvheads:
            raise ValueError(f"nheads={self.nheads} is not a multiple of kvheads={self.kvheads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}; expected one of {ATTN_IMPLS}")
        if self.linear_impl not in LINEAR_IMPLS:
            raise ValueError(f"linear_impl={self.linear_impl!r}; expected one of {LINEAR_IMPLS}")

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.nheads

    @property
    def hidden_dim(self) -> int:
        return swiglu_hidden_dim(self.emb_dim, self.hidden_grow_factor, self.multiple_of)

    def updated(self, **overrides: Any) -> LLaMAConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            known = sorted(f.name for f in dataclasses.fields(self))
            raise TypeError(f"unknown LLaMAConfig field(s) {sorted(unknown)}; known fields: {known}")
        return dataclasses.replace(self, **overrides)


class LLaMABlock(nn.Module):
    def __init__(self, config: LLaMAConfig, layer_idx: int):
        super().__init__()
        self.ln = RMSNorm(config.emb_dim, config.norm_eps)
        self.attn = MultiHeadAttention(config.emb_dim, config.nheads, config.kvheads, layer_idx)
        self.ff_ln = RMSNorm(config.emb_dim, config.norm_eps)
        self.ff_sub_module = GatedLinearUnit(config.emb_dim, config.hidden_dim)

    def forward(self, x, cos, sin, step: AttentionStep | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln(x), cos, sin, step)
        return x + self.ff_sub_module(self.ff_ln(x))


class LLaMA(nn.Module):
    """Decoder-only LLaMA. `forward(tokens, positions, step)` -> logits.

    The KV cache is not hidden inside the model: a backend (`fms_paged.kv`) builds an
    `AttentionStep` for each forward call and the caller passes it in explicitly.
    """

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.src_vocab_size, config.emb_dim)
        self.layers = nn.ModuleList(LLaMABlock(config, i) for i in range(config.nlayers))
        self.dec_norm = RMSNorm(config.emb_dim, config.norm_eps)
        self.head = Linear(config.emb_dim, config.src_vocab_size, bias=False)
        if config.tie_heads:
            self.head.weight = self.embedding.weight
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack = config.linear_impl == "auto"
        self.rot_emb = RotaryEmbedding(
            config.head_dim, config.max_expected_seq_len, config.rope_theta, config.rope_scaling
        )

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (normal(0, std) for matrices, ones for norms); deterministic under a seed."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.rot_emb.reset_buffers(self.embedding.weight.device)

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
        return self.logits(self.hidden(tokens, positions, step), logits_at)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               step: AttentionStep | None = None) -> torch.Tensor:
        """The layers' output before the final norm: tokens, positions [B, S] -> [B, S, D]."""
        x, cos, sin = self.embed(tokens, positions)
        if step is not None:
            step = step.prepare()  # per-step metadata (slots, masks), built once for all layers
        for layer in self.layers:
            x = layer(x, cos, sin, step)
        return x

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input [B, S, D] and the RoPE tables (cos, sin) of `positions`."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        cos, sin = self.rot_emb(positions)
        # the lookup alone: nn.Embedding.forward hands F.embedding its float `norm_type`, which a
        # graph compiled with dynamic shapes (the prefill step) first traced as a symbolic float
        # and then traced again (a restart, seconds per 30-layer graph)
        return F.embedding(tokens, self.embedding.weight), cos, sin

    def logits(self, x: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden`'s output [B, S, D] -> logits [B, S, V], or [K, V] at `logits_at`."""
        if logits_at is not None:
            x = x.flatten(0, 1).index_select(0, logits_at)  # [K, D]
        return self.head(self.dec_norm(x))

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype


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
