"""The Mamba-1 selective scan over a packed batch, with state pool I/O: ops `selective_scan`
(prefill and mixed steps) and `selective_scan_update` (decode), their Triton kernel and
launchers (Mamba2's are `ssd_chunk_scan` and `ssd_state_update`).

Mamba-1 (Gu & Dao 2023, section 3, Algorithm 2) has one decay rate per (channel, state) pair,
A: (dim, dstate), where Mamba2 has one scalar per head; its state is (dim, dstate) per sequence.
There is no SSD (matrix) form to exploit, so the kernel is the recurrence itself: each
program owns a (BLOCK_D, dstate) tile of one sequence's state, in float32 registers, and walks
that sequence's tokens in order, emitting y for its channels at every step; the packed launch
takes the tokens CHUNK at a time (a parallel prefix scan of their affine steps inside each
chunk), the decode launch one by one. The grid is
(channel blocks, sequences): a mixed batch of prefills and one-token decodes is one launch, and
a decode costs one step of each of its programs.

`selective_scan` takes the packed batch (query_start_loc, has_initial_state);
`selective_scan_update` is the same kernel for a decode-only batch (row b is sequence b,
always with a state): no plan and no host sync, so it is safe inside CUDA graphs, and so is
the varlen kernel itself (its loop bounds are read on the device; its launcher checks the
offsets on the host, from the step's host copy when it is given one).

A state index of -1 marks padding: its rows are computed from a zero state and no slot is read
or written. Math: `reference.selective_scan`. This module knows nothing about models or the
engine.
"""

from __future__ import annotations

import numpy as np
import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, check_batch, next_power_of_2, process_dt
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.varlen import read_offsets

# Fixed launch configs (never autotuned: the kernel writes live state in place). chunk: 0 walks
# the tokens one by one; c > 0 takes c tokens at a time (one load of each operand, then a
# parallel prefix scan of the c steps: log2(c) dependent steps instead of c, at twice the
# arithmetic). Narrow channel blocks spread a single long prompt over many programs (130M:
# 1,536 channels -> 192 programs per sequence). Measured on an H200 at mamba-130m's shapes
# (benchmarks/results/h200/kernels/mamba1-selective-scan.json): a 2,048-token prefill takes 285 us in
# chunks of 32 against 1,148-3,400 us token by token; decode at batch 256 takes 21 us with
# 32-channel blocks against 55 us with 8-channel ones.
SCAN_CONFIG = {"block_d": 8, "num_warps": 4, "chunk": 32}  # the packed (prefill + decode) launch
UPDATE_CONFIG = {"block_d": 32, "num_warps": 2}  # the decode-only launch (always token by token)


@triton.jit
def _compose(a_first, b_first, a_then, b_then):
    # two affine steps h -> a h + b, the first then the second: the scan's associative operator
    return a_first * a_then, a_then * b_first + b_then


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, state_ptr,
    qsl_ptr, state_idx_ptr, has_init_ptr,
    dim, dstate,
    stride_x_t, stride_x_d, stride_dt_t, stride_dt_d, stride_A_d, stride_A_n,
    stride_B_t, stride_B_n, stride_C_t, stride_C_n, stride_z_t, stride_z_d, stride_y_t, stride_y_d,
    stride_s_slot, stride_s_d, stride_s_n,
    VARLEN: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_d = tl.program_id(0)  # fastest: neighbouring programs read neighbouring channels
    seq = tl.program_id(1)
    if VARLEN:
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        has_init = tl.load(has_init_ptr + seq).to(tl.int32)
    else:  # decode: row `seq` is sequence `seq`, always continuing its state
        start = seq.to(tl.int64)
        end = start + 1
        has_init = 1
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)

    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < dim
    n_mask = n < dstate
    tile_mask = d_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + d[:, None] * stride_A_d + n[None, :] * stride_A_n, mask=tile_mask, other=0.0).to(tl.float32)
    dt_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=d_mask, other=0.0).to(tl.float32)

    # rows of the old state this program may read: none for padding or a fresh sequence (an
    # integer bound, not a scalar boolean: some interpreter versions cannot mix those with tensors)
    d_read = ((slot >= 0).to(tl.int32) * has_init) * dim
    s_ptrs = state_ptr + slot * stride_s_slot + d[:, None] * stride_s_d + n[None, :] * stride_s_n
    h = tl.load(s_ptrs, mask=(d < d_read)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)

    if CHUNK == 0:
        for t in range(start, end):
            x = tl.load(x_ptr + t * stride_x_t + d * stride_x_d, mask=d_mask, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + t * stride_dt_t + d * stride_dt_d, mask=d_mask, other=0.0).to(tl.float32)
            dt = process_dt(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, False, 0.0, 0.0)
            Bv = tl.load(B_ptr + t * stride_B_t + n * stride_B_n, mask=n_mask, other=0.0).to(tl.float32)
            Cv = tl.load(C_ptr + t * stride_C_t + n * stride_C_n, mask=n_mask, other=0.0).to(tl.float32)
            # h_t = exp(dt A) h_{t-1} + dt x_t B_t (zero-order hold on A, Euler on B: section 3.2)
            h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * Bv[None, :]
            y = tl.sum(h * Cv[None, :], axis=1) + Dv * x
            if HAS_Z:
                z = tl.load(z_ptr + t * stride_z_t + d * stride_z_d, mask=d_mask, other=0.0).to(tl.float32)
                y = y * z * tl.sigmoid(z)
            tl.store(y_ptr + t * stride_y_t + d * stride_y_d, y.to(y_ptr.dtype.element_ty), mask=d_mask)
    else:
        r = tl.arange(0, CHUNK)
        for t0 in range(start, end, CHUNK):
            t = t0 + r  # (CHUNK,) token rows
            t_mask = t < end
            m = t_mask[:, None] & d_mask[None, :]
            x = tl.load(x_ptr + t[:, None] * stride_x_t + d[None, :] * stride_x_d, mask=m, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + t[:, None] * stride_dt_t + d[None, :] * stride_dt_d, mask=m, other=0.0).to(tl.float32)
            dt = process_dt(dt, dt_bias[None, :], HAS_DT_BIAS, DT_SOFTPLUS, False, 0.0, 0.0)
            dt = tl.where(t_mask[:, None], dt, 0.0)  # rows past the end: h -> 1 * h + 0
            mn = t_mask[:, None] & n_mask[None, :]
            Bv = tl.load(B_ptr + t[:, None] * stride_B_t + n[None, :] * stride_B_n, mask=mn, other=0.0).to(tl.float32)
            Cv = tl.load(C_ptr + t[:, None] * stride_C_t + n[None, :] * stride_C_n, mask=mn, other=0.0).to(tl.float32)
            # each token is the affine step h -> exp(dt A) h + dt x B; their prefix compositions
            # applied to the state entering the chunk give the state after every token
            decay = tl.exp(dt[:, :, None] * A[None, :, :])  # (CHUNK, BLOCK_D, BLOCK_N)
            inject = (dt * x)[:, :, None] * Bv[:, None, :]
            decay, inject = tl.associative_scan((decay, inject), 0, _compose)
            hs = decay * h[None, :, :] + inject
            y = tl.sum(hs * Cv[:, None, :], axis=2) + Dv[None, :] * x
            if HAS_Z:
                z = tl.load(z_ptr + t[:, None] * stride_z_t + d[None, :] * stride_z_d, mask=m, other=0.0).to(tl.float32)
                y = y * z * tl.sigmoid(z)
            tl.store(y_ptr + t[:, None] * stride_y_t + d[None, :] * stride_y_d, y.to(y_ptr.dtype.element_ty), mask=m)
            h = tl.sum(tl.where((r == CHUNK - 1)[:, None, None], hs, 0.0), axis=0)  # rows past the end kept it

    if slot >= 0:
        tl.debug_barrier()  # every thread's read of the old tile precedes any write (empty sequences)
        tl.store(s_ptrs, h.to(state_ptr.dtype.element_ty), mask=tile_mask)


def _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states) -> None:
    """The operands both Mamba-1 ops share (shapes in `selective_scan`). Raises ValueError on bad ones."""
    check(x.dim() == 2, lambda: f"x must be (num_tokens, dim), got {tuple(x.shape)}")
    T, dim = x.shape
    check(dt.shape == x.shape, lambda: f"dt must be ({T}, {dim}), got {tuple(dt.shape)}")
    check(A.dim() == 2 and A.shape[0] == dim, lambda: f"A must be ({dim}, dstate), got {tuple(A.shape)}")
    N = A.shape[1]
    check(B.shape == (T, N) and C.shape == (T, N),
          lambda: f"B and C must be ({T}, {N}), got {tuple(B.shape)} and {tuple(C.shape)}")
    check(D is None or D.shape == (dim,), lambda: f"D must be ({dim},), got {tuple(D.shape)}")
    check(dt_bias is None or dt_bias.shape == (dim,), lambda: f"dt_bias must be ({dim},), got {tuple(dt_bias.shape)}")
    check(z is None or z.shape == x.shape, lambda: f"z must be ({T}, {dim}), got {tuple(z.shape)}")
    check(ssm_states.dim() == 3 and ssm_states.shape[1:] == (dim, N),
          lambda: f"ssm_states must be (num_slots, {dim}, {N}), got {tuple(ssm_states.shape)}")


def _launch(varlen, x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
            has_initial_state, dt_softplus):
    dim, dstate = A.shape
    batch = state_indices.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if batch == 0 or dim == 0:
        return y
    cfg = SCAN_CONFIG if varlen else UPDATE_CONFIG
    zz = z if z is not None else x
    grid = (triton.cdiv(dim, cfg["block_d"]), batch)
    _selective_scan_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, zz, dt_bias if dt_bias is not None else A, y, ssm_states,
        query_start_loc if query_start_loc is not None else state_indices, state_indices,
        has_initial_state if has_initial_state is not None else state_indices,
        dim, dstate,
        *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        *ssm_states.stride(),
        VARLEN=varlen, HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus), CHUNK=cfg.get("chunk", 0) if varlen else 0,
        BLOCK_D=cfg["block_d"], BLOCK_N=max(16, next_power_of_2(dstate)),
        num_warps=cfg["num_warps"],
    )
    return y


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    query_start_loc_host: np.ndarray | None = None,
) -> torch.Tensor:
    """The Mamba-1 selective scan over variable-length packed sequences, with state pool I/O
    (Mamba-1 prefill and mixed steps; Mamba2's is `ssd_chunk_scan`).

    x: (num_tokens, dim); dt: (num_tokens, dim), before dt_bias and softplus; A: (dim, dstate)
    float32 (one decay rate per channel and state); B, C: (num_tokens, dstate); D, dt_bias:
    (dim,) or None; z: (num_tokens, dim) or None (y is multiplied by silu(z)); any strides
    (column slices of in_proj's and x_proj's outputs). ssm_states: (num_slots, dim, dstate),
    float32/bfloat16/float16, read as the initial state where has_initial_state and overwritten
    with each sequence's final state (float32 arithmetic); query_start_loc (batch + 1,) int32,
    state_indices (batch,) int32 (-1 = padding), has_initial_state (batch,) bool.
    query_start_loc_host: the step's host copy of query_start_loc, already checked
    (`ForwardContext.query_start_loc_host`, or `varlen.check_offsets`): the kernel path then
    checks only its size and its end against x, without a device read; None reads and checks
    query_start_loc on the host (a host sync, never inside a CUDA-graph capture).
    Returns y (num_tokens, dim) in x.dtype; rows past query_start_loc[-1] are left unwritten.
    Math (Mamba paper, Gu & Dao 2023, section 3, Algorithm 2): dt' = softplus(dt + dt_bias);
    h_t = exp(dt'_t A) * h_{t-1} + (dt'_t x_t) B_t^T; y_t = h_t C_t + D x_t;
    `reference.selective_scan`. Raises ValueError on inconsistent shapes, query_start_loc that
    starts below 0, decreases or ends past x's rows, or a host copy of another size.
    """
    _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    batch = check_batch(query_start_loc, state_indices, has_initial_state)
    if not use_triton(x):
        return reference.selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
                                        has_initial_state, dt_softplus)
    qsl = read_offsets(query_start_loc) if query_start_loc_host is None else query_start_loc_host
    check(qsl.shape == (batch + 1,), lambda: f"query_start_loc_host has {qsl.size} offsets for {batch} sequences")
    check(qsl[-1] <= x.shape[0], lambda: f"query_start_loc ends at {int(qsl[-1])}, past the {x.shape[0]} rows of x")
    return _launch(True, x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
                   has_initial_state, dt_softplus)


def selective_scan_update(
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
) -> torch.Tensor:
    """One Mamba-1 recurrence step per sequence (decode), in place on the state pool: the
    per-channel-A counterpart of Mamba2's `ssd_state_update`. No plan and no host sync: safe
    inside CUDA graphs.

    ssm_states: (num_slots, dim, dstate); x, dt: (batch, dim); A: (dim, dstate) float32;
    B, C: (batch, dstate); D, dt_bias: (dim,) or None; z: (batch, dim) or None; state_indices:
    (batch,) int32, -1 = padding (y from a zero state, no slot touched). Any strides. Returns y
    (batch, dim) in x.dtype. Math: `selective_scan`'s, one step; `reference.selective_scan_update`.
    Raises ValueError on inconsistent shapes.
    """
    _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    check(state_indices.shape == (x.shape[0],),
          lambda: f"state_indices must be ({x.shape[0]},), got {tuple(state_indices.shape)}")
    if not use_triton(x):
        return reference.selective_scan_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus)
    return _launch(False, x, dt, A, B, C, D, z, dt_bias, ssm_states, None, state_indices, None, dt_softplus)
