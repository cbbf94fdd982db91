"""Per-layer attention variants (`AttentionSpec`) and the plain-torch attention that applies them.

A model declares one `AttentionSpec` per layer (`model.attention_specs()`): the softmax scale, a
sliding window, a logit soft-cap and attention sinks. Every kernel receives the spec of the layer
it attends for, so every kernel computes the same function:
- cpp: fields of the C++ op (window bounds per row, `tanh` soft-cap, scale, sink logits);
- flex: the window as a `mask_mod` and-ed with the paged one, the soft-cap as a `score_mod`, the
  scale as flex's own, sinks by rescaling with the log-sum-exp flex returns
  (`fms_paged.flex.masks`);
- GATHER + SDPA, the dense backend and the cache-free forward: `attend` below, SDPA where the
  spec is plain (no soft-cap, no sinks), else the same math written out.

Layers with equal windows share one step's metadata (masks, BlockMasks): a step prepares it once
per distinct window (`windows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer turns scores into attention weights.

    scale: the softmax scale (scores are q . k * scale); the families' default is head_dim ** -0.5.
    window: sliding window (Mistral, Gemma's local layers): a query at position p sees the keys
        at positions p - window + 1 .. p; None sees every earlier key.
    softcap: logit soft-cap (Gemma 2): a scaled score s becomes softcap * tanh(s / softcap).
    sinks: attention sinks (gpt-oss): one learned logit per query head ([H] tensor) that joins
        every row's softmax denominator and adds nothing to its output.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not (
            math.isfinite(self.scale) and self.scale > 0
        ):
            raise ValueError(f"AttentionSpec.scale={self.scale!r}; expected a finite float > 0")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"AttentionSpec.window={w!r}; expected an int >= 1 or None (no window)")
        c = self.softcap
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not (math.isfinite(c) and c > 0)):
            raise ValueError(f"AttentionSpec.softcap={c!r}; expected a finite float > 0 or None")
        if self.sinks is not None and (not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1):
            raise ValueError("AttentionSpec.sinks must be a 1-D tensor of one logit per query head, got "
                             f"{getattr(self.sinks, 'shape', type(self.sinks).__name__)}")

    @property
    def plain(self) -> bool:
        """SDPA computes it as it is: no soft-cap, no sinks (a window is a mask)."""
        return self.softcap is None and self.sinks is None


def default_spec(head_dim: int) -> AttentionSpec:
    return AttentionSpec(scale=head_dim**-0.5)


def windows(specs: Sequence[AttentionSpec]) -> tuple[int | None, ...]:
    """The distinct windows of a model's layers (None first): a step's metadata is made per window."""
    found = {s.window for s in specs}
    return tuple(sorted(found, key=lambda w: (w is not None, w or 0)))


def release_horizon(specs: Sequence[AttentionSpec]) -> int | None:
    """How many of a sequence's latest positions any layer still reads, when every layer is
    windowed: pages wholly before them can be released. None when some layer reads everything."""
    if not specs or any(s.window is None for s in specs):
        return None
    return max(s.window for s in specs)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether a key at `k_pos` is visible to a query at `q_pos` (broadcast): causal, and within
    the window."""
    ok = k_pos <= q_pos
    return ok if window is None else ok & (q_pos - k_pos < window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
           mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Attention of q over k, v under `spec`: q [B, H, S, D]; k, v [B, Hkv, L, D]; mask
    [B or 1, 1, S, L] bool (True: visible; it carries the window) or None with `is_causal`
    (square, no window) -> [B, H, S, D].

    A plain spec is one SDPA call. Otherwise the scores, soft-cap and softmax (with the sink
    column) are computed in fp32, as transformers' eager attention does, and the weights cast
    back to the values' dtype."""
    if spec.plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=spec.scale, enable_gqa=True)
    B, H, S, _ = q.shape
    G = H // k.shape[1]
    if G > 1:  # [B, Hkv, L, D] -> [B, H, L, D]: query head h reads kv head h // G
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * spec.scale  # [B, H, S, L]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if is_causal:
        L = k.shape[2]
        mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.to(device=q.device, dtype=torch.float32).view(1, H, 1, 1).expand(B, H, S, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights.to(v.dtype), v)
