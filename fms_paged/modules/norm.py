"""RMSNorm, computed in fp32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from fms_paged import native


class RMSNorm(nn.Module):
    """x / rms(x) * weight. `unit_offset` (Gemma): the stored weight is w - 1, so the scale is
    (1 + w), and the product is taken in fp32 before the cast back (as transformers' Gemma norms
    do); otherwise the normalised x is cast back first and then scaled in its dtype (LLaMA's)."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., C]
        if (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and native.ready(x.dtype) and native.kernel_ready("rows", x.dtype)):
            # eager on the CPU, where the rows kernel can be had (loaded on first use, as the
            # projections load theirs: a model's first forward, whose first op is a norm, then
            # computes what every later one does): the same norm in one operator call instead of
            # eight (fp32 inside, rounded where below; only the order of the sum of squares differs)
            return torch.ops.fms_paged.rms_norm(x.contiguous(), self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
