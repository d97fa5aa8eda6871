"""Granite's sparse mixture of experts: top-k softmax routing over SiLU-gated experts.

Routing (Shazeer et al. 2017): the router's logits are computed in float32, the top-k are kept
and renormalised by a softmax over those k. The experts run in `mambaserve.ops.fused_moe`.
Parameter names follow the HF checkpoint: `router.layer`, `input_linear` (E, 2I, H) and
`output_linear` (E, H, I).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops


class _Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class _ExpertWeights(nn.Module):
    """Holds one stacked (num_experts, out, in) weight under the checkpoint's `.weight` name."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class GraniteMoE(nn.Module):
    """x: (num_tokens, hidden) -> (num_tokens, hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = _Router(hidden_size, num_experts)
        self.input_linear = _ExpertWeights(num_experts, 2 * intermediate_size, hidden_size)
        self.output_linear = _ExpertWeights(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.layer.weight).float()  # (T, E)
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)  # (T, k)
        top_weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return ops.fused_moe(x, self.input_linear.weight, self.output_linear.weight, top_weights, top_ids)
