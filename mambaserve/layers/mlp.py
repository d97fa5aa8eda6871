"""MLPs: SiLU-gated (Shazeer 2020, "GLU variants") with separate or fused gate/up weights, and
the plain two-layer MLP with a pointwise activation (Nemotron-H's squared ReLU).

Parameter names follow the Hugging Face checkpoints: `gate_proj`/`up_proj`/`down_proj` (Bamba,
Llama style), one fused `input_linear` holding [gate; up] and `output_linear` (Granite), or
`up_proj`/`down_proj` without a gate (Nemotron-H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops

from mambaserve.layers.activation import get_activation


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). x: (num_tokens, hidden) -> (num_tokens, hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """output_linear(silu(g) * u) with [g; u] = input_linear(x) (Granite's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(ops.silu_and_mul(self.input_linear(x)))


class MLP(nn.Module):
    """down(act(up(x))), no gate. x: (num_tokens, hidden) -> (num_tokens, hidden).

    activation: a config name ("relu2", "gelu", ...; see `mambaserve.layers.activation`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        self.act = get_activation(activation)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
