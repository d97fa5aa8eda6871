"""The Mamba2 (SSD) decode step: op `ssd_state_update`, one SSM recurrence step per sequence in
place on the state pool, its Triton kernel and launcher.

Each program owns a (block_p, dstate) tile of one head of one sequence's state: it reads the
tile from the state pool, advances it by one token, writes it back and emits the matching
(block_p,) slice of y. The state pool dominates the bytes (float32: 4 * nheads * headdim *
dstate per sequence, read and written once), so the kernel is a streaming read-modify-write.
A state index of -1 marks padding: y is computed from a zero state and no slot is touched.

Math: `reference.ssd_state_update` (Mamba2 paper, section 3: h_t =
exp(dt A) h_{t-1} + dt x_t B_t^T, y_t = h_t C_t + D x_t, times silu(z)). No plan and no host
sync: safe inside CUDA graphs. This module knows nothing about models or the engine.
"""

from __future__ import annotations

import math

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, dt_limit_args, next_power_of_2, process_dt
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.ssd import check_ssd_operands

# Fixed launch config (tuned offline with benchmarks/kernels.py; never autotuned: the kernel
# writes live state in place).
STATE_UPDATE_CONFIG = {"block_p": 16, "num_warps": 4}


@triton.jit
def _ssd_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, state_idx_ptr,
    sq_ptr, gate_ptr,
    nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_b, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n,
    stride_z_b, stride_z_h, stride_z_p,
    stride_y_b, stride_y_h, stride_y_p,
    stride_g_b, stride_g_h, stride_g_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, HAS_SQ: tl.constexpr, SQ_GATED: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # HAS_SQ: also sq[b, h, pid_p] = sum over this program's rows of v^2, v = y as stored (rounded)
    # times silu(gate) when SQ_GATED: the gated RMSNorm's sum of squares, in parts, for a consumer
    # that applies the norm itself (`gemv.gated_norm_linear_partials`).
    pid_p = tl.program_id(0)  # fastest: neighbouring programs stream neighbouring state rows
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    slot = tl.load(state_idx_ptr + b).to(tl.int64)

    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < dstate
    tile_mask = p_mask[:, None] & n_mask[None, :]
    s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n
    p_read = (slot >= 0).to(tl.int32) * headdim  # padding reads nothing (a zero state)
    # each state byte is touched once: keep it from evicting the small shared operands
    state = tl.load(s_ptrs, mask=(p < p_read)[:, None] & n_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)

    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + p * stride_x_p, mask=p_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = process_dt(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    Bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + n * stride_B_n, mask=n_mask, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + n * stride_C_n, mask=n_mask, other=0.0).to(tl.float32)

    state = state * dA + (x * dt)[:, None] * Bv[None, :]
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + p * stride_z_p, mask=p_mask, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(y_ptr + b * stride_y_b + h * stride_y_h + p * stride_y_p, y.to(y_ptr.dtype.element_ty), mask=p_mask)
    if HAS_SQ:
        v = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        if SQ_GATED:
            gz = tl.load(gate_ptr + b * stride_g_b + h * stride_g_h + p * stride_g_p, mask=p_mask,
                         other=0.0).to(tl.float32)
            v = v * gz * tl.sigmoid(gz)  # the norm kernel's order of operations
        v = tl.where(p_mask, v, 0.0)
        tl.store(sq_ptr + (b * nheads + h) * tl.num_programs(0) + pid_p, tl.sum(v * v, axis=0))
    if slot >= 0:
        tl.debug_barrier()  # every thread has read its part of the tile before any write
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_mask, eviction_policy="evict_first")


def gated_sum_of_squares(y: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The sums of squares `ssd_state_update(..., norm_sq=True)` returns beside y, in PyTorch (the
    reference path's, and the tests'): per row and head, the sum over features of (y *
    silu(gate))^2, or of y^2 without a gate, in float32 (float64 for float64 y).
    y, gate: (batch, nheads, headdim) -> (batch, nheads, 1)."""
    v = y.to(torch.float64 if y.dtype == torch.float64 else torch.float32)
    if gate is not None:
        v = v * torch.nn.functional.silu(gate.to(v.dtype))
    return v.pow(2).sum(-1, keepdim=True)


def ssd_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    *,
    norm_sq: bool = False,
    norm_gate: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One Mamba2 (SSD) recurrence step per sequence (decode), in place on the state pool; the
    Mamba-1 step is `selective_scan_update`. No plan and no host sync: safe inside CUDA graphs.

    ssm_states: (num_slots, nheads, headdim, dstate), float32/bfloat16/float16, updated in
    place (float32 arithmetic); x: (batch, nheads, headdim); dt: (batch, nheads); A: (nheads,);
    B, C: (batch, ngroups, dstate); D, dt_bias: (nheads,) or None; z: like x or None;
    state_indices: (batch,) int32, -1 = padding (y from a zero state, no slot touched). Any
    strides. Returns y (batch, nheads, headdim) in x.dtype. Math: `ssd_chunk_scan`'s, one
    step; `reference.ssd_state_update`. Raises ValueError on inconsistent shapes.

    norm_sq=True also returns the sums of squares a gated RMSNorm of y needs, so that its
    consumer (`ops.gated_norm_linear_partials`) applies the norm without a launch of its own:
    (y, sq) with sq (batch, nheads, parts) float32 (float64 for float64 x): sq[b, h].sum() is
    the sum over head h's features of v^2, v = y as returned (rounded to x.dtype) times
    silu(norm_gate) (norm_gate: like x, any strides; None: v = y, the norm before its gate).
    parts is the launch's split of headdim (1 on the reference).
    """
    check_ssd_operands(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    check(state_indices.shape == (x.shape[0],),
          lambda: f"state_indices must be ({x.shape[0]},), got {tuple(state_indices.shape)}")
    check(norm_gate is None or (norm_sq and norm_gate.shape == x.shape),
          "norm_gate must have the shape of x, and is read only with norm_sq=True")
    if not use_triton(x):
        y = reference.ssd_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus,
                                       dt_limit)
        return (y, gated_sum_of_squares(y, norm_gate)) if norm_sq else y
    batch, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    y = torch.empty((batch, nheads, headdim), dtype=x.dtype, device=x.device)
    cfg = STATE_UPDATE_CONFIG
    block_p = min(cfg["block_p"], max(16, next_power_of_2(headdim)))
    parts = triton.cdiv(headdim, block_p)
    sq = torch.empty((batch, nheads, parts), dtype=torch.float32, device=x.device) if norm_sq else None
    if batch == 0:
        return (y, sq) if norm_sq else y
    has_limit, lo, hi = dt_limit_args(dt_limit)
    zz = z if z is not None else x
    gate = norm_gate if norm_gate is not None else x
    grid = (parts, nheads, batch)
    _ssd_state_update_kernel[grid](
        ssm_states, x, dt, A, B, C, D if D is not None else A, zz,
        dt_bias if dt_bias is not None else A, y, state_indices, sq if norm_sq else y, gate,
        nheads, headdim, dstate, nheads // ngroups, lo, hi,
        *ssm_states.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(),
        *y.stride(), *gate.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus), HAS_DT_LIMIT=has_limit, HAS_SQ=norm_sq, SQ_GATED=norm_gate is not None,
        BLOCK_P=block_p, BLOCK_N=max(16, next_power_of_2(dstate)), num_warps=cfg["num_warps"],
    )
    return (y, sq) if norm_sq else y
