"""RMSNorm (Zhang & Sennrich 2019) over the last axis, computed in float32.

It runs as `mambaserve.ops.rms_norm_gated` without a gate and with one group: one fused kernel
on the GPU instead of the half-dozen small ones of the plain PyTorch expression (at decode
batch sizes a step is dominated by the number of kernels, not by their work).
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve import ops


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps). x: (..., hidden); returns x.dtype.

    The normalisation and the scaling run in float32 and the result is cast last (as
    Nemotron-H's reference does; Llama-style references cast before the weight multiplies, which
    rounds twice in bfloat16: the two agree exactly in float32). `scale_in_float32` is kept for
    the families that name it and changes nothing.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, scale_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.shape[-1]
        out = ops.rms_norm_gated(x.reshape(-1, hidden), self.weight, None, self.eps, group_size=hidden)
        return out.view(x.shape)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """The residual add before this norm, fused with it: residual += alpha * x in place
        (rounded once to residual's dtype), then returns self(residual).

        residual: (num_tokens, hidden), contiguous (the model's own residual stream, never an
        input tensor); x: (num_tokens, hidden), or (num_parts, num_tokens, hidden) partial sums
        of the added term (a split-K projection's or the decode MoE's), added in order in
        float32 by the same kernel. Returns (num_tokens, hidden).
        """
        hidden = residual.shape[-1]
        if x.dim() == 3:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, alpha)
        out = ops.fused_add_rms_norm(x.reshape(-1, hidden), residual.view(-1, hidden), self.weight, self.eps, alpha)
        return out.view(x.shape)
