"""Rotary position embeddings (interleaved pairs, the Meta/FMS layout) with llama3 frequency scaling.

Our q/k projections use the original Meta layout, where dimensions (2i, 2i+1) of each head form a
rotated pair. Hugging Face checkpoints store q/k weights permuted for the "rotate half" layout;
`fms_paged.models.hf` undoes that permutation when loading and re-applies it when saving.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (fp32), with optional llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; expected one of 'default', 'linear', 'llama3'"
        )
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`; short ones kept; a smooth blend in between
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables up to `max_seq_len`; `forward(positions)` looks them up once per step."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        device = device if device is not None else self.cos.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_seq_len, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [L, D/2]
        # per dimension, in the interleaved layout: cos of its pair; -sin for the first of a pair,
        # +sin for the second (see apply_rope)
        # (written into the tables a half at a time: a load's peak holds one [L, D/2] temporary
        # beside the tables, not four)
        L, half = freqs.shape
        self.cos = torch.empty(L, half, 2, device=device)  # [L, D/2, 2] -> [L, D]
        self.sin = torch.empty(L, half, 2, device=device)
        cos = freqs.cos()
        self.cos[..., 0].copy_(cos)
        self.cos[..., 1].copy_(cos)
        del cos
        sin = freqs.sin()
        self.sin[..., 1].copy_(sin)
        self.sin[..., 0].copy_(sin.neg_())
        del sin
        self.cos, self.sin = self.cos.flatten(1), self.sin.flatten(1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, S] int64 -> cos, sin: [B, S, 1, D] fp32 (broadcast over heads)
        pos = positions.clamp(min=0)
        return self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin).

    x: [B, S, H, D]; cos/sin: [B, S, 1, D] from `RotaryEmbedding` (sin carries the pair's sign).
    Written as two pointwise products over the whole head, `x * cos + swap(x) * sin`, so the result
    is a plain 4-D tensor (under torch.compile it fuses into one kernel; the same products and sums
    as the pairwise form, so the values are bitwise equal).
    """
    B, S, H, D = x.shape
    xf = x.float()
    swapped = xf.view(B, S, H, D // 2, 2).flip(-1).view(B, S, H, D)  # (x1, x0) per pair
    return (xf * cos + swapped * sin).to(x.dtype)
