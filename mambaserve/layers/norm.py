"""RMSNorm (Zhang & Sennrich 2019) over the last axis, computed in float32.

Plain PyTorch on purpose: it is a small, memory-bound op that torch.compile fuses with its
neighbours; the gated, grouped variant of the Mamba2 mixer is `mambaserve.ops.rms_norm_gated`.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps). x: (..., hidden); returns x.dtype.

    The normalisation runs in float32. By default the result is cast to x.dtype before the
    weight multiplies it (Llama, Bamba, Granite); scale_in_float32=True multiplies in float32
    and casts last (Nemotron-H's reference). The two agree exactly in float32.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, scale_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)
