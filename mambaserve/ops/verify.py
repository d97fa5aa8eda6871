"""Speculative decoding's verify rows in the Mamba2 state ops: `causal_conv1d_verify` and
`ssd_state_verify`, the decode updates run over a sequence's k + 1 new tokens in one launch,
writing the state after every position into its own state row, their Triton kernels and
launchers.

A verify sequence i owns the packed rows query_start_loc[i]:query_start_loc[i + 1] (k_i + 1 of
them); it continues from slot slots[i], which is only read; the state after its position j is
written to row state_rows[i, j] (scratch rows: the caller copies the accepted one into the slot
later). Position j's outputs and state equal those of j + 1 decode steps (`reference`'s twins
run exactly those): the conv over the concatenation [slot's conv state; the sequence's inputs],
the SSD recurrence h_j = exp(dt_j A) h_{j-1} + dt_j x_j B_j^T carried in registers across the
positions of one program (`reference_verify` holds the twins). No plan beyond the host-built
row tables and no host sync: safe inside CUDA graphs. This module knows nothing about models
or the engine.
"""

from __future__ import annotations

import math

import torch

from mambaserve.ops import reference_verify as reference
from mambaserve.ops.common import check, dt_limit_args, next_power_of_2, process_dt
from mambaserve.ops.conv1d import _check_conv
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.ssd import check_ssd_operands
from mambaserve.ops.state_update import STATE_UPDATE_CONFIG

# Fixed launch config of the conv verify kernel (the one-token update's former one; never
# autotuned: it writes state rows in place)
CONV_VERIFY_CONFIG = {"block_d": 256, "num_warps": 4}


@triton.jit
def _conv1d_verify_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr, qsl_ptr, token_seq_ptr, slot_ptr, rows_ptr,
    dim,
    stride_x_t, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_t, stride_r_seq,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # the token row
    pid_d = tl.program_id(1)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    j = t - start  # its position in the sequence
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dst = tl.load(rows_ptr + seq * stride_r_seq + j).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    # element c of [slot's state rows; x rows of the sequence]: a state row for c < width - 1
    for k in tl.static_range(WIDTH):
        c = j + k
        n_state = (c < WIDTH - 1).to(tl.int32) * dim  # integer bounds: see conv1d's varlen kernel
        n_x = (c >= WIDTH - 1).to(tl.int32) * dim
        v = tl.load(states_ptr + slot * stride_s_slot + c * stride_s_row + d, mask=d < n_state, other=0.0)
        v = v.to(tl.float32) + tl.load(x_ptr + (start + c - (WIDTH - 1)) * stride_x_t + d, mask=d < n_x,
                                       other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + d * stride_w_d + k * stride_w_k, mask=d_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t * stride_o_t + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)
    # the state after position j: elements j + 1 .. j + width - 1
    for r in tl.static_range(WIDTH - 1):
        c = j + 1 + r
        n_state = (c < WIDTH - 1).to(tl.int32) * dim
        n_x = (c >= WIDTH - 1).to(tl.int32) * dim
        v = tl.load(states_ptr + slot * stride_s_slot + c * stride_s_row + d, mask=d < n_state, other=0.0)
        v = v.to(tl.float32) + tl.load(x_ptr + (start + c - (WIDTH - 1)) * stride_x_t + d, mask=d < n_x,
                                       other=0.0).to(tl.float32)
        tl.store(states_ptr + dst * stride_s_slot + r * stride_s_row + d, v.to(states_ptr.dtype.element_ty),
                 mask=d_mask)


@triton.jit
def _ssd_verify_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, qsl_ptr, slot_ptr, rows_ptr,
    headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_z_t, stride_z_h, stride_z_p,
    stride_y_t, stride_y_h, stride_y_p, stride_r_seq,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    start = tl.load(qsl_ptr + i).to(tl.int64)
    end = tl.load(qsl_ptr + i + 1).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < dstate
    tile_mask = p_mask[:, None] & n_mask[None, :]
    tile = h * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n
    state = tl.load(state_ptr + slot * stride_s_slot + tile, mask=tile_mask, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_x_t + h * stride_x_h + p * stride_x_p, mask=p_mask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dt_t + h * stride_dt_h).to(tl.float32)
        dt = process_dt(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max)
        Bv = tl.load(B_ptr + t * stride_B_t + g * stride_B_g + n * stride_B_n, mask=n_mask, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + t * stride_C_t + g * stride_C_g + n * stride_C_n, mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (x * dt)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1)
        if HAS_D:
            y += x * tl.load(D_ptr + h).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_z_t + h * stride_z_h + p * stride_z_p, mask=p_mask, other=0.0)
            z = z.to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(y_ptr + t * stride_y_t + h * stride_y_h + p * stride_y_p, y.to(y_ptr.dtype.element_ty), mask=p_mask)
        dst = tl.load(rows_ptr + i * stride_r_seq + (t - start)).to(tl.int64)
        tl.store(state_ptr + dst * stride_s_slot + tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask)


def _check_verify_rows(num_tokens: int, query_start_loc: torch.Tensor, slots: torch.Tensor,
                       state_rows: torch.Tensor) -> int:
    """The number of verify sequences. Raises ValueError on inconsistent tables."""
    check(query_start_loc.dim() == 1 and slots.shape == (query_start_loc.numel() - 1,),
          lambda: f"query_start_loc {tuple(query_start_loc.shape)} and slots {tuple(slots.shape)} disagree")
    check(state_rows.dim() == 2 and state_rows.shape[0] == slots.shape[0],
          lambda: f"state_rows must be ({slots.shape[0]}, max positions), got {tuple(state_rows.shape)}")
    return slots.shape[0]


def causal_conv1d_verify(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         query_start_loc: torch.Tensor, slots: torch.Tensor, state_rows: torch.Tensor,
                         token_seq: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """The depthwise causal conv of verify sequences (module docstring), each position's conv
    state written to its own row.

    x: (num_tokens, dim), feature stride 1, the sequences' rows packed; conv_states: (num_rows,
    width - 1, dim), contiguous along dim; weight: (dim, width); bias: (dim,) or None;
    query_start_loc: (batch + 1,) int32 over x's rows; slots: (batch,) int32, the rows each
    sequence continues from (read only); state_rows: (batch, max_len) int32, row j receiving
    the state after position j; token_seq: (num_tokens,) int32, each row's sequence.
    Returns (num_tokens, dim) in x.dtype. Math: `reference_verify.causal_conv1d_verify`. Raises
    ValueError on inconsistent shapes.
    """
    dim, width = _check_conv(x, weight, bias, conv_states, activation)
    batch = _check_verify_rows(x.shape[0], query_start_loc, slots, state_rows)
    check(token_seq.shape == (x.shape[0],), lambda: f"token_seq must be ({x.shape[0]},)")
    if not use_triton(x):
        return reference.causal_conv1d_verify(x, conv_states, weight, bias, query_start_loc, slots, state_rows,
                                              activation)
    out = torch.empty_like(x)
    if batch == 0 or x.shape[0] == 0 or dim == 0:
        return out
    block_d = CONV_VERIFY_CONFIG["block_d"]
    _conv1d_verify_kernel[(x.shape[0], triton.cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, conv_states, out, query_start_loc, token_seq, slots,
        state_rows, dim,
        x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1), out.stride(0),
        state_rows.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish"), BLOCK_D=block_d,
        num_warps=CONV_VERIFY_CONFIG["num_warps"],
    )
    return out


def ssd_state_verify(ssm_states: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                     query_start_loc: torch.Tensor, slots: torch.Tensor, state_rows: torch.Tensor,
                     dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """The Mamba2 (SSD) recurrence over verify sequences (module docstring), each position's
    state written to its own row.

    ssm_states: (num_rows, nheads, headdim, dstate); x: (num_tokens, nheads, headdim); dt:
    (num_tokens, nheads); A: (nheads,); B, C: (num_tokens, ngroups, dstate); D, dt_bias:
    (nheads,) or None; z: like x or None; query_start_loc, slots, state_rows: as in
    `causal_conv1d_verify`. Returns y (num_tokens, nheads, headdim) in x.dtype. Math:
    `reference_verify.ssd_state_verify` (`ssd_state_update` per position). Raises ValueError on
    inconsistent shapes.
    """
    check_ssd_operands(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    batch = _check_verify_rows(x.shape[0], query_start_loc, slots, state_rows)
    if not use_triton(x):
        return reference.ssd_state_verify(ssm_states, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slots,
                                          state_rows, dt_softplus, dt_limit)
    T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    y = torch.empty((T, nheads, headdim), dtype=x.dtype, device=x.device)
    if batch == 0 or T == 0:
        return y
    has_limit, lo, hi = dt_limit_args(dt_limit)
    block_p = min(STATE_UPDATE_CONFIG["block_p"], max(16, next_power_of_2(headdim)))
    zz = z if z is not None else x
    _ssd_verify_kernel[(triton.cdiv(headdim, block_p), nheads, batch)](
        ssm_states, x, dt, A, B, C, D if D is not None else A, zz, dt_bias if dt_bias is not None else A, y,
        query_start_loc, slots, state_rows,
        headdim, dstate, nheads // ngroups, lo, hi,
        *ssm_states.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        state_rows.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        HAS_DT_LIMIT=has_limit, BLOCK_P=block_p, BLOCK_N=max(16, next_power_of_2(dstate)),
        num_warps=STATE_UPDATE_CONFIG["num_warps"],
    )
    return y
