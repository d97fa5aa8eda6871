"""The Mamba-1 mixer over a packed batch (Gu & Dao 2023, "Mamba", section 3, Algorithm 2).

in_proj -> [x | z]; a depthwise causal conv1d (with bias) + SiLU over x, continuing from the
conv state; x_proj -> [dt (low rank) | B | C]; dt = dt_proj(dt) (its bias and the softplus are
applied inside the scan, in float32); the selective scan with A = -exp(A_log) of shape
(d_inner, d_state) (one decay rate per channel and state, not one per head as in Mamba2), the
D skip and the silu(z) gate; out_proj. Plain Mamba-1 has no normalisation inside the mixer;
Jamba's (Lieber et al. 2024, arXiv 2403.19887; transformers' `JambaMambaMixer`) adds RMSNorms
on the low-rank dt (before dt_proj), on B and on C, right after x_proj (`dt_bc_norm_eps`).

A decode-only batch runs the one-step ops (conv update, scan update: no launch plan, safe in
CUDA graphs); any other batch (prefills, chunks, and decodes beside them) runs the varlen conv
and the varlen scan, whose decode rows are sequences of length 1. The state-dependent core
(conv, x_proj, dt_proj, scan) is one split op: a hole of the piecewise CUDA graphs, as in Mamba2.

Parameter names and shapes follow the Hugging Face checkpoints (`in_proj`, `conv1d.weight`
(d_inner, 1, width), `conv1d.bias`, `x_proj`, `dt_proj` (with bias), `A_log` (d_inner,
d_state), `D`, `out_proj`; Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`). The layer
reads its (conv_states, ssm_states) pair from `ctx.mamba_caches[cache_index]`: conv
(width - 1, d_inner), SSM (d_inner, d_state) per slot.

Tensor parallelism (built inside `distributed.building_with`) splits d_inner: each rank holds
its channels' rows of in_proj (x and z), conv, dt_proj, A_log and D; x_proj is row-parallel, so
dt (low rank), B and C are all-reduced whole on every rank (Jamba's norms then see them whole);
out_proj is row-parallel. `intermediate_size` is the rank's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops
from mambaserve.cache.spec import CacheDtypes, MambaSpec
from mambaserve.distributed import current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.graph_split import split_op
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard, even_range, set_shard
from mambaserve.layers.mamba2 import _Conv1dWeights, cached_decay_rates, project_out
from mambaserve.layers.norm import RMSNorm
from mambaserve.layers.verify import run_state_op


class MambaMixer(nn.Module):
    """hidden_states: (num_tokens, hidden_size) -> (num_tokens, hidden_size).

    dt_bc_norm_eps: None for plain Mamba-1; a float for Jamba's mixer, whose dt (time_step_rank
    features), B and C (d_state each) pass through RMSNorms with this eps after x_proj.
    """

    # kept in float32 whatever the model dtype: decay rates, skip and step-size bias
    float32_params = ("A_log", "D", "dt_proj.bias")

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        d_state: int,
        conv_kernel: int,
        time_step_rank: int,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        activation: str = "silu",
        dt_bc_norm_eps: float | None = None,
        cache_index: int = 0,
    ):
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-1 mixer: unsupported hidden_act {activation!r} (the conv activation); expected "
                             "'silu'")
        tp = current_group()
        D = intermediate_size
        d0, d1 = even_range(D, tp, "the Mamba-1 inner width (intermediate_size)")
        self.intermediate_size, self.d_state = d1 - d0, d_state  # the rank's channels
        self.conv_kernel, self.time_step_rank = conv_kernel, time_step_rank
        self.cache_index = cache_index
        self.in_proj = ColumnParallelLinear(hidden_size, 2 * D, bias=use_bias, ranges=[(d0, d1), (D + d0, D + d1)])
        self.conv1d = _Conv1dWeights(d1 - d0, conv_kernel, use_conv_bias, full_dim=D, ranges=[(d0, d1)], group=tp)
        self.x_proj = RowParallelLinear(D, time_step_rank + 2 * d_state, bias=False)
        self.dt_proj = ColumnParallelLinear(time_step_rank, D, bias=True)
        self.dt_proj.supports_fp8 = False  # its weight feeds F.linear beside the scan as it is
        self.A_log = nn.Parameter(torch.empty(d1 - d0, d_state))
        self.D = nn.Parameter(torch.empty(d1 - d0))
        for name in ("A_log", "D"):
            set_shard(self, name, Shard(0, D, ((d0, d1),)), tp)
        self.out_proj = RowParallelLinear(D, hidden_size, bias=use_bias)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if dt_bc_norm_eps is not None:
            self.dt_layernorm = RMSNorm(time_step_rank, eps=dt_bc_norm_eps)
            self.b_layernorm = RMSNorm(d_state, eps=dt_bc_norm_eps)
            self.c_layernorm = RMSNorm(d_state, eps=dt_bc_norm_eps)

    @property
    def cache_indices(self) -> tuple[int, ...]:
        return (self.cache_index,)

    def cache_spec(self, dtypes: CacheDtypes) -> MambaSpec:
        """Per request: conv state (width - 1, d_inner), SSM state (d_inner, d_state)."""
        return MambaSpec((self.conv_kernel - 1, self.intermediate_size), (self.intermediate_size, self.d_state),
                         dtypes.conv, dtypes.ssm)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext, partials: bool = False) -> torch.Tensor:
        """hidden_states: (T, hidden) -> (T, hidden). partials=True (for a caller whose next op
        is `RMSNorm.add_and_norm`) returns (num_parts, T, hidden) terms summing to the output."""
        xz = self.in_proj(hidden_states)  # (T, 2 * d_inner)
        y = split_op(self.state_core, (xz,), ctx)  # (T, d_inner), gated by silu(z)
        return project_out(self.out_proj, y, partials)

    def state_core(self, xz: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`ssm`, with speculative decoding's verify rows run position by position (`layers.verify`)."""
        return run_state_op(self.ssm, xz, ctx, self.cache_index)

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log), float32 (d_inner, d_state): `cached_decay_rates`."""
        return cached_decay_rates(self)

    def ssm(self, xz: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The state-dependent core: conv1d, the input-dependent dt, B, C, and the scan.

        xz: (num_tokens, 2 * d_inner) from in_proj. Returns y (num_tokens, d_inner), already
        multiplied by silu(z). Reads and writes this layer's state slots of `ctx`. Rows past
        the last sequence (padding of a piecewise graph) are left unwritten.
        """
        # its spec does not declare saves_inside_prefill: the scheduler ends chunks at checkpoints
        assert not len(ctx.state_saves), "the Mamba-1 scan writes no state checkpoint inside a chunk"
        I = self.intermediate_size
        x, z = xz[:, :I], xz[:, I:]  # column slices: the conv and the scan read them in place
        conv_states, ssm_states = ctx.mamba_caches[self.cache_index]
        weight = self.conv1d.weight.view(I, self.conv_kernel)
        if ctx.decode_only:
            x = ops.causal_conv1d_update(x, conv_states, weight, self.conv1d.bias, ctx.state_indices)
            dt, B, C = self._dt_B_C(x)
            return ops.selective_scan_update(ssm_states, x, dt, self.decay_rates(), B, C, self.D, z,
                                             self.dt_proj.bias, ctx.state_indices)
        x = ops.causal_conv1d(x, weight, self.conv1d.bias, conv_states, ctx.query_start_loc, ctx.state_indices,
                              ctx.has_initial_state, blocks=ctx.conv_blocks())
        dt, B, C = self._dt_B_C(x)
        return ops.selective_scan(x, dt, self.decay_rates(), B, C, self.D, z, self.dt_proj.bias, ssm_states,
                                  ctx.query_start_loc, ctx.state_indices, ctx.has_initial_state,
                                  query_start_loc_host=ctx.query_start_loc_host)

    def _dt_B_C(self, x: torch.Tensor):
        """x: (T, d_inner) after the conv -> dt (T, d_inner) before its bias and softplus, and
        B, C (T, d_state) (column slices of x_proj's output; Jamba: their RMSNorms, and dt from
        the normed low-rank dt)."""
        R, N = self.time_step_rank, self.d_state
        x_dbl = self.x_proj(x)  # (T, R + 2N), all-reduced under tensor parallelism
        dt, B, C = x_dbl[:, :R], x_dbl[:, R : R + N], x_dbl[:, R + N :]
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        return F.linear(dt, self.dt_proj.weight), B, C  # dt: (T, d_inner)
