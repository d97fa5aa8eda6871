"""MLPs: SiLU-gated (Shazeer 2020, "GLU variants") with separate or fused gate/up weights, and
the plain two-layer MLP with a pointwise activation (Nemotron-H's squared ReLU).

Parameter names follow the Hugging Face checkpoints: `gate_proj`/`up_proj`/`down_proj` (Bamba,
Llama style), one fused `input_linear` holding [gate; up] and `output_linear` (Granite), or
`up_proj`/`down_proj` without a gate (Nemotron-H).

Under tensor parallelism the intermediate features are split: the up (and gate) projections
are column-parallel, the down projection row-parallel, one all-reduce per MLP; with
reduce_results=False the output is the rank's partial sum, for a caller that adds it to
another partial sum (a MoE's) before one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops
from mambaserve.distributed import current_group
from mambaserve.layers.activation import get_activation
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, packed_ranges

_WHAT = "the MLP's intermediate size"


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)). x: (num_tokens, hidden) -> (num_tokens, hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=_WHAT)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=_WHAT)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results,
                                           what=_WHAT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """output_linear(silu(g) * u) with [g; u] = input_linear(x) (Granite's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True):
        super().__init__()
        rows = packed_ranges([intermediate_size] * 2, current_group(), _WHAT)  # [gate; up]
        self.input_linear = ColumnParallelLinear(hidden_size, 2 * intermediate_size, bias=False, ranges=rows)
        self.output_linear = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                               reduce_results=reduce_results, what=_WHAT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(ops.silu_and_mul(self.input_linear(x)))


class MLP(nn.Module):
    """down(act(up(x))), no gate. x: (num_tokens, hidden) -> (num_tokens, hidden).

    activation: a config name ("relu2", "gelu", ...; see `mambaserve.layers.activation`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False,
                 reduce_results: bool = True):
        super().__init__()
        self.act = get_activation(activation)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=_WHAT)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results,
                                           what=_WHAT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
