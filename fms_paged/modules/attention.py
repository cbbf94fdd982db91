"""Multi-head attention with GQA, backed by a pluggable per-step KV-cache backend.

The projection/RoPE math is identical for every backend; only `step.attend` differs:
- no step: causal attention over the tokens given, under the layer's spec (no cache; used for
  perplexity and tests);
- `fms_paged.kv.contiguous.DenseStep`: the dense baseline (preallocated contiguous cache + SDPA);
- the paged backend's steps (`fms_paged.kv.kernels`): ASSIGN into the page pool, then attention
  through the block table by the device's kernel (cpp, flex) or the GATHER + SDPA fallback.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from fms_paged.kv.spec import AttentionSpec, attend, default_spec, visible
from fms_paged.modules.linear import Linear, linear_cat
from fms_paged.modules.norm import RMSNorm
from fms_paged.modules.positions import apply_rope


class AttentionStep(Protocol):
    """What a KV-cache backend provides for one forward step (built once, shared by all layers)."""

    def prepare(self) -> AttentionStep:
        """Device-side per-step metadata (slots, masks), run by the model once before its layers,
        so that a compiled forward traces it with the rest of the step. Returns the step to use,
        a new object: writing attributes on `self` inside a compiled forward would be replayed in
        Python after the graph on every call."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v of the new tokens and attend.

        q: [B, H, S, D]; k, v: [B, Hkv, S, D] (RoPE applied) -> out: [B, H, S, D]
        """
        ...


class QKV(nn.Module):
    """Separate q/k/v projections (FMS `in_proj.query/key/value`), with a bias where the family
    has one (Qwen2)."""

    def __init__(self, emb_dim: int, nheads: int, kvheads: int, head_dim: int, bias: bool = False):
        super().__init__()
        self.query = Linear(emb_dim, nheads * head_dim, bias=bias)
        self.key = Linear(emb_dim, kvheads * head_dim, bias=bias)
        self.value = Linear(emb_dim, kvheads * head_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [..., C] -> q [..., H * D], k, v [..., Hkv * D] (one GEMM where the packed path applies)
        q, k, v = linear_cat(x, [self.query, self.key, self.value])
        return q, k, v


class MultiHeadAttention(nn.Module):
    """q/k/v projections, an optional RMSNorm over each head of q and k (`qk_norm`: Qwen3, Gemma 3),
    RoPE, attention under the layer's `AttentionSpec` (scale, window, soft-cap; `spec`), output
    projection."""

    def __init__(self, emb_dim: int, nheads: int, kvheads: int, layer_idx: int, *,
                 head_dim: int | None = None, bias: bool = False, qk_norm: RMSNorm | None = None,
                 spec: AttentionSpec | None = None):
        super().__init__()
        if head_dim is None:
            if emb_dim % nheads:
                raise ValueError(f"emb_dim={emb_dim} is not divisible by nheads={nheads}")
            head_dim = emb_dim // nheads
        self.nheads = nheads
        self.kvheads = kvheads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.spec = spec or default_spec(head_dim)
        self.in_proj = QKV(emb_dim, nheads, kvheads, head_dim, bias)
        if qk_norm is not None:  # a template: one norm of its kind for q, one for k
            self.q_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.dense = Linear(nheads * head_dim, emb_dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: AttentionStep | None = None,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.in_proj(x)
        q = q.view(B, S, self.nheads, self.head_dim)
        k = k.view(B, S, self.kvheads, self.head_dim)
        v = v.view(B, S, self.kvheads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [B, S, H, D] -> [B, H, S, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if step is None:  # no cache: the tokens given are a whole sequence from position 0
            mask = None
            if self.spec.window is not None and self.spec.window < S:
                pos = torch.arange(S, device=x.device)
                mask = visible(pos[:, None], pos[None, :], self.spec.window)  # [S, S]
            out = attend(q, k, v, self.spec, mask=mask, is_causal=mask is None)
        else:
            out = step.attend(self.layer_idx, q, k, v)
        # [B, H, S, D] -> [B, S, H*D]
        return self.dense(out.transpose(1, 2).reshape(B, S, self.nheads * self.head_dim))
