"""Gated feed-forward block (FMS names: wg = gate, w1 = up, w2 = down): SwiGLU (LLaMA, Mistral,
Qwen, Granite) or GeGLU with tanh-approximated GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fms_paged.modules.linear import Linear, linear_cat

# the activation of the gate, by name: silu (SwiGLU) or gelu_tanh (GeGLU, transformers'
# "gelu_pytorch_tanh")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def swiglu_hidden_dim(emb_dim: int, hidden_grow_factor: float, multiple_of: int) -> int:
    """FMS/Meta sizing: int(emb_dim * grow), rounded up to a multiple of `multiple_of`.

    A small epsilon guards against float error when the factor came from
    `intermediate_size / hidden_size` of a Hugging Face config.
    """
    hidden = int(emb_dim * hidden_grow_factor + 1e-4)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class GatedLinearUnit(nn.Module):
    def __init__(self, emb_dim: int, hidden_dim: int, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; expected one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.wg = Linear(emb_dim, hidden_dim, bias=False)
        self.w1 = Linear(emb_dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, emb_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, C] -> [B, S, C]
        gate, up = linear_cat(x, [self.wg, self.w1])
        return self.w2(ACTIVATIONS[self.activation](gate) * up)
