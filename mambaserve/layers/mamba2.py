"""The Mamba2 mixer over a packed batch (Dao & Gu 2024, "Transformers are SSMs", section 7).

in_proj -> [z | xBC | dt]; a depthwise causal conv1d over xBC continuing from the conv state;
the selective scan over x with B, C, dt from the SSM state; gated RMSNorm with z; out_proj.
Falcon-H1's variants are options: no norm at all (`gated_norm=False`: y * silu(z), the gate
applied inside the scan kernels), the norm before the gate (`norm_before_gate=True`:
norm(y) * silu(z)), and an out_proj bias of its own (`out_proj_bias`).
A mixed batch of prefills and decodes goes through one `causal_conv1d` and one
`ssd_chunk_scan` call (no split); a decode-only batch uses the one-step update ops.

Parameter names and shapes follow the Hugging Face checkpoints (`in_proj`, `conv1d.weight`
(conv_dim, 1, width), `dt_bias`, `A_log`, `D`, `norm.weight`, `out_proj`). The layer reads its
(conv_states, ssm_states) pair from `ctx.mamba_caches[cache_index]`.

Tensor parallelism (built inside `distributed.building_with`) splits the heads: each rank holds
the z, x and dt rows of in_proj, the x channels of the conv, A, D, dt_bias and the norm weight
of its heads, and the B and C rows (and conv channels) of the groups its heads read: its share
of the groups when the world size divides n_groups, else (n_groups dividing the world size,
n_groups = 1 included) the one group of its heads, replicated on the ranks that share it. The
gated norm is then per group on each rank, or, for a group spread over ranks, normalised by its
sum of squares all-reduced over them. out_proj is row-parallel (one all-reduce). Sizes that
split no other way are refused (ValueError) while the model is built, before any weight loads.
The attributes num_heads, n_groups, intermediate_size and conv_dim are the rank's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops
from mambaserve.cache.spec import CacheDtypes, MambaSpec
from mambaserve.distributed import TensorParallelGroup, all_reduce, current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.graph_split import recording, split_op
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard, divide, set_shard
from mambaserve.layers.verify import run_state_op


def project_out(out_proj: RowParallelLinear, y: torch.Tensor, partials: bool) -> torch.Tensor:
    """A mixer's out_proj. y: (T, inner) -> (T, hidden), or with partials (num_parts, T, hidden)
    terms summing to it, for `RMSNorm.add_and_norm` to add: at decode sizes (and without a
    bias) the product runs as one split-K launch whose reduction the norm kernel does. Under
    tensor parallelism the product is all-reduced first (partials then (1, T, hidden))."""
    if partials:
        if out_proj.bias is None and y.shape[0] <= ops.gemv_max_tokens() and out_proj.tp_group.world_size == 1:
            # an FP8 weight: the same split-K launch reads it with its per-row scales (weight-only at decode)
            return ops.linear_partials(y, out_proj.weight, getattr(out_proj, "weight_scale", None))
        return out_proj(y)[None]
    return out_proj(y)


def cached_decay_rates(mixer: nn.Module) -> torch.Tensor:
    """A = -exp(A_log) in float32, the shape of the mixer's A_log ((nheads,) for Mamba2,
    (d_inner, d_state) for Mamba-1), computed once per weight version, not per step."""
    version = (mixer.A_log._version, mixer.A_log.data_ptr())
    if getattr(mixer, "_A_cache", (None,))[0] != version:
        mixer._A_cache = (version, -torch.exp(mixer.A_log.detach().float()))
    return mixer._A_cache[1]


class _Conv1dWeights(nn.Module):
    """conv1d.weight (dim, 1, width) and bias (dim,); under tensor parallelism the channels
    `ranges` of the full conv's `full_dim` (dim is their total)."""

    def __init__(self, dim: int, width: int, bias: bool, *, full_dim: int | None = None,
                 ranges: list[tuple[int, int]] | None = None, group: TensorParallelGroup | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, width))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        if ranges is not None:
            shard = Shard(0, full_dim, tuple(ranges))
            set_shard(self, "weight", shard, group)
            if bias:
                set_shard(self, "bias", shard, group)


def shard_heads_and_groups(num_heads: int, n_groups: int, group: TensorParallelGroup
                           ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rank's Mamba2 heads (h0, h1) and the groups (g0, g1) they read, by the rules of the
    module docstring. Raises ValueError when the world size divides neither the heads nor, or
    is divided by neither, n_groups."""
    R, r = group.world_size, group.rank
    per = divide(num_heads, group, "the Mamba2 heads (num_heads)")
    if n_groups % R == 0:
        g0, g1 = r * (n_groups // R), (r + 1) * (n_groups // R)
    elif R % n_groups == 0:
        g0 = r // (R // n_groups)  # a group spread over R / n_groups ranks, replicated on each
        g1 = g0 + 1
    else:
        raise ValueError(f"tensor_parallel_size={R} does not split the Mamba2 groups (n_groups={n_groups}): B and "
                         "C are split by group, so tensor_parallel_size must divide n_groups or be a multiple of it")
    return (r * per, (r + 1) * per), (g0, g1)


class Mamba2Mixer(nn.Module):
    """hidden_states: (num_tokens, hidden_size) -> (num_tokens, hidden_size)."""

    # kept in float32 whatever the model dtype: they set decay rates and step sizes
    float32_params = ("A_log", "D", "dt_bias")

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        intermediate_size: int | None = None,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        eps: float = 1e-6,
        dt_limit: tuple[float, float] | None = None,
        cache_index: int = 0,
        gated_norm: bool = True,
        norm_before_gate: bool = False,
        out_proj_bias: bool | None = None,
        reduce_results: bool = True,
    ):
        """gated_norm=False: no `norm` parameter, y * silu(z) (Falcon-H1 with mamba_rms_norm
        false); norm_before_gate: weight * rmsnorm_g(y) * silu(z) instead of weight *
        rmsnorm_g(y * silu(z)); out_proj_bias: None follows use_bias (in_proj's).
        reduce_results=False: under tensor parallelism the output is the rank's partial sum,
        for a caller that adds another partial sum before one all-reduce (Falcon-H1)."""
        super().__init__()
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.intermediate_size = intermediate_size or num_heads * head_dim
        if self.intermediate_size != num_heads * head_dim:
            raise ValueError(f"intermediate size {self.intermediate_size} != num_heads * head_dim ({num_heads} * "
                             f"{head_dim})")
        if num_heads % n_groups:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of n_groups ({n_groups})")
        tp = self.tp_group = current_group()
        (h0, h1), (g0, g1) = shard_heads_and_groups(num_heads, n_groups, tp)
        H, I, GN, P, N = num_heads, self.intermediate_size, n_groups * d_state, head_dim, d_state
        self.group_size = I // n_groups  # features per group of the gated norm
        self.group_index = g0  # with norm_spans_ranks: the one group this rank's heads read
        self.total_groups = n_groups
        self.norm_spans_ranks = tp.world_size > n_groups
        # from here on, the rank's heads and groups (all of them at tensor_parallel_size 1)
        self.num_heads, self.n_groups = num_heads, n_groups = h1 - h0, g1 - g0
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * d_state
        self.conv_kernel, self.chunk_size, self.eps = conv_kernel, chunk_size, eps
        self.dt_limit = tuple(dt_limit) if dt_limit is not None else (0.0, math.inf)
        self.cache_index = cache_index
        # the rank's share of the conv's channels [x | B | C] (offsets into xBC), then of in_proj's
        # packed rows [z | x | B | C | dt]
        xbc = [(h0 * P, h1 * P), (I + g0 * N, I + g1 * N), (I + GN + g0 * N, I + GN + g1 * N)]
        in_rows = [xbc[0]] + [(I + a, I + b) for a, b in xbc] + [(2 * I + 2 * GN + h0, 2 * I + 2 * GN + h1)]
        self.in_proj = ColumnParallelLinear(hidden_size, 2 * I + 2 * GN + H, bias=use_bias, ranges=in_rows)
        self.conv1d = _Conv1dWeights(self.conv_dim, conv_kernel, use_conv_bias, full_dim=I + 2 * GN, ranges=xbc,
                                     group=tp)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        for name in ("dt_bias", "A_log", "D"):
            set_shard(self, name, Shard(0, H, ((h0, h1),)), tp)
        self.norm_before_gate = norm_before_gate
        self.norm = None
        if gated_norm:
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.empty(self.intermediate_size))
            set_shard(self.norm, "weight", Shard(0, I, (xbc[0],)), tp)
        out_bias = use_bias if out_proj_bias is None else out_proj_bias
        self.out_proj = RowParallelLinear(I, hidden_size, bias=out_bias, ranges=[xbc[0]],
                                          reduce_results=reduce_results)

    @property
    def cache_indices(self) -> tuple[int, ...]:
        return (self.cache_index,)

    def cache_spec(self, dtypes: CacheDtypes) -> MambaSpec:
        """Per request: conv state (width - 1, conv_dim), SSM state (nheads, headdim, dstate)."""
        return MambaSpec((self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.d_state),
                         dtypes.conv, dtypes.ssm, saves_inside_prefill=True)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext, partials: bool = False) -> torch.Tensor:
        """hidden_states: (T, hidden) -> (T, hidden). partials=True (for a caller whose next op
        is `RMSNorm.add_and_norm`) returns (num_parts, T, hidden) terms summing to the output:
        at decode sizes out_proj then runs as one split-K launch whose reduction the norm does."""
        I = self.intermediate_size
        zxbcdt = self.in_proj(hidden_states)  # (T, I + conv_dim + H)
        if partials and self._norm_in_out_proj(ctx, zxbcdt.shape[0]):
            return self._decode_norm_in_out_proj(zxbcdt, ctx)
        y = split_op(self.state_core, (zxbcdt,), ctx)  # (T, I); already times silu(z) without a norm
        if self.norm_spans_ranks and self.norm is not None:
            y = self._gated_norm_over_ranks(y, zxbcdt[:, :I])
        elif self.norm is not None:
            y = ops.rms_norm_gated(y, self.norm.weight, zxbcdt[:, :I], self.eps, group_size=self.group_size,
                                   norm_before_gate=self.norm_before_gate)
        return project_out(self.out_proj, y, partials)

    def _norm_in_out_proj(self, ctx: ForwardContext, num_tokens: int) -> bool:
        """Whether this step folds the gated norm into out_proj (`_decode_norm_in_out_proj`): a
        decode-only step of split-K size, a norm of whole groups on this rank, no out_proj bias
        or all-reduce, a weight in the model dtype (the fused GEMV reads no FP8 scales), fusions
        on, and no piecewise capture (which must see the state update as a split op)."""
        return (ctx.decode_only and num_tokens <= ops.gemv_max_tokens() and self.norm is not None
                and not self.norm_spans_ranks and self.tp_group.world_size == 1 and self.out_proj.bias is None
                and getattr(self.out_proj, "weight_scale", None) is None and ops.fusions_enabled() and not recording())

    def _decode_norm_in_out_proj(self, zxbcdt: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A decode step whose gated norm runs in out_proj's prologue: the state update also
        returns the norm's sums of squares, `ops.gated_norm_linear_partials` normalises and
        projects (one launch fewer). zxbcdt: (T, I + conv_dim + H) -> (num_parts, T, hidden).
        The conv update stays a launch of its own: every state-update program of a group reads
        that group's B and C channels after the conv, so folding the conv in would have one
        program shift a conv state that others still read (and the norm cannot move into the
        state update's epilogue: a group's features span heads x headdim programs)."""
        T, I = zxbcdt.shape[0], self.intermediate_size
        z = zxbcdt[:, :I]
        xBC = zxbcdt[:, I : I + self.conv_dim]
        dt = zxbcdt[:, I + self.conv_dim :]
        gate = None if self.norm_before_gate else z.view(T, self.num_heads, self.head_dim)
        y, sq = self._decode_rows(xBC, dt, None, ctx.state_indices, ctx, norm_sq=True, norm_gate=gate)
        return ops.gated_norm_linear_partials(y.view(T, I), z, sq, self.norm.weight, self.eps, self.group_size,
                                              self.norm_before_gate, self.out_proj.weight)

    def _gated_norm_over_ranks(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm of a group spread over several ranks (`rms_norm_gated`'s math in
        float32): each rank's sum of squares of its features of the group goes in that group's
        column of a (T, n_groups) tensor whose all-reduce gives every rank its group's total.
        y, z: (T, rank's features) -> (T, rank's features) in y's dtype."""
        h, gate = y.float(), F.silu(z.float())
        if not self.norm_before_gate:
            h = h * gate
        sums = h.new_zeros(h.shape[0], self.total_groups)
        sums[:, self.group_index] = h.square().sum(-1)
        sums = all_reduce(sums, self.tp_group)
        h = h * torch.rsqrt(sums[:, self.group_index, None] / self.group_size + self.eps) * self.norm.weight.float()
        if self.norm_before_gate:
            h = h * gate
        return h.to(y.dtype)

    def state_core(self, zxbcdt: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`ssm`, with speculative decoding's verify rows run position by position (`layers.verify`)."""
        return run_state_op(self.ssm, zxbcdt, ctx, self.cache_index, self._verify_rows)

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log), float32 (nheads,): `cached_decay_rates`."""
        return cached_decay_rates(self)

    def ssm(self, zxbcdt: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The state-dependent core: conv1d and the selective scan (or their one-step updates).

        zxbcdt: (num_tokens, I + conv_dim + H) from in_proj. Returns y (num_tokens, I),
        before the gated norm (with no norm: y * silu(z), the gate applied by the scan ops).
        Reads and writes this layer's state slots of `ctx`. The leading decodes of a mixed step
        take the one-step kernels (conv update, state update: one read and one write of each
        state), the prefills the chunked ones, in the same forward.
        """
        T = zxbcdt.shape[0]
        I = self.intermediate_size
        xBC = zxbcdt[:, I : I + self.conv_dim]  # column slice: the conv reads it in place
        dt = zxbcdt[:, I + self.conv_dim :]
        # without a norm the gate goes into the scan kernels: (T, H, P) view of in_proj's z columns
        z = zxbcdt[:, :I].view(T, self.num_heads, self.head_dim) if self.norm is None else None
        nd = ctx.num_decodes
        if ctx.decode_only:
            return self._decode_rows(xBC, dt, z, ctx.state_indices, ctx).view(T, I)
        if nd == 0:
            return self._prefill_rows(xBC, dt, z, ctx).view(T, I)
        y = zxbcdt.new_empty(T, I)
        zd, zp = (None, None) if z is None else (z[:nd], z[nd:])
        y[:nd] = self._decode_rows(xBC[:nd], dt[:nd], zd, ctx.state_indices[:nd], ctx).view(nd, I)
        y[nd:] = self._prefill_rows(xBC[nd:], dt[nd:], zp, ctx.prefill_part()).view(T - nd, I)
        return y

    def _split_xbc(self, xBC: torch.Tensor):
        T = xBC.shape[0]
        H, P, G, N, I = self.num_heads, self.head_dim, self.n_groups, self.d_state, self.intermediate_size
        return (xBC[:, :I].view(T, H, P), xBC[:, I : I + G * N].view(T, G, N), xBC[:, I + G * N :].view(T, G, N))

    def _decode_rows(self, xBC, dt, z, state_indices, ctx: ForwardContext, **norm_sq) -> torch.Tensor:
        """One token per sequence, each with a state: conv update and state update, (n, H, P)
        (with `norm_sq`, ssd_state_update's norm_sq / norm_gate: also the norm's sums of squares)."""
        conv_states, ssm_states = ctx.mamba_caches[self.cache_index]
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        xBC = ops.causal_conv1d_update(xBC, conv_states, weight, self.conv1d.bias, state_indices)
        x, B, C = self._split_xbc(xBC)
        return ops.ssd_state_update(ssm_states, x, dt, self.decay_rates(), B, C, self.D, z, self.dt_bias,
                                    state_indices, dt_softplus=True, dt_limit=self.dt_limit, **norm_sq)

    def _verify_rows(self, zxbcdt: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Speculative decoding's verify rows (`layers.verify`): the decode updates over each
        sequence's positions in one launch per op, every position's state in its own row.
        zxbcdt: (rows, I + conv_dim + H) of the verify sequences (ctx.verify) -> (rows, I)."""
        T, I = zxbcdt.shape[0], self.intermediate_size
        xBC, dt = zxbcdt[:, I : I + self.conv_dim], zxbcdt[:, I + self.conv_dim :]
        z = zxbcdt[:, :I].view(T, self.num_heads, self.head_dim) if self.norm is None else None
        conv_states, ssm_states = ctx.mamba_caches[self.cache_index]
        plan = ctx.verify
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        xBC = ops.causal_conv1d_verify(xBC, conv_states, weight, self.conv1d.bias, plan.query_start_loc, plan.slots,
                                       plan.state_rows, plan.token_seq)
        x, B, C = self._split_xbc(xBC)
        y = ops.ssd_state_verify(ssm_states, x, dt, self.decay_rates(), B, C, self.D, z, self.dt_bias,
                                 plan.query_start_loc, plan.slots, plan.state_rows, dt_softplus=True,
                                 dt_limit=self.dt_limit)
        return y.view(T, I)

    def _prefill_rows(self, xBC, dt, z, ctx: ForwardContext) -> torch.Tensor:
        """Variable-length sequences of ctx: varlen conv and the chunked scan, (rows, H, P)."""
        conv_states, ssm_states = ctx.mamba_caches[self.cache_index]
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        xBC = ops.causal_conv1d(xBC, weight, self.conv1d.bias, conv_states, ctx.query_start_loc,
                                ctx.state_indices, ctx.has_initial_state, blocks=ctx.conv_blocks(),
                                state_saves=ctx.state_saves)
        x, B, C = self._split_xbc(xBC)
        return ops.ssd_chunk_scan(x, dt, self.decay_rates(), B, C, self.chunk_size, self.D, z, self.dt_bias,
                                    ssm_states, ctx.query_start_loc, ctx.state_indices, ctx.has_initial_state,
                                    dt_softplus=True, dt_limit=self.dt_limit, chunks=ctx.ssd_chunks(self.chunk_size),
                                    state_saves=ctx.state_saves)
