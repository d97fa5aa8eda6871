"""The Mamba2 SSD chunked scan over variable-length packed sequences: op `ssd_chunk_scan`, its
Triton kernels and launcher (the decode step is `state_update.ssd_state_update`).

The algorithm is the Mamba2 paper's (Dao & Gu, "Transformers are SSMs", section 6 and the
minimal SSD listing), with every chunk inside one sequence (chunk boundaries per sequence are
the step's plan, `varlen.SsdChunks`). Four steps in three launches (steps 1 and 2 read only the
inputs, so one launch `_chunk_state_cb_kernel` runs both: its first programs are step 1's, the
rest step 2's; on the host each launch costs more than the cb step's GPU time at small sizes):

1. `_chunk_state`, programs (chunks, heads, p/n blocks): dt' = clamp(softplus(dt +
   dt_bias), dt_limit), the in-chunk cumulative sum of dt' A (stored for steps 3 and 4), and
   the chunk's own contribution to the state at its end,
   s_c = sum_l exp(cs_end - cs_l) dt'_l x_l B_l^T (float32), in one pass over the chunk's
   rows in the matrix unit, the sum kept relative to the end of the rows added so far and
   rescaled by exp of the next block's total decay before that block goes in.
2. `_chunk_cb`, programs (chunks x groups, row blocks, column blocks): C B^T of each chunk
   and group, lower block triangle only (shared by all heads of the group).
3. `_state_passing_kernel`, grid (sequences, heads, state blocks): walks each sequence's chunks
   in order from its initial state (read from the pool by state index, or zero), stores the
   state entering every chunk (in x's dtype, for step 4) and writes the final state to the pool
   (float32 accumulation; the pool may be float32, bfloat16 or float16).
4. `_chunk_scan_kernel`, grid (chunks x row blocks, heads): y = exp(cs) C h_in (inter-chunk)
   + (C B^T * exp(cs_i - cs_j) * dt'_j, causal) x (intra-chunk), + D x, times silu(z). Only
   the diagonal blocks take pairwise exponentials; the rows before a block share one factor.

A state index of -1 marks padding: that sequence starts from a zero state and no slot is read or
written. Math: `reference.ssd_chunk_scan`. The kernels write the state
pool in place, so their configs are fixed (tuned offline with benchmarks/kernels.py).
This module knows nothing about models or the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import (
    TL_DTYPES,
    cdiv,
    check,
    check_batch,
    check_positive_int,
    dt_limit_args,
    next_power_of_2,
    process_dt,
)
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.varlen import NO_SAVES, SsdChunks, StateSaves, read_offsets, ssd_chunks

# Fixed launch configs; block sizes are capped by the problem's own sizes at launch.
# H200 (benchmarks/tune_ssd.py): 2 warps are mma.sync, out of the sm_90 wgmma pipelining hazard
# with a register operand (4 warps, 2 stages: 1.5% faster, in the hazard's class)
CHUNK_STATE_CONFIG = {"block_k": 32, "block_p": 64, "block_n": 128, "num_warps": 2, "num_stages": 2}
# the C B^T step runs in the chunk-state step's launch, with its num_warps and num_stages; from
# SEPARATE_CB_MIN_TOKENS tokens in a step the two run as two launches of the kernel compiled
# apart (long prefills: the kernel time outweighs one launch)
CB_CONFIG = {"block_m": 64, "block_k": 64, "block_n": 128}
SEPARATE_CB_MIN_TOKENS = 2048  # H200: apart 74 vs 81 us at 2,048 tokens, 44 vs 42 at 1,024
PASSING_CONFIG = {"block": 512, "num_warps": 4}
# Per-chunk state contributions are kept in float32 (as mamba_ssm does); False stores them in
# x's dtype, halving the bytes between steps 1 and 3 at the cost of one rounding per chunk.
CHUNK_STATES_FP32 = True
# C B^T is stored in float32; False stores it in x's dtype (it only feeds a matrix product
# whose operand is rounded to x's dtype anyway), halving the kernel's largest re-read.
CB_FP32 = True
# H200 (benchmarks/tune_ssd.py, results/h200/kernels/ssd-launch-configs-chunk-scan.json): one
# stage, 64-row k blocks: 0.85x the time of {block_k 32, num_stages 2} on the model shapes of
# state size 128; a state of at most SMALL_STATE_MAX_DSTATE takes 8 warps and 32-row k blocks
# (0.82x). num_stages 1 also keeps the register operand of each tl.dot out of Triton's sm_90
# pipelining of wgmma across the loop's back-edge.
SCAN_CONFIG = {"block_m": 64, "block_k": 64, "block_p": 64, "num_warps": 4, "num_stages": 1}
SCAN_CONFIG_SMALL_STATE = {"block_m": 64, "block_k": 32, "block_p": 64, "num_warps": 8, "num_stages": 1}
SMALL_STATE_MAX_DSTATE = 64


@triton.jit
def _chunk_state(
    pid, x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr,
    dt_out_ptr, cs_out_ptr, chunk_dA_ptr, states_ptr,
    num_tokens, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # flat grid, heads (and p/n blocks) fastest: neighbouring programs read neighbouring
    # columns of the same token rows, so DRAM sees whole rows rather than 128-byte pieces
    num_n_blocks = tl.cdiv(dstate, BLOCK_N)
    num_pn = tl.cdiv(headdim, BLOCK_P) * num_n_blocks
    c = pid // (nheads * num_pn)
    h = (pid // num_pn) % nheads
    pid_pn = pid % num_pn
    pid_p = pid_pn // num_n_blocks
    pid_n = pid_pn % num_n_blocks
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c)
    chunk_len = tl.load(chunk_end_ptr + c) - start
    start = start.to(tl.int64)

    A = tl.load(A_ptr + h).to(tl.float32)
    dt_bias = 0.0
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    p_mask = p < headdim
    n_mask = n < dstate
    # one program per (chunk, head) stores dt' and the cumsum (as a bound: rows < k_write)
    k_write = (pid_pn == 0).to(tl.int32) * chunk_len

    t_base = h.to(tl.int64) * num_tokens + start  # row of this chunk in the (nheads, tokens) buffers
    # the accumulator is kept relative to the cumsum at the end of the block last added; the
    # cumsum of each block's last row itself is carried, not cs_carry + sum(dA): exp(block_end -
    # cs) is then exactly 1 at that row, and `total` equals the stored cs of the chunk's last
    # row bit for bit (with |cs| in the thousands one ulp is 1e-4..1e-3 relative)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    cs_carry = A * 0.0
    for k0 in range(0, chunk_len, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < chunk_len
        rows = start + k
        dt = tl.load(dt_ptr + rows * stride_dt_t + h * stride_dt_h, mask=k_mask, other=0.0).to(tl.float32)
        dt = tl.where(k_mask, process_dt(dt, dt_bias, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, dt_min, dt_max),
                      0.0)
        cs = cs_carry + tl.cumsum(dt * A, axis=0)
        tl.store(dt_out_ptr + t_base + k, dt, mask=k < k_write)
        tl.store(cs_out_ptr + t_base + k, cs, mask=k < k_write)
        block_end = tl.sum(tl.where(k == tl.minimum(k0 + BLOCK_K, chunk_len) - 1, cs, 0.0), axis=0)
        xT = tl.load(x_ptr + rows[None, :] * stride_x_t + h * stride_x_h + p[:, None] * stride_x_p,
                     mask=p_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        xT = (xT * (tl.exp(block_end - cs) * dt)[None, :]).to(OPERAND_DTYPE).to(DOT_DTYPE)
        Bk = tl.load(B_ptr + rows[:, None] * stride_B_t + g * stride_B_g + n[None, :] * stride_B_n,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(xT, Bk, acc * tl.exp(block_end - cs_carry), input_precision=DOT_PRECISION)
        cs_carry = block_end
    total = cs_carry
    if pid_pn == 0:
        tl.store(chunk_dA_ptr + c.to(tl.int64) * nheads + h, total)
    s_ptrs = (states_ptr + (c.to(tl.int64) * nheads + h) * headdim * dstate
              + p[:, None] * dstate + n[None, :])
    tl.store(s_ptrs, acc.to(states_ptr.dtype.element_ty), mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def _chunk_cb(
    pid_cg, pid_m, pid_k, C_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr, cb_ptr,
    ngroups, dstate, chunk_size,
    stride_C_t, stride_C_g, stride_C_n,
    stride_B_t, stride_B_g, stride_B_n,
    OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    c = pid_cg // ngroups
    g = pid_cg % ngroups
    start = tl.load(chunk_start_ptr + c)
    chunk_len = tl.load(chunk_end_ptr + c) - start
    start = start.to(tl.int64)
    m0 = pid_m * BLOCK_M
    k0 = pid_k * BLOCK_K
    # only blocks on or below the diagonal, inside the chunk, are ever read
    if (k0 < m0 + BLOCK_M) & (m0 < chunk_len):
        m = m0 + tl.arange(0, BLOCK_M)
        k = k0 + tl.arange(0, BLOCK_K)
        m_mask = m < chunk_len
        k_mask = k < chunk_len
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, dstate, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < dstate
            Cm = tl.load(C_ptr + (start + m)[:, None] * stride_C_t + g * stride_C_g + n[None, :] * stride_C_n,
                         mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
            BkT = tl.load(B_ptr + (start + k)[None, :] * stride_B_t + g * stride_B_g + n[:, None] * stride_B_n,
                          mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
            acc += tl.dot(Cm, BkT, input_precision=DOT_PRECISION)
        base = cb_ptr + pid_cg.to(tl.int64) * chunk_size * chunk_size
        tl.store(base + m[:, None] * chunk_size + k[None, :], acc.to(cb_ptr.dtype.element_ty),
                 mask=(m < chunk_size)[:, None] & (k < chunk_size)[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_state_programs", "num_cg"])  # per-step counts: one kernel for all
def _chunk_state_cb_kernel(
    x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, C_ptr, chunk_start_ptr, chunk_end_ptr,
    dt_out_ptr, cs_out_ptr, chunk_dA_ptr, states_ptr, cb_ptr,
    num_tokens, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
    ngroups, chunk_size, num_state_programs, num_cg, num_cb_m,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    CB_BLOCK_M: tl.constexpr, CB_BLOCK_K: tl.constexpr, CB_BLOCK_N: tl.constexpr, PART: tl.constexpr,
):
    # steps 1 and 2 read only the inputs and write separate buffers: one launch (PART 0), the
    # first num_state_programs programs computing chunk states, the rest C B^T blocks ((chunk,
    # group) fastest, then row block, then column block); PART 1 / 2: only the chunk states /
    # only C B^T (num_state_programs 0), each compiled alone (its own registers and occupancy)
    pid = tl.program_id(0)
    if PART == 1 or (PART == 0 and pid < num_state_programs):
        _chunk_state(pid, x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr,
                     dt_out_ptr, cs_out_ptr, chunk_dA_ptr, states_ptr,
                     num_tokens, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
                     stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
                     stride_B_t, stride_B_g, stride_B_n,
                     HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION,
                     BLOCK_K, BLOCK_P, BLOCK_N)
    else:
        q = pid - num_state_programs
        _chunk_cb(q % num_cg, (q // num_cg) % num_cb_m, q // (num_cg * num_cb_m),
                  C_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr, cb_ptr, ngroups, dstate, chunk_size,
                  stride_C_t, stride_C_g, stride_C_n, stride_B_t, stride_B_g, stride_B_n,
                  OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION, CB_BLOCK_M, CB_BLOCK_K, CB_BLOCK_N)


@triton.jit
def _save_state(state, save_row_ptr, c, pool_ptr, h, e, mask, dstate, stride_pool_slot, stride_pool_h,
                stride_pool_p, stride_pool_n):
    """Write the float32 state at the start of chunk c into its save row (prefix caching's
    checkpoint inside a prefill), when the chunk has one (row >= 0); mask: the chunk's live
    elements (all False past the sequence's last chunk)."""
    row = tl.load(save_row_ptr + c + 0 * e, mask=mask, other=-1)  # one row, read as a block (masks)
    ptrs = pool_ptr + row.to(tl.int64) * stride_pool_slot + h * stride_pool_h + (e // dstate) * stride_pool_p \
        + (e % dstate) * stride_pool_n
    tl.store(ptrs, state.to(pool_ptr.dtype.element_ty), mask=mask & (row >= 0))


@triton.jit
def _state_passing_kernel(
    states_ptr, chunk_dA_ptr, state_in_ptr, pool_ptr, seq_chunk_ptr, state_idx_ptr, has_init_ptr, save_row_ptr,
    nheads, state_size, dstate,
    stride_pool_slot, stride_pool_h, stride_pool_p, stride_pool_n,
    HAS_SAVES: tl.constexpr, BLOCK: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat (p, n) index inside the head
    h = tl.program_id(1)
    seq = tl.program_id(2)
    e_mask = e < state_size
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)
    use_init = (slot >= 0) & (tl.load(has_init_ptr + seq) != 0)
    c_begin = tl.load(seq_chunk_ptr + seq)
    c_end = tl.load(seq_chunk_ptr + seq + 1)
    pool_ptrs = (pool_ptr + slot * stride_pool_slot + h * stride_pool_h
                 + (e // dstate) * stride_pool_p + (e % dstate) * stride_pool_n)
    # masks from integer bounds (scalar booleans do not combine with tensors in some
    # Triton interpreter versions): elements e < bound are live
    state = tl.load(pool_ptrs, mask=e < use_init.to(tl.int32) * state_size, other=0.0).to(tl.float32)

    head_stride = nheads * state_size
    # Four chunks per step: their loads are all issued before the dependent updates, so the
    # walk is not one memory latency per chunk.
    for i in range(0, c_end - c_begin, 4):
        c = c_begin + i
        c64 = c.to(tl.int64)
        off = c64 * head_stride + h * state_size + e
        m1 = c + 1 < c_end
        m2 = c + 2 < c_end
        m3 = c + 3 < c_end
        e1 = e < m1.to(tl.int32) * state_size
        e2 = e < m2.to(tl.int32) * state_size
        e3 = e < m3.to(tl.int32) * state_size
        s0 = tl.load(states_ptr + off, mask=e_mask, other=0.0).to(tl.float32)
        s1 = tl.load(states_ptr + off + head_stride, mask=e1, other=0.0).to(tl.float32)
        s2 = tl.load(states_ptr + off + 2 * head_stride, mask=e2, other=0.0).to(tl.float32)
        s3 = tl.load(states_ptr + off + 3 * head_stride, mask=e3, other=0.0).to(tl.float32)
        a0 = tl.exp(tl.load(chunk_dA_ptr + c64 * nheads + h))
        a1 = tl.exp(tl.load(chunk_dA_ptr + (c64 + 1) * nheads + h, mask=m1, other=0.0))
        a2 = tl.exp(tl.load(chunk_dA_ptr + (c64 + 2) * nheads + h, mask=m2, other=0.0))
        a3 = tl.exp(tl.load(chunk_dA_ptr + (c64 + 3) * nheads + h, mask=m3, other=0.0))
        out_ty = state_in_ptr.dtype.element_ty
        tl.store(state_in_ptr + off, state.to(out_ty), mask=e_mask)
        if HAS_SAVES:
            _save_state(state, save_row_ptr, c64, pool_ptr, h, e, e_mask, dstate, stride_pool_slot,
                        stride_pool_h, stride_pool_p, stride_pool_n)
        state = state * a0 + s0
        tl.store(state_in_ptr + off + head_stride, state.to(out_ty), mask=e1)
        if HAS_SAVES:
            _save_state(state, save_row_ptr, c64 + 1, pool_ptr, h, e, e1, dstate, stride_pool_slot,
                        stride_pool_h, stride_pool_p, stride_pool_n)
        state = state * a1 + s1
        tl.store(state_in_ptr + off + 2 * head_stride, state.to(out_ty), mask=e2)
        if HAS_SAVES:
            _save_state(state, save_row_ptr, c64 + 2, pool_ptr, h, e, e2, dstate, stride_pool_slot,
                        stride_pool_h, stride_pool_p, stride_pool_n)
        state = state * a2 + s2
        tl.store(state_in_ptr + off + 3 * head_stride, state.to(out_ty), mask=e3)
        if HAS_SAVES:
            _save_state(state, save_row_ptr, c64 + 3, pool_ptr, h, e, e3, dstate, stride_pool_slot,
                        stride_pool_h, stride_pool_p, stride_pool_n)
        state = state * a3 + s3
    if slot >= 0:
        tl.debug_barrier()  # the initial-state read of every thread precedes the final write
        tl.store(pool_ptrs, state.to(pool_ptr.dtype.element_ty), mask=e_mask)


@triton.jit(do_not_specialize=["num_tokens"])  # a per-step count: one kernel for all
def _chunk_scan_kernel(
    x_ptr, z_ptr, C_ptr, D_ptr, cb_ptr, dt_ptr, cs_ptr, state_in_ptr, y_ptr,
    chunk_start_ptr, chunk_end_ptr,
    num_tokens, nheads, headdim, dstate, ngroups, heads_per_group, chunk_size, num_m_blocks,
    stride_x_t, stride_x_h, stride_x_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # flat grid, heads fastest: the programs of one row block read the same C B^T and C tiles
    # (hot in L2) and neighbouring columns of the same x, z and y rows
    num_p_blocks = tl.cdiv(headdim, BLOCK_P)
    pid = tl.program_id(0)
    pid_hp = pid % (nheads * num_p_blocks)
    pid_cm = pid // (nheads * num_p_blocks)
    c = pid_cm // num_m_blocks
    m0 = (pid_cm % num_m_blocks) * BLOCK_M
    h = pid_hp // num_p_blocks
    pid_p = pid_hp % num_p_blocks
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c)
    chunk_len = tl.load(chunk_end_ptr + c) - start
    if m0 >= chunk_len:
        return
    start = start.to(tl.int64)
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < chunk_len
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < headdim
    t_base = h.to(tl.int64) * num_tokens + start  # row of this chunk in the (nheads, tokens) buffers
    # rows past the chunk get cs = -inf: every decay into them is exactly 0 (no inf * 0)
    cs_m = tl.load(cs_ptr + t_base + m, mask=m_mask, other=float("-inf"))

    # The decay from row k to row m factors through c_ref, the cumsum at the row just before
    # this block (0 at the chunk start): exp(cs_m - cs_k) = exp(cs_m - c_ref) exp(c_ref - cs_k),
    # both factors <= 1 for a decaying state. The entering state and every row before the block
    # are accumulated relative to c_ref and rescaled once: no pairwise exponentials there.
    c_ref = tl.load(cs_ptr + t_base + m0 - 1, mask=m0 > 0, other=0.0)

    # inter-chunk: the state entering the chunk, read out by C, BLOCK_N state columns at a time
    # (a block below dstate holds fewer operand registers)
    state_base = state_in_ptr + (c.to(tl.int64) * nheads + h) * headdim * dstate
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < dstate
        Cm = tl.load(C_ptr + (start + m)[:, None] * stride_C_t + g * stride_C_g + n[None, :] * stride_C_n,
                     mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
        hT = tl.load(state_base + p[None, :] * dstate + n[:, None],
                     mask=n_mask[:, None] & p_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(Cm, hT, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.exp(c_ref)

    # intra-chunk, rows wholly before this block (k < m0 <= chunk_len: no row masks needed)
    cb_base = cb_ptr + (c.to(tl.int64) * ngroups + g) * chunk_size * chunk_size
    for k0 in range(0, m0, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        cb = tl.load(cb_base + m[:, None] * chunk_size + k[None, :], mask=m_mask[:, None], other=0.0)
        cs_k = tl.load(cs_ptr + t_base + k)
        dt_k = tl.load(dt_ptr + t_base + k)
        w = (cb.to(tl.float32) * (tl.exp(c_ref - cs_k) * dt_k)[None, :]).to(OPERAND_DTYPE).to(DOT_DTYPE)
        xk = tl.load(x_ptr + (start + k)[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                     mask=p_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(w, xk, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.exp(cs_m - c_ref)[:, None]

    # intra-chunk, the diagonal: causal mask and pairwise decay
    k_end = tl.minimum(m0 + BLOCK_M, chunk_len)
    for k0 in range(m0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        causal = (m[:, None] >= k[None, :]) & k_mask[None, :]
        # only entries on or below the diagonal were computed by _chunk_cb
        cb = tl.load(cb_base + m[:, None] * chunk_size + k[None, :], mask=causal & m_mask[:, None], other=0.0)
        cs_k = tl.load(cs_ptr + t_base + k, mask=k_mask, other=0.0)
        dt_k = tl.load(dt_ptr + t_base + k, mask=k_mask, other=0.0)
        decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        w = (cb.to(tl.float32) * decay * dt_k[None, :]).to(OPERAND_DTYPE).to(DOT_DTYPE)
        xk = tl.load(x_ptr + (start + k)[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                     mask=k_mask[:, None] & p_mask[None, :], other=0.0).to(OPERAND_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(w, xk, acc, input_precision=DOT_PRECISION)

    out_mask = m_mask[:, None] & p_mask[None, :]
    if HAS_D:
        xm = tl.load(x_ptr + (start + m)[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
                     mask=out_mask, other=0.0).to(tl.float32)
        acc += xm * tl.load(D_ptr + h).to(tl.float32)
    if HAS_Z:
        zm = tl.load(z_ptr + (start + m)[:, None] * stride_z_t + h * stride_z_h + p[None, :] * stride_z_p,
                     mask=out_mask, other=0.0).to(tl.float32)
        acc = acc * zm * tl.sigmoid(zm)
    tl.store(y_ptr + (start + m)[:, None] * stride_y_t + h * stride_y_h + p[None, :] * stride_y_p,
             acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _block(cap: int, size: int) -> int:
    """A power-of-two block no larger than cap nor than size rounded up, and at least 16
    (the smallest tl.dot operand)."""
    return max(16, min(cap, next_power_of_2(size)))


def check_ssd_operands(x, dt, A, B, C, D, z, dt_bias, ssm_states) -> None:
    """The operands both SSD ops share (shapes in `ssd_chunk_scan`). Raises ValueError on bad ones."""
    check(x.dim() == 3, lambda: f"x must be (tokens, nheads, headdim), got {tuple(x.shape)}")
    T, H, P = x.shape
    check(dt.shape == (T, H), lambda: f"dt must be ({T}, {H}), got {tuple(dt.shape)}")
    check(A.shape == (H,), lambda: f"A must be ({H},), got {tuple(A.shape)}")
    check(B.dim() == 3 and B.shape[0] == T and C.shape == B.shape,
          lambda: f"B and C must be ({T}, ngroups, dstate), got {tuple(B.shape)} and {tuple(C.shape)}")
    G, N = B.shape[1], B.shape[2]
    check(H % G == 0, lambda: f"nheads ({H}) must be a multiple of ngroups ({G})")
    check(D is None or D.shape == (H,), lambda: f"D must be ({H},)")
    check(dt_bias is None or dt_bias.shape == (H,), lambda: f"dt_bias must be ({H},)")
    check(z is None or z.shape == x.shape, "z must have the shape of x")
    check(ssm_states.dim() == 4 and ssm_states.shape[1:] == (H, P, N),
          lambda: f"ssm_states must be (num_slots, {H}, {P}, {N}), got {tuple(ssm_states.shape)}")


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    chunks: SsdChunks | None = None,
    state_saves: StateSaves = NO_SAVES,
) -> torch.Tensor:
    """The Mamba2 SSD scan over variable-length packed sequences, with state pool I/O (Mamba2
    prefill and mixed steps; Mamba-1 is `selective_scan`).

    x: (num_tokens, nheads, headdim); dt: (num_tokens, nheads); A: (nheads,) float32;
    B, C: (num_tokens, ngroups, dstate), head h uses group h // (nheads // ngroups);
    D, dt_bias: (nheads,) or None; z: like x or None (y is multiplied by silu(z));
    ssm_states: (num_slots, nheads, headdim, dstate), float32/bfloat16/float16, read as the
    initial state where has_initial_state and overwritten with each sequence's final state;
    query_start_loc (batch + 1,) int32, state_indices (batch,) int32 (-1 = padding),
    has_initial_state (batch,) bool. All activations may have any strides (views into
    in_proj's output). chunk_size: a positive int, the kernels' chunk length (the result does
    not depend on it). chunks: the step's chunk boundaries for this chunk_size
    (`ForwardContext.ssd_chunks`, or `varlen.ssd_chunks`), used by the kernels; None builds
    them from a device read of query_start_loc (a host sync, never inside a CUDA-graph capture).
    state_saves: prefix caching's checkpoints inside the sequences (`varlen.StateSaves`): the
    state after each save's offset rows goes into its row of ssm_states, bit for bit what a
    step ending there would leave in the slot (the chunks restart there); the plan `chunks`
    must be built with the same saves.
    Returns y like x, in x.dtype; rows past query_start_loc[-1] are left unwritten.
    Math (Mamba2 paper, "Transformers are SSMs", section 6): dt' = clamp(softplus(dt + dt_bias),
    dt_limit); h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T; y_t = h_t C_t + D x_t;
    `reference.ssd_chunk_scan`. The kernels accumulate in float32; their matrix products take
    bfloat16/float16 operands when x is in that dtype (float32 x: exact float32 products).
    Raises ValueError on inconsistent shapes, a chunk_size that is not a positive int,
    query_start_loc that starts below 0, decreases or ends past x's rows, and on the Triton
    path for x not in float32/bfloat16/float16 or chunks of another size or batch.
    """
    check_ssd_operands(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    batch = check_batch(query_start_loc, state_indices, has_initial_state)
    check(all(0 <= r < ssm_states.shape[0] for r in state_saves.row),
          lambda: f"state save rows {state_saves.row} outside the {ssm_states.shape[0]} rows of ssm_states")
    if not use_triton(x):
        return reference.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc,
                                        state_indices, has_initial_state, dt_softplus, dt_limit, state_saves)
    num_tokens, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    check(x.dtype in TL_DTYPES, lambda: f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if chunks is None:
        chunks = ssd_chunks(read_offsets(query_start_loc), chunk_size, x.device, state_saves)
    check(chunks.saves is state_saves or chunks.saves == state_saves,
          "the SSD chunks were planned for other state saves")
    check((chunks.chunk_size, chunks.batch) == (chunk_size, batch),
          lambda: f"SSD chunks of {chunks.chunk_size} for {chunks.batch} sequences; the call has "
                  f"chunk_size {chunk_size} and {batch} sequences")
    check(chunks.num_tokens <= num_tokens,
          lambda: f"query_start_loc ends at {chunks.num_tokens}, past the {num_tokens} rows of x")
    y = torch.empty((num_tokens, nheads, headdim), dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    # The intermediates and launch parameters live in the plan: every layer of a step with these
    # shapes reuses them (the kernels of one call finish before the next call's, in stream
    # order), which spares each layer six allocations and the grid arithmetic on the host.
    key = (num_tokens, nheads, headdim, dstate, ngroups, x.dtype, x.device)
    work = chunks.workspace.get(key)
    if work is None:
        work = chunks.workspace[key] = (_workspace(chunks, *key), {})
    (dt_proc, cs, chunk_dA, states, state_in, cb), launches = work
    options = (D is not None, z is not None, dt_bias is not None, bool(dt_softplus), tuple(dt_limit))
    la = launches.get(options)
    if la is None:
        la = launches[options] = _launch_params(chunks, nheads, headdim, dstate, ngroups, x, *options)
    nc = chunks.num_chunks
    for grid, num_state_programs, part in la.state_cb_launches:
        _chunk_state_cb_kernel[grid](
            x, dt, A, dt_bias if dt_bias is not None else A, B, C, chunks.chunk_start, chunks.chunk_end,
            dt_proc, cs, chunk_dA, states, cb,
            num_tokens, nheads, headdim, dstate, nheads // ngroups, la.lo, la.hi,
            ngroups, chunk_size, num_state_programs, nc * ngroups, la.num_cb_m,
            *x.stride(), *dt.stride(), *B.stride(), *C.stride(), PART=part, **la.state_cb_kw,
        )
    _state_passing_kernel[la.passing_grid](
        states, chunk_dA, state_in, ssm_states, chunks.seq_chunk, state_indices, has_initial_state,
        chunks.save_row if chunks.save_row is not None else chunks.seq_chunk,
        nheads, headdim * dstate, dstate, *ssm_states.stride(), **la.passing_kw,
    )
    if nc > 0:
        zz = z if z is not None else x
        _chunk_scan_kernel[la.scan_grid](
            x, zz, C, D if D is not None else A, cb, dt_proc, cs, state_in, y,
            chunks.chunk_start, chunks.chunk_end,
            num_tokens, nheads, headdim, dstate, ngroups, nheads // ngroups, chunk_size, la.num_m_blocks,
            *x.stride(), *zz.stride(), *C.stride(), *y.stride(), **la.scan_kw,
        )
    return y


def _workspace(chunks: SsdChunks, num_tokens, nheads, headdim, dstate, ngroups, dtype, dev) -> tuple:
    """The scan's intermediates for one plan and shape (`ssd_chunk_scan`)."""
    nc = chunks.num_chunks
    states_dtype = torch.float32 if CHUNK_STATES_FP32 else dtype
    cb_dtype = torch.float32 if CB_FP32 else dtype
    return (
        torch.empty((nheads, num_tokens), dtype=torch.float32, device=dev),  # dt'
        torch.empty((nheads, num_tokens), dtype=torch.float32, device=dev),  # in-chunk cumsum of dt' A
        torch.empty((nc, nheads), dtype=torch.float32, device=dev),  # chunk total of dt' A
        torch.empty((nc, nheads, headdim, dstate), dtype=states_dtype, device=dev),  # chunk states
        torch.empty((nc, nheads, headdim, dstate), dtype=dtype, device=dev),  # state entering each chunk
        torch.empty((nc, ngroups, chunks.chunk_size, chunks.chunk_size), dtype=cb_dtype, device=dev),  # C B^T
    )


@dataclass(frozen=True)
class _LaunchParams:
    """Grids and keyword arguments of the three launches for one plan, shape and set of options."""

    lo: float
    hi: float
    num_cb_m: int
    num_m_blocks: int
    state_cb_launches: tuple  # ((grid, num_state_programs, PART), ...): one launch, or two apart
    passing_grid: tuple
    scan_grid: tuple
    state_cb_kw: dict
    passing_kw: dict
    scan_kw: dict


def _launch_params(chunks: SsdChunks, nheads: int, headdim: int, dstate: int, ngroups: int, x: torch.Tensor,
                   has_D: bool, has_z: bool, has_dt_bias: bool, dt_softplus: bool,
                   dt_limit: tuple[float, float]) -> _LaunchParams:
    nc, chunk_size = chunks.num_chunks, chunks.chunk_size
    # Matrix-product operands are rounded to x's dtype (float32 x: exact float32 products).
    # The Triton interpreter multiplies bfloat16 operands as raw integers, so on CPU tensors
    # the rounded operands are multiplied in float32 instead: same numbers, same result.
    operand_dtype = TL_DTYPES[x.dtype]
    dot_dtype = operand_dtype if x.is_cuda else tl.float32
    dots = dict(OPERAND_DTYPE=operand_dtype, DOT_DTYPE=dot_dtype,
                DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")
    has_limit, lo, hi = dt_limit_args(dt_limit)

    cfg = CHUNK_STATE_CONFIG
    bk, bp, bn = _block(cfg["block_k"], chunk_size), _block(cfg["block_p"], headdim), _block(cfg["block_n"], dstate)
    num_state_programs = nc * nheads * cdiv(headdim, bp) * cdiv(dstate, bn)
    cb = CB_CONFIG
    cbm, cbk, cbn = _block(cb["block_m"], chunk_size), _block(cb["block_k"], chunk_size), _block(cb["block_n"], dstate)
    num_cb_m = cdiv(chunk_size, cbm)
    num_cb_programs = nc * ngroups * num_cb_m * cdiv(chunk_size, cbk)
    if nc == 0:
        state_cb_launches = ()
    elif chunks.num_tokens >= SEPARATE_CB_MIN_TOKENS:
        state_cb_launches = (((num_state_programs,), num_state_programs, 1), ((num_cb_programs,), 0, 2))
    else:
        state_cb_launches = (((num_state_programs + num_cb_programs,), num_state_programs, 0),)
    state_cb_kw = dict(HAS_DT_BIAS=has_dt_bias, DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_limit, **dots,
                       BLOCK_K=bk, BLOCK_P=bp, BLOCK_N=bn, CB_BLOCK_M=cbm, CB_BLOCK_K=cbk, CB_BLOCK_N=cbn,
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    cfg = PASSING_CONFIG
    block = min(cfg["block"], next_power_of_2(headdim * dstate))
    passing_grid = (cdiv(headdim * dstate, block), nheads, chunks.batch)
    passing_kw = dict(HAS_SAVES=chunks.save_row is not None, BLOCK=block, num_warps=cfg["num_warps"])

    cfg = SCAN_CONFIG_SMALL_STATE if dstate <= SMALL_STATE_MAX_DSTATE else SCAN_CONFIG
    bm, bp = _block(cfg["block_m"], chunk_size), _block(cfg["block_p"], headdim)
    bk = min(bm, _block(cfg["block_k"], chunk_size))  # k blocks must tile each row block
    num_m_blocks = cdiv(chunk_size, bm)
    scan_grid = (nc * num_m_blocks * nheads * cdiv(headdim, bp),)
    scan_kw = dict(HAS_D=has_D, HAS_Z=has_z, **dots, BLOCK_M=bm, BLOCK_K=bk, BLOCK_P=bp,
                   BLOCK_N=_block(cfg.get("block_n", dstate), dstate), num_warps=cfg["num_warps"],
                   num_stages=cfg["num_stages"])
    return _LaunchParams(lo, hi, num_cb_m, num_m_blocks, state_cb_launches, passing_grid, scan_grid,
                         state_cb_kw, passing_kw, scan_kw)
