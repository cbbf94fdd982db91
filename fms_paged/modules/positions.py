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
    """cos/sin tables `[n, D]` (fp32) of positions 0 .. n - 1; `forward(positions)` looks them up
    once per step.

    On the CPU the tables start empty and grow on demand (`ensure`) to the highest position a step
    asks for, never past `max_seq_len`: a model holds the rows its steps use, not a full table per
    RoPE base made at load (Gemma 3 at 32k positions: 128 MiB, a quarter of its 270M bf16 weights).
    They grow in whole blocks of `BLOCK` rows, at least doubling, and a growth computes only the new
    blocks (the rows held are copied). Each block is computed by itself, always as the same call on
    the same BLOCK positions, so a row's values do not depend on how far the table had grown. Every
    path reads these tables: the modules' lookup here, the cpp kernel's one-call operators
    (`LLaMA.rope_tables`, given the highest position they read), the compiled steps (an engine
    that compiles grows them to `max_seq_len` before it traces: a graph cannot grow a buffer).
    On other devices the tables are full-size when made (a captured CUDA graph holds their
    address)."""

    BLOCK = 1024  # rows computed per call (a multiple of every SIMD width: no scalar tail)

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim), persistent=False)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Tables made again on `device` (default: where they are), in fp32: empty on the CPU
        (grown on demand: `ensure`), full-size elsewhere."""
        device = torch.device(device if device is not None else self.cos.device)
        self.cos = torch.empty(0, self.head_dim, device=device)
        self.sin = torch.empty(0, self.head_dim, device=device)
        if device.type != "cpu":
            self.ensure(self.max_seq_len)

    def ensure(self, n: int) -> None:
        """Grow the tables to hold positions 0 .. n - 1 (at least; whole blocks, at least doubling,
        capped at `max_seq_len`). IndexError for n past `max_seq_len`."""
        held = self.cos.shape[0]
        if n <= held:
            return
        if n > self.max_seq_len:
            raise IndexError(f"RoPE position {n - 1} is past the model's max_expected_seq_len="
                             f"{self.max_seq_len} (positions 0..{self.max_seq_len - 1})")
        B = self.BLOCK
        rows = min(self.max_seq_len, max(-(-n // B) * B, 2 * held))
        cos = self.cos.new_empty(rows, self.head_dim)
        sin = self.sin.new_empty(rows, self.head_dim)
        cos[:held].copy_(self.cos)
        sin[:held].copy_(self.sin)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(cos.device)
        for start in range(held // B * B, rows, B):  # (held: a whole number of blocks, or all rows)
            t = torch.arange(start, start + B, dtype=torch.int64, device=cos.device).float()
            freqs = torch.outer(t, inv_freq)  # [B, D/2]
            stop = min(start + B, rows)
            # per dimension, in the interleaved layout: cos of its pair; -sin for the first of a
            # pair, +sin for the second (see apply_rope)
            c, s = freqs.cos()[: stop - start], freqs.sin()[: stop - start]
            cos[start:stop].view(stop - start, -1, 2).copy_(c[..., None].expand(-1, -1, 2))
            out = sin[start:stop].view(stop - start, -1, 2)
            out[..., 1].copy_(s)
            out[..., 0].copy_(s.neg_())
        self.cos, self.sin = cos, sin

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, S] int64 -> cos, sin: [B, S, 1, D] fp32 (broadcast over heads)
        pos = positions.clamp(min=0)
        if not torch.compiler.is_compiling() and self.cos.shape[0] < self.max_seq_len and pos.numel():
            # (short tables are CPU tables: the highest position is read from host memory, no
            # device sync; `tolist`, as the engine reads its sampled tokens, dispatches no op)
            self.ensure(pos.max().tolist() + 1)
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
