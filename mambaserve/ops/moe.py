"""Mixture of experts: ops `fused_moe` (route, two grouped matrix products, weighted combine),
`topk_softmax` and `router_topk` (the routers), their Triton kernels and launchers.

The routed (token, expert) pairs are sorted by expert once, on the device (a stable counting
sort in Triton: one program for a few pairs, count / scan / place kernels over blocks of pairs
beyond; the result does not depend on thread timing); each expert's rows are then a contiguous
slice and both expert
layers are grouped matrix products over those slices:
- `torch._grouped_mm` (CUTLASS) on CUDA bfloat16 when the installed torch has it and the sizes
  meet its 16-byte stride rule, with a small Triton kernel for silu(gate) * up between them;
- otherwise our own Triton grouped GEMM, which gathers the token rows itself, computes the gate
  and up halves together and applies the SiLU gate in its epilogue. It runs in Triton's
  interpreter too (CPU tests).
FP8 experts (per-row weight scales) take our grouped GEMM weight-only (the tile widened to the
activations' dtype: half the weight bytes), and from SCALED_GROUPED_MM_MIN_ROWS_PER_EXPERT rows
per expert on Hopper `torch._scaled_grouped_mm`: the activations quantized per row (the tokens before
the gather, the SiLU product in the pass that computes it), FP8 x FP8 on the tensor cores.
The top-k outputs of a token are summed back in token order by a gather kernel that adds the
k terms in a fixed order (deterministic; no atomics). Nothing here syncs with the host.

This module knows nothing about models; the math is `reference.fused_moe`, `reference.topk_softmax`
and `reference.router_topk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.ops import fp8, reference
from mambaserve.ops.activation import _silu_mul_kernel
from mambaserve.ops.common import TL_DTYPES, check, next_power_of_2
from mambaserve.ops.dispatch import fusions_enabled, tl, triton, use_triton
from mambaserve.ops.fp8 import FP8_DTYPE, quantize_fp8, silu_mul_quantize_fp8

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_HAS_SCALED_GROUPED_MM = hasattr(torch, "_scaled_grouped_mm")


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr, expert_offs_ptr, tile_expert_ptr, tile_first_ptr, bs_ptr,
    N, K, num_n_tiles,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bse,
    GATHER: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """C[rows of e] = A[rows of e] @ B[e]^T for the expert e that owns this row tile.

    GATED: B[e] holds 2N rows, gate then up, and C = silu(A Bg^T) * (A Bu^T).
    GATHER: A's row r is a_ptr[a_rows[r]] (tokens gathered into expert order on the fly).
    SCALED: B is FP8 with one float32 scale per row, bs[e, n] (gate rows then up rows): each
    tile is widened to A's dtype (exact) and the scales multiply the float32 sums.
    """
    pid = tl.program_id(0)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:  # the grid is sized for the worst case; spare tiles do nothing
        return
    row0 = tl.load(expert_offs_ptr + e) + (pid_m - tl.load(tile_first_ptr + e)) * BLOCK_M
    row_end = tl.load(expert_offs_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < row_end
    if GATHER:
        a_rows = tl.load(a_rows_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & c_mask[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if SCALED:
            b = b.to(a.dtype)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
        if GATED:
            bu = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & c_mask[None, :], other=0.0)
            if SCALED:
                bu = bu.to(a.dtype)
            if DOT_F32:
                bu = bu.to(tl.float32)
            acc_up = tl.dot(a, bu, acc=acc_up, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if SCALED:
        bs_row = bs_ptr + e.to(tl.int64) * stride_bse + cols
        acc = acc * tl.load(bs_row, mask=c_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(bs_row + N, mask=c_mask, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=r_mask[:, None] & c_mask[None, :])


@triton.jit
def _combine_kernel(y_ptr, inv_ptr, w_ptr, add_ptr, out_ptr, hidden, stride_y, stride_a, stride_o,
                    TOP_K: tl.constexpr, GATHER: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = (add[t] +) sum_k w[t, k] * y[inv[t, k]] (GATHER: rows in expert order) or
    sum_k y[t * TOP_K + k] (rows in pair order, already weighted), added in order in float32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if GATHER:
            row = tl.load(inv_ptr + t * TOP_K + k).to(tl.int64)
            w = tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
            acc += w * tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(y_ptr + (t * TOP_K + k) * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(add_ptr + t * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bucket(ids, live, num_experts):
    """Each live pair's sort bucket: its expert, or num_experts for an id out of range; -1 for a
    lane past the pairs (no bucket)."""
    return tl.where(live, tl.where((ids >= 0) & (ids < num_experts), ids, num_experts), -1)


@triton.jit
def _store_offs_and_tiles(counts, experts, offs_ptr, tile_expert_ptr, tile_first_ptr, num_experts, max_tiles,
                          BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """From each bucket's pair count (E_BLOCK,): the experts' row offsets offs (E + 1,), each
    expert's first row tile and the expert of every tile (-1: a spare tile of the worst-case grid)."""
    e_mask = experts < num_experts
    ends = tl.cumsum(counts, axis=0)
    tl.store(offs_ptr + 1 + experts, ends, mask=e_mask)
    tl.store(offs_ptr + experts, ends - counts, mask=experts == 0)
    tiles = tl.where(e_mask, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    tl.store(tile_first_ptr + experts, tiles_end - tiles, mask=e_mask)
    for t0 in range(0, max_tiles, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        # the expert of tile t: the experts whose tiles end at or before it (-1: a spare tile)
        e_of = tl.sum(((tiles_end[None, :] <= t[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + t, tl.where(e_of < num_experts, e_of, -1), mask=t < max_tiles)


@triton.jit
def _place_pairs(ids_ptr, token_of_ptr, inv_ptr, p0, num_pairs, num_experts, top_k, first_row, experts,
                 BLOCK: tl.constexpr):
    """Pairs p0 .. p0 + BLOCK to their sorted rows: first_row[e] (E_BLOCK,) is the row of the
    block's first pair of bucket e; later pairs of e follow in pair order (a stable sort).
    Returns the block's count per bucket."""
    p = p0 + tl.arange(0, BLOCK)
    live = p < num_pairs
    ids = _bucket(tl.load(ids_ptr + p, mask=live, other=0).to(tl.int32), live, num_experts)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.cumsum(onehot, axis=0) - 1 + first_row[None, :]  # (BLOCK, E): the row of each pair
    row = tl.sum(onehot * rank, axis=1)
    tl.store(inv_ptr + p, row, mask=live)
    tl.store(token_of_ptr + row, p // top_k, mask=live)
    return tl.sum(onehot, axis=0)


@triton.jit
def _bucket_counts(ids_ptr, p0, num_pairs, num_experts, experts, BLOCK: tl.constexpr):
    """Pairs p0 .. p0 + BLOCK: their count per bucket (E_BLOCK,)."""
    p = p0 + tl.arange(0, BLOCK)
    ids = _bucket(tl.load(ids_ptr + p, mask=p < num_pairs, other=0).to(tl.int32), p < num_pairs, num_experts)
    return tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["num_pairs", "max_tiles"])  # per-step counts: one kernel for all
def _route_kernel(ids_ptr, token_of_ptr, inv_ptr, offs_ptr, tile_expert_ptr, tile_first_ptr,
                  num_pairs, num_experts, top_k, max_tiles,
                  BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The whole routing of `_route` in one program: a counting sort of the (token, k) pairs by
    expert (stable: pairs of one expert keep their order) and the row tiles of BLOCK_M rows.
    An id outside [0, num_experts) (a padding row's routing) sorts into bucket num_experts, past
    every expert's rows: no tile reads it and it takes no other pair's row (E_BLOCK > num_experts)."""
    experts = tl.arange(0, E_BLOCK)
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        counts += _bucket_counts(ids_ptr, p0, num_pairs, num_experts, experts, BLOCK)
    _store_offs_and_tiles(counts, experts, offs_ptr, tile_expert_ptr, tile_first_ptr, num_experts, max_tiles,
                          BLOCK, BLOCK_M)
    seen = tl.cumsum(counts, axis=0) - counts  # the next free row of each bucket
    for p0 in range(0, num_pairs, BLOCK):
        seen += _place_pairs(ids_ptr, token_of_ptr, inv_ptr, p0, num_pairs, num_experts, top_k, seen, experts,
                             BLOCK)


@triton.jit(do_not_specialize=["num_pairs"])
def _route_count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """Parallel routing, step 1 of 3: counts[b, e] = the pairs of block b (BLOCK pairs) in bucket e."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    tl.store(counts_ptr + b * E_BLOCK + experts, _bucket_counts(ids_ptr, b * BLOCK, num_pairs, num_experts,
                                                                experts, BLOCK))


@triton.jit(do_not_specialize=["num_blocks", "max_tiles"])
def _route_scan_kernel(counts_ptr, offs_ptr, tile_expert_ptr, tile_first_ptr, num_blocks, num_experts, max_tiles,
                       SCAN: tl.constexpr, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Step 2 of 3, one program: counts[b, e] becomes the pairs of bucket e in the blocks before b
    (an exclusive scan down the blocks, SCAN blocks at a time), and the totals give the offsets
    and the row tiles."""
    experts = tl.arange(0, E_BLOCK)
    rows = tl.arange(0, SCAN)
    carry = tl.zeros([E_BLOCK], dtype=tl.int32)
    for b0 in range(0, num_blocks, SCAN):
        ptrs = counts_ptr + (b0 + rows)[:, None] * E_BLOCK + experts[None, :]
        m = (b0 + rows < num_blocks)[:, None]
        c = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=m)
        carry += tl.sum(c, axis=0)
    _store_offs_and_tiles(carry, experts, offs_ptr, tile_expert_ptr, tile_first_ptr, num_experts, max_tiles,
                          BLOCK, BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _route_place_kernel(ids_ptr, counts_ptr, offs_ptr, token_of_ptr, inv_ptr, num_pairs, num_experts, top_k,
                        BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """Step 3 of 3: block b's pairs to their rows, after bucket e's start and the earlier blocks'
    pairs of e. The bucket of ids out of range starts at offs[num_experts], past every expert."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    start = tl.load(offs_ptr + experts, mask=experts <= num_experts, other=0)
    before = tl.load(counts_ptr + b * E_BLOCK + experts)
    _place_pairs(ids_ptr, token_of_ptr, inv_ptr, b * BLOCK, num_pairs, num_experts, top_k, start + before,
                 experts, BLOCK)


@triton.jit
def _direct_gate_up_kernel(x_ptr, w1_ptr, ids_ptr, part_ptr, s1_ptr, hidden, inter, top_k,
                           stride_x, stride_we, stride_wn, stride_pp, stride_ps, stride_se,
                           BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, SCALED: tl.constexpr):
    """Split-K partial sums of the routed pairs' gate and up rows, one tile per program.

    For routed pair p = t * top_k + k (expert e = ids[p]), feature block s of BLOCK_H columns:
    part[p, s, 0, i] = w1[e, i, s-block] . x[t, s-block] and part[p, s, 1, i] the same for the
    up row inter + i. Every program loads one (BLOCK_I x BLOCK_H) tile of each: a decode step
    has few pairs, and this spreads the expert weights over many programs (memory-bound)."""
    p = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    s = tl.program_id(2)
    i_mask = offs_i < inter
    t = (p // top_k).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_h = s * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    xv = tl.load(x_ptr + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    w_rows = w1_ptr + e * stride_we + offs_i.to(tl.int64)[:, None] * stride_wn + offs_h[None, :]
    m = i_mask[:, None] & h_mask[None, :]
    wg = tl.load(w_rows, mask=m, other=0.0).to(tl.float32)
    wu = tl.load(w_rows + inter * stride_wn, mask=m, other=0.0).to(tl.float32)
    dst = part_ptr + p.to(tl.int64) * stride_pp + s * stride_ps + offs_i
    g = tl.sum(wg * xv[None, :], axis=1)
    u = tl.sum(wu * xv[None, :], axis=1)
    if SCALED:  # FP8 rows: each partial sum times its row's scale (the splits then add scaled sums)
        g = g * tl.load(s1_ptr + e * stride_se + offs_i, mask=i_mask, other=0.0)
        u = u * tl.load(s1_ptr + e * stride_se + inter + offs_i, mask=i_mask, other=0.0)
    tl.store(dst, g, mask=i_mask)
    tl.store(dst + inter, u, mask=i_mask)


@triton.jit
def _direct_down_kernel(part_ptr, w2_ptr, ids_ptr, wts_ptr, y_ptr, s2_ptr, hidden, inter, num_splits,
                        stride_pp, stride_ps, stride_we, stride_wn, stride_yp, stride_se,
                        BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, SCALED: tl.constexpr):
    """y[p, n] = wts[p] * (w2[e, n] . act[p]) for routed pair p, expert e = ids[p], where
    act[p, i] = silu(g) * u with g, u the sums of the gate/up kernel's split partials (in a
    fixed order). One program: one pair, BLOCK_N output features."""
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    e = tl.load(ids_ptr + p).to(tl.int64)
    weight = tl.load(wts_ptr + p).to(tl.float32)
    w_rows = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i0 in range(0, inter, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs_i < inter
        g = tl.zeros([BLOCK_I], dtype=tl.float32)
        u = tl.zeros([BLOCK_I], dtype=tl.float32)
        for s in range(num_splits):
            src = part_ptr + p * stride_pp + s * stride_ps + offs_i
            g += tl.load(src, mask=i_mask, other=0.0)
            u += tl.load(src + inter, mask=i_mask, other=0.0)
        act = g * tl.sigmoid(g) * u
        w = tl.load(w_rows + offs_i[None, :], mask=n_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * act[None, :], axis=1)
    if SCALED:
        acc = acc * tl.load(s2_ptr + e * stride_se + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + p * stride_yp + offs_n, weight * acc, mask=n_mask)


@triton.jit
def _store_topk(row, offs, num_experts, w_ptr, ids_ptr, base,
                TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
                RENORMALIZE: tl.constexpr):
    """Write the TOP_K largest of `row` (float32, -inf past num_experts; the first index among
    equals) with a softmax over them (RENORMALIZE; else their entries of the softmax over the
    whole row), then NUM_SHARED always-on ids num_experts + j of weight 1, at ids_ptr / w_ptr +
    base. NaN entries count as -inf (a padding row of a graphed step); a row with no finite
    entry gets distinct in-range ids and weights 0."""
    row = tl.where(row == row, row, float("-inf"))
    top = tl.max(row, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of no finite logit: weights 0, not NaN
    denom_all = tl.sum(tl.exp(row - top), 0)  # exp(-inf) = 0: the entries past num_experts add nothing
    if BLOCK_E <= 64:
        # all at once: rank_e = number of entries ahead of e (larger, or equal at a lower index)
        ahead = (row[None, :] > row[:, None]) | ((row[None, :] == row[:, None]) & (offs[None, :] < offs[:, None]))
        rank = tl.sum(ahead.to(tl.int32), axis=1)
        chosen = rank < TOP_K
        p = tl.where(chosen, tl.exp(row - top), 0.0)
        denom = denom_all
        if RENORMALIZE:
            denom = tl.sum(p, 0)
        denom = tl.where(denom > 0.0, denom, 1.0)
        tl.store(ids_ptr + base + rank, offs, mask=chosen)
        tl.store(w_ptr + base + rank, (p / denom).to(w_ptr.dtype.element_ty), mask=chosen)
    else:  # wide rows: TOP_K rounds of arg-max (the comparison matrix would not fit)
        taken = offs >= num_experts  # past the experts, and each round's pick: never picked again
        denom = 0.0
        for _ in tl.static_range(TOP_K):
            v = tl.where(taken, float("-inf"), row)
            m = tl.max(v, 0)
            idx = tl.min(tl.where((v == m) & ~taken, offs, BLOCK_E), 0)
            denom += tl.exp(m - top)
            taken = taken | (offs == idx)
        if not RENORMALIZE:
            denom = denom_all
        denom = tl.where(denom > 0.0, denom, 1.0)
        taken = offs >= num_experts
        for k in tl.static_range(TOP_K):
            v = tl.where(taken, float("-inf"), row)
            m = tl.max(v, 0)
            idx = tl.min(tl.where((v == m) & ~taken, offs, BLOCK_E), 0)
            tl.store(ids_ptr + base + k, idx)
            tl.store(w_ptr + base + k, (tl.exp(m - top) / denom).to(w_ptr.dtype.element_ty))
            taken = taken | (offs == idx)
    for j in tl.static_range(NUM_SHARED):
        tl.store(ids_ptr + base + TOP_K + j, num_experts + j)
        tl.store(w_ptr + base + TOP_K + j, tl.full([], 1.0, tl.float32).to(w_ptr.dtype.element_ty))


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, num_experts, stride_l,
                         TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    """One row of logits: its top-k and their softmax (rows of TOP_K + NUM_SHARED outputs)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    row = tl.load(logits_ptr + t * stride_l + offs, mask=offs < num_experts, other=float("-inf")).to(tl.float32)
    _store_topk(row, offs, num_experts, w_ptr, ids_ptr, t * (TOP_K + NUM_SHARED), TOP_K, NUM_SHARED, BLOCK_E,
                RENORMALIZE)


@triton.jit
def _router_logits_kernel(x_ptr, rw_ptr, part_ptr, hidden, num_experts, stride_x, stride_rw,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """part[t, s, e] = rw[e, s-block] . x[t, s-block]: the router's product split over
    experts and features, one (BLOCK_E x BLOCK_H) weight tile per program."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(2)
    offs_h = s * BLOCK_H + tl.arange(0, BLOCK_H)
    e_mask = offs_e < num_experts
    h_mask = offs_h < hidden
    xv = tl.load(x_ptr + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    w = tl.load(rw_ptr + offs_e.to(tl.int64)[:, None] * stride_rw + offs_h[None, :],
                mask=e_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
    dst = part_ptr + (t * tl.num_programs(2) + s) * num_experts + offs_e
    tl.store(dst, tl.sum(w * xv[None, :], axis=1), mask=e_mask)


@triton.jit
def _router_topk_kernel(part_ptr, w_ptr, ids_ptr, num_experts, num_splits,
                        OUT_DTYPE: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                        BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    """A token's router logits (its split partials summed in order, rounded to the activation
    dtype as the matrix product's output would be) and their top-k."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    e_mask = offs < num_experts
    row = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in range(num_splits):
        row += tl.load(part_ptr + (t * num_splits + s) * num_experts + offs, mask=e_mask, other=0.0)
    row = tl.where(e_mask, row.to(OUT_DTYPE).to(tl.float32), float("-inf"))
    _store_topk(row, offs, num_experts, w_ptr, ids_ptr, t * (TOP_K + NUM_SHARED), TOP_K, NUM_SHARED, BLOCK_E,
                RENORMALIZE)


@triton.jit
def _router_fused_kernel(x_ptr, rw_ptr, part_ptr, count_ptr, w_ptr, ids_ptr, hidden, num_experts, stride_x,
                         stride_rw, OUT_DTYPE: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E_ALL: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    """`_router_logits_kernel` and `_router_topk_kernel` in one launch: each program stores its
    partial product, then counts itself done on its token's counter; the token's last program
    (the one that reads the count programs - 1) sums the partials in order, takes the top-k
    and sets the counter back to 0 for the next call (no memset, graph-safe)."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(2)
    splits = tl.num_programs(2)
    offs_h = s * BLOCK_H + tl.arange(0, BLOCK_H)
    e_mask = offs_e < num_experts
    h_mask = offs_h < hidden
    xv = tl.load(x_ptr + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    w = tl.load(rw_ptr + offs_e.to(tl.int64)[:, None] * stride_rw + offs_h[None, :],
                mask=e_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
    tl.store(part_ptr + (t * splits + s) * num_experts + offs_e, tl.sum(w * xv[None, :], axis=1), mask=e_mask)
    tl.debug_barrier()  # every thread's partial is stored before the program counts itself done
    # acq_rel: the stores above are released with the count, and the last program acquires all of them
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(1) * splits - 1:
        tl.debug_barrier()
        offs = tl.arange(0, BLOCK_E_ALL)
        all_mask = offs < num_experts
        row = tl.zeros([BLOCK_E_ALL], dtype=tl.float32)
        for j in range(splits):  # in order, as `_router_topk_kernel` sums them: the same logits
            row += tl.load(part_ptr + (t * splits + j) * num_experts + offs, mask=all_mask, other=0.0,
                           cache_modifier=".cg")  # from L2: other programs wrote them
        row = tl.where(all_mask, row.to(OUT_DTYPE).to(tl.float32), float("-inf"))
        _store_topk(row, offs, num_experts, w_ptr, ids_ptr, t * (TOP_K + NUM_SHARED), TOP_K, NUM_SHARED,
                    BLOCK_E_ALL, RENORMALIZE)
        tl.store(count_ptr + t, 0)


# Up to this many tokens the router runs as small kernels of our own (split product, top-k): one launch, or two
# under `unfused()` (or while its counters are not yet allocated and a graph is being captured).
ROUTER_FUSED_MAX_TOKENS = 16
TOPK_MAX_EXPERTS = 1024  # widest row the top-k kernel takes (registers); wider rows: the reference


def _check_routing(num_experts: int, top_k: int, num_shared: int) -> None:
    check(1 <= top_k <= num_experts, lambda: f"top_k must be in [1, {num_experts}], got {top_k}")
    check(num_shared >= 0, lambda: f"num_shared must be >= 0, got {num_shared}")


def topk_softmax(logits: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None, num_shared: int = 0,
                 renormalize: bool = True):
    """Top-k expert routing (the MoE families): the top_k largest logits of each row and a
    softmax over them (renormalize=False: the softmax over all experts, of which the top_k
    entries are kept as they are, summing to less than 1: Jamba's router).

    logits: (num_tokens, num_experts), any float dtype (compared in float32). Returns
    (weights (num_tokens, top_k + num_shared) in out_dtype (default logits.dtype), ids
    (num_tokens, top_k + num_shared) integer): the routed experts largest first, then
    num_shared always-on experts num_experts + j with weight 1 (a shared expert stored as
    extra experts of the fused MoE). The Triton path takes rows of at most TOPK_MAX_EXPERTS
    (one program per token; NaN logits count as -inf). Math: Shazeer et al. 2017, top-k
    gating; `reference.topk_softmax`. Raises ValueError when top_k is not in [1, num_experts]
    or num_shared < 0.
    """
    check(logits.dim() == 2, lambda: f"logits must be (num_tokens, num_experts), got {tuple(logits.shape)}")
    _check_routing(logits.shape[1], top_k, num_shared)
    out_dtype = out_dtype or logits.dtype
    if not (use_triton(logits) and logits.shape[1] <= TOPK_MAX_EXPERTS):
        return reference.topk_softmax(logits, top_k, out_dtype, num_shared, renormalize)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k + num_shared, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int32, device=logits.device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        _topk_softmax_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0),
                                            TOP_K=int(top_k), NUM_SHARED=int(num_shared), BLOCK_E=block_e,
                                            RENORMALIZE=bool(renormalize), num_warps=2 if block_e <= 64 else 4)
    return weights, ids


def router_topk(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None,
                num_shared: int = 0, renormalize: bool = True):
    """Top-k softmax routing from the hidden states: `topk_softmax` of the router's logits
    x @ router_weight^T (rounded to x's dtype, as the checkpoints' Linear computes them).

    x: (num_tokens, hidden); router_weight: (num_experts, hidden). Returns (weights, ids), each
    (num_tokens, top_k + num_shared), as `topk_softmax`. On the Triton path (router_weight in
    x's dtype) a step of at most ROUTER_FUSED_MAX_TOKENS tokens runs the product split over
    many programs, the last of each token's programs taking its top-k: one launch (two under
    `ops.unfused()`, the same numbers), where cuBLAS takes two for the product alone; more
    tokens: cuBLAS, then `topk_softmax`. Math: `reference.router_topk`. Raises
    ValueError on bad shapes, top_k not in [1, num_experts] or num_shared < 0.
    """
    check(x.dim() == 2 and router_weight.dim() == 2 and router_weight.shape[1] == x.shape[1],
          lambda: f"x must be (num_tokens, hidden) and router_weight (num_experts, {x.shape[-1]})")
    _check_routing(router_weight.shape[0], top_k, num_shared)
    out_dtype = out_dtype or x.dtype
    if not (use_triton(x) and router_weight.dtype == x.dtype):
        return reference.router_topk(x, router_weight, top_k, out_dtype, num_shared, renormalize)
    x = x if x.stride(1) == 1 else x.contiguous()
    router_weight = router_weight.contiguous()
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    block_e = next_power_of_2(num_experts)
    if num_tokens > ROUTER_FUSED_MAX_TOKENS or block_e > TOPK_MAX_EXPERTS:
        return topk_softmax(torch.nn.functional.linear(x, router_weight), top_k, out_dtype, num_shared, renormalize)
    weights = torch.empty(num_tokens, top_k + num_shared, dtype=out_dtype, device=x.device)
    ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int32, device=x.device)
    if num_tokens:
        on_gpu = x.is_cuda
        be, bh = (16, 512) if on_gpu else (8, 32)
        splits = triton.cdiv(hidden, bh)
        part = torch.empty(num_tokens, splits, num_experts, dtype=torch.float32, device=x.device)
        grid = (num_tokens, triton.cdiv(num_experts, be), splits)
        counts = _router_counters(x.device) if fusions_enabled() else None
        if counts is not None:
            _router_fused_kernel[grid](
                x, router_weight, part, counts, weights, ids, hidden, num_experts, x.stride(0),
                router_weight.stride(0), OUT_DTYPE=TL_DTYPES[x.dtype], TOP_K=int(top_k), NUM_SHARED=int(num_shared),
                BLOCK_E=be, BLOCK_H=bh, BLOCK_E_ALL=block_e, RENORMALIZE=bool(renormalize),
                num_warps=2 if block_e <= 64 else 4)
            return weights, ids
        _router_logits_kernel[grid](
            x, router_weight, part, hidden, num_experts, x.stride(0), router_weight.stride(0), BLOCK_E=be, BLOCK_H=bh)
        _router_topk_kernel[(num_tokens,)](
            part, weights, ids, num_experts, splits, OUT_DTYPE=TL_DTYPES[x.dtype], TOP_K=int(top_k),
            NUM_SHARED=int(num_shared), BLOCK_E=block_e, RENORMALIZE=bool(renormalize),
            num_warps=2 if block_e <= 64 else 4)
    return weights, ids


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _router_counters(device: torch.device) -> torch.Tensor | None:
    """The fused router's per-token counters on `device` (int32 zeros, ROUTER_FUSED_MAX_TOKENS of
    them), allocated once and left at zero by every launch. One set per device: calls on a device
    run one after another on its stream (every layer's router, every graph replay). None while a
    CUDA graph is being captured before they exist (an allocation there would belong to the graph's
    pool): that capture takes the two-launch path."""
    counts = _COUNTERS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTERS[device] = torch.zeros(ROUTER_FUSED_MAX_TOKENS, dtype=torch.int32, device=device)
    return counts


# Up to this many routed (token, expert) pairs, the direct kernels beat sorting and grouping:
# each pair reads its expert's weights once, and there are no routing launches.
DIRECT_MAX_PAIRS = 32
# torch._grouped_mm only from this many routed rows per expert on average: below it our grouped
# GEMM is faster on an H200 (granite-4.0-h-small: 213 vs 274 us at 4 tokens, 463 vs 519 at 256;
# at 1,024 tokens, 142 rows per expert, 798 vs 688)
GROUPED_MM_MIN_ROWS_PER_EXPERT = 64
# Up to this many routed pairs the routing is one Triton program (`_route_kernel`, one SM, two
# passes over the pairs: serial); beyond, three kernels over blocks of pairs (9 us flat up to 6,144
# pairs, 72 us at 189,000). H200, granite-4.0-tiny (62 experts, top 6), in CUDA graphs
# (kernels/moe-routing-one-program-vs-three-kernels.json): 6.0 vs 8.8 us at 96 pairs, 11.2 vs 8.7
# at 384. torch's sort and scans, before: 38-108 us (kernels/moe-routing-kernel-vs-torch.json)
ROUTE_KERNEL_MAX_PAIRS = 256
# FP8 experts take torch._scaled_grouped_mm from this many routed rows per expert, below it our
# weight-only grouped GEMM (half the weight bytes, no activation quantization). H200, granite-4.0-tiny,
# in CUDA graphs (benchmarks/results/h200/fp8/moe-paths-granite-4.0-tiny.json): 161 vs 172 us at
# 256 tokens (25 rows per expert), 202 vs 184 at 512 (50 rows), 368 vs 288 at 2,048
SCALED_GROUPED_MM_MIN_ROWS_PER_EXPERT = 32


def _direct_config(on_gpu: bool) -> tuple[int, int, int, int]:
    """(gate/up BLOCK_I, BLOCK_H, down BLOCK_N, BLOCK_I) of the direct kernels: on the GPU
    tiles of 16 x 256 weights (8 KiB) per load, so that a decode step's few routed pairs still
    spread over many programs; small tiles for the interpreter."""
    return (16, 256, 16, 256) if on_gpu else (8, 32, 8, 32)


def _direct_moe(x, w1, w2, topk_weights, topk_ids, out, add, as_partials=False, w1_scale=None, w2_scale=None):
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    num_pairs = num_tokens * top_k
    ids = topk_ids.contiguous()
    bi, bh, bn, bi2 = _direct_config(x.is_cuda)
    splits = triton.cdiv(hidden, bh)
    part = torch.empty(num_pairs, splits, 2, inter, dtype=torch.float32, device=x.device)
    scaled = w1_scale is not None
    _direct_gate_up_kernel[(num_pairs, triton.cdiv(inter, bi), splits)](
        x, w1, ids, part, w1_scale if scaled else part, hidden, inter, top_k, x.stride(0), w1.stride(0), w1.stride(1),
        part.stride(0), part.stride(1), w1_scale.stride(0) if scaled else 0, BLOCK_I=bi, BLOCK_H=bh, SCALED=scaled)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _direct_down_kernel[(num_pairs, triton.cdiv(hidden, bn))](
        part, w2, ids, topk_weights.contiguous(), y, w2_scale if scaled else y, hidden, inter, splits,
        part.stride(0), part.stride(1), w2.stride(0), w2.stride(1), y.stride(0), w2_scale.stride(0) if scaled else 0,
        BLOCK_N=bn, BLOCK_I=bi2, SCALED=scaled)
    if as_partials:  # (top_k, num_tokens, hidden): the consumer adds the weighted pairs
        return y.view(num_tokens, top_k, hidden).transpose(0, 1)
    block = min(1024, next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, ids, y, add if add is not None else out, out, hidden, y.stride(0),
        add.stride(0) if add is not None else 0, out.stride(0), TOP_K=top_k, GATHER=False,
        HAS_ADD=add is not None, BLOCK=block)
    return out


@dataclass(frozen=True)
class _Routing:
    """The (token, k) pairs sorted by expert, and the row tiles of block_m rows over them.
    token_of (M,) int32: source token of each sorted row; inv (M,) int32: sorted row of
    each pair, in (token, k) order; offs (E + 1,) int32: expert e owns sorted rows
    offs[e]:offs[e + 1]; tile_expert (max_tiles,) int32: the expert of each row tile (-1 =
    spare: the grid is sized for the worst case); tile_first (E,) int32: each expert's first
    tile. Tiles never straddle two experts."""

    token_of: torch.Tensor
    inv: torch.Tensor
    offs: torch.Tensor
    tile_expert: torch.Tensor
    tile_first: torch.Tensor
    max_tiles: int
    block_m: int


def _route(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> _Routing:
    """Sort the (token, k) pairs by expert and tile them, on the device (Triton; no host sync):
    up to ROUTE_KERNEL_MAX_PAIRS pairs one `_route_kernel` program, beyond three kernels over
    blocks of pairs (count, scan, place). torch's sort, searches and scans took some twenty
    launches."""
    num_rows = topk_ids.numel()
    # sum_e ceil(c_e / BM) <= M / BM + (number of non-empty experts)
    max_tiles = -(-num_rows // block_m) + min(num_experts, num_rows)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    token_of = torch.empty(num_rows, dtype=torch.int32, device=dev)
    inv = torch.empty(num_rows, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    tile_first = torch.empty(num_experts, dtype=torch.int32, device=dev)
    e_block = next_power_of_2(num_experts + 1)  # one bucket past the experts: ids out of range
    block = max(16, min(128, 8192 // e_block))  # a (pairs x buckets) one-hot tile of at most 8,192
    top_k = topk_ids.shape[1]
    if num_rows <= ROUTE_KERNEL_MAX_PAIRS:
        _route_kernel[(1,)](ids, token_of, inv, offs, tile_expert, tile_first, num_rows, num_experts, top_k,
                            max_tiles, BLOCK=block, E_BLOCK=e_block, BLOCK_M=block_m)
    else:
        num_blocks = triton.cdiv(num_rows, block)
        counts = torch.empty(num_blocks, e_block, dtype=torch.int32, device=dev)
        _route_count_kernel[(num_blocks,)](ids, counts, num_rows, num_experts, BLOCK=block, E_BLOCK=e_block)
        _route_scan_kernel[(1,)](counts, offs, tile_expert, tile_first, num_blocks, num_experts, max_tiles,
                                 SCAN=max(1, 4096 // e_block), BLOCK=block, E_BLOCK=e_block, BLOCK_M=block_m)
        _route_place_kernel[(num_blocks,)](ids, counts, offs, token_of, inv, num_rows, num_experts, top_k,
                                           BLOCK=block, E_BLOCK=e_block)
    return _Routing(token_of, inv, offs, tile_expert, tile_first, max_tiles, block_m)


def grouped_gemm_config(avg_rows: float, gated: bool, on_gpu: bool,
                        elem_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of `_grouped_gemm` for avg_rows
    routed rows per expert: row tiles no taller than an expert's rows, so that few rows are
    masked off while every weight tile is still read once per row tile. elem_bytes: bytes of an
    operand element (float32's 4 take shallower pipelines: the deep ones overflow shared memory)."""
    if not on_gpu:
        return 16, 32, 32, 4, 1
    # H200 sweep (benchmarks/results/h200/kernels/moe-grouped-gemm-sweep.json, granite-4.0-tiny
    # and granite-4.0-h-small shapes, 1-4,096 tokens): short row tiles stream longer K steps
    block_m = 16 if avg_rows <= 16 else 32 if avg_rows <= 32 else 64 if avg_rows <= 64 else 128
    if elem_bytes > 2:  # float32 tiles: the 16-bit configs' pipelines do not fit shared memory
        return block_m, 64 if gated else 128, 64, 8 if block_m >= 64 else 4, 3
    if gated:
        return (block_m, 64, 128, 4, 4) if block_m <= 64 else (128, 64, 64, 8, 3)
    if block_m <= 32:
        return block_m, 128, 128, 4, 3
    return (64, 128, 64, 8, 3) if block_m == 64 else (128, 128, 64, 4, 3)


def _grouped_gemm(a, a_rows, b, routing: _Routing, gated, out_dtype, b_scale=None):
    """Triton grouped GEMM: (M, N) = A[rows] @ B[e]^T by the expert slices and row tiles of
    `routing` (M sorted rows).

    a: (*, K), stride 1 on K; a_rows: (M,) int32 rows of a in expert order, or None when
    a is already in that order; b: (E, N or 2N when gated, K), stride 1 on K; b_scale: (E, N or
    2N) float32, stride 1, for an FP8 b.
    """
    K = a.shape[1]
    N = b.shape[1] // 2 if gated else b.shape[1]
    num_rows = routing.token_of.shape[0]
    out = torch.empty(num_rows, N, dtype=out_dtype, device=a.device)
    on_gpu = a.is_cuda
    _, block_n, block_k, num_warps, num_stages = grouped_gemm_config(num_rows / max(1, b.shape[0]), gated, on_gpu,
                                                                     a.element_size())
    offs, block_m, max_tiles = routing.offs, routing.block_m, routing.max_tiles
    tile_expert, tile_first = routing.tile_expert, routing.tile_first
    num_n_tiles = triton.cdiv(N, block_n)
    _grouped_gemm_kernel[(max_tiles * num_n_tiles,)](
        a, a_rows if a_rows is not None else offs, b, out, offs, tile_expert, tile_first,
        b_scale if b_scale is not None else out, N, K, num_n_tiles,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        b_scale.stride(0) if b_scale is not None else 0,
        GATHER=a_rows is not None, GATED=gated, SCALED=b_scale is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bfloat16 tiles as raw uint16 (triton 3.9).
        DOT_F32=not on_gpu,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA bf16 and 16-byte (8-element) aligned strides and pointers."""
    return (
        _HAS_GROUPED_MM and x.is_cuda and x.dtype == torch.bfloat16
        and w1.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16
        and x.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0
        and w1.is_contiguous() and w2.is_contiguous()
        and w1.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
    )


def _scaled_grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._scaled_grouped_mm: Hopper or later, bf16 activations, FP8 weights whose K and N are
    multiples of 16 (its 16-byte stride rule for one-byte elements), contiguous and aligned."""
    return (
        _HAS_SCALED_GROUPED_MM and x.is_cuda and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and w1.dtype == w2.dtype == FP8_DTYPE and x.shape[1] % 16 == 0 and w2.shape[2] % 16 == 0
        and w1.is_contiguous() and w2.is_contiguous()
        and w1.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
    )


def _scaled_grouped_moe(x, w1, w2, w1_scale, w2_scale, routing: _Routing):
    """Both expert layers as FP8 x FP8 `torch._scaled_grouped_mm`s with row-wise scales: x
    (T, hidden) bf16 quantized per token, gathered into expert order (one byte per element), the
    SiLU product quantized per row in the pass that computes it. Returns y (M, hidden) bf16 in
    sorted-row order. Math: out = (x_q s_x)(W_q s_w)^T, as `fp8.reference_scaled_mm`."""
    offs_end = routing.offs[1:].to(torch.int32)  # cumulative group ends, as the grouped mm takes them
    xq, xs = quantize_fp8(x)  # (T, hidden) fp8, (T, 1) float32
    rows = routing.token_of
    xq = xq.view(torch.uint8).index_select(0, rows).view(FP8_DTYPE)  # (M, hidden)
    xs = xs.reshape(-1).index_select(0, rows)  # (M,)
    h = torch._scaled_grouped_mm(xq, w1.transpose(1, 2), xs, w1_scale, offs=offs_end, out_dtype=torch.bfloat16,
                                 use_fast_accum=fp8.FP8_FAST_ACCUM)  # (M, 2 * inter)
    aq, a_s = silu_mul_quantize_fp8(h)  # (M, inter) fp8, (M,)
    return torch._scaled_grouped_mm(aq, w2.transpose(1, 2), a_s, w2_scale, offs=offs_end, out_dtype=torch.bfloat16,
                                    use_fast_accum=fp8.FP8_FAST_ACCUM)  # (M, hidden)


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    add: torch.Tensor | None = None,
    as_partials: bool = False,
    *,
    impl: str | None = None,
    out: torch.Tensor | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU-gated mixture of experts over top-k routed tokens (the MoE families' expert layers).

    hidden_states: (num_tokens, hidden); w1: (num_experts, 2 * inter, hidden), gate rows then
    up rows; w2: (num_experts, hidden, inter); topk_weights: (num_tokens, top_k) float;
    topk_ids: (num_tokens, top_k) int, values in [0, num_experts) (not checked: that would
    sync the host). add: optional (num_tokens, hidden) tensor added in float32 before the one
    rounding (a shared expert's output: no separate add kernel). as_partials: return
    (num_parts, num_tokens, hidden) terms whose sum is the result, for `fused_add_rms_norm`
    to add (the direct path's weighted pairs in float32, no combine launch; other paths and
    the reference return the result as one part). out: optional preallocated (num_tokens,
    hidden) result in hidden_states' dtype, stride 1 along hidden.
    w1_scale (num_experts, 2 * inter), w2_scale (num_experts, hidden): float32 per-row scales
    of FP8 (float8_e4m3fn) w1, w2 (both or neither): the experts' weights are w * scale
    (weight-only FP8 on the direct and Triton paths: the activations stay in hidden_states'
    dtype, each weight tile is widened exactly and the scales multiply the float32 sums;
    "scaled_grouped_mm" quantizes the activations per row too, see the module docstring).
    The Triton path takes float32/float16/bfloat16 with w1, w2 in hidden_states' dtype and add
    with stride 1 along hidden; impl forces its way (tests, benchmarks): "direct" (per routed
    pair, chosen for at most DIRECT_MAX_PAIRS pairs), "grouped_mm" (torch._grouped_mm, CUDA
    bfloat16, chosen where usable from GROUPED_MM_MIN_ROWS_PER_EXPERT routed rows per expert
    on average), "scaled_grouped_mm" (its FP8 twin for FP8 experts, CUDA Hopper bfloat16, from
    the same rows per expert) or "triton" (our grouped GEMM); None chooses.
    Returns (num_tokens, hidden) in hidden_states' dtype (or the partials, see as_partials).
    Math: out[t] = sum_k w[t, k] * w2[e] (silu(g) * u), [g; u] = w1[e] x_t, e = ids[t, k]
    (Shazeer et al. 2017 top-k routing, GLU variants: Shazeer 2020); `reference.fused_moe`.
    Raises ValueError on inconsistent shapes, non-integer topk_ids, an unknown impl, and on the
    Triton path on dtypes or strides it does not take or an impl that cannot run here.
    """
    check(hidden_states.dim() == 2, "hidden_states must be (num_tokens, hidden)")
    check(w1.dim() == 3 and w2.dim() == 3, "w1 and w2 must be (num_experts, ., .)")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w1.shape
    inter = two_inter // 2
    check(w1.shape[2] == hidden and two_inter % 2 == 0 and w2.shape == (num_experts, hidden, inter),
          lambda: f"w1 must be (E, 2 * inter, {hidden}) and w2 (E, {hidden}, inter), got {tuple(w1.shape)}, "
                  f"{tuple(w2.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens,
          lambda: f"topk_ids and topk_weights must be ({num_tokens}, top_k)")
    check(not topk_ids.dtype.is_floating_point and topk_ids.dtype != torch.bool,
          lambda: f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    check(add is None or add.shape == hidden_states.shape, lambda: f"add must be ({num_tokens}, {hidden})")
    check(out is None or (out.shape == hidden_states.shape and out.dtype == hidden_states.dtype and out.stride(1) == 1),
          lambda: f"out must be ({num_tokens}, {hidden}) {hidden_states.dtype} with stride 1 along hidden")
    check(impl in (None, "direct", "grouped_mm", "scaled_grouped_mm", "triton"),
          lambda: f"impl must be None, 'direct', 'grouped_mm', 'scaled_grouped_mm' or 'triton', got {impl!r}")
    scaled = w1_scale is not None
    check(scaled == (w2_scale is not None), "w1_scale and w2_scale come together")
    check(not scaled or (w1.dtype == w2.dtype == torch.float8_e4m3fn
                         and w1_scale.shape == (num_experts, two_inter) and w2_scale.shape == (num_experts, hidden)
                         and w1_scale.dtype == w2_scale.dtype == torch.float32),
          lambda: f"FP8 experts: w1, w2 float8_e4m3fn with float32 w1_scale ({num_experts}, {two_inter}) and "
                  f"w2_scale ({num_experts}, {hidden})")
    if not use_triton(hidden_states):
        check(impl is None, lambda: f"impl={impl!r} picks a Triton path; the reference backend has one")
        if scaled:  # the reference multiplies the dequantized weights (float32, as it computes)
            w1, w2 = w1.float() * w1_scale[..., None], w2.float() * w2_scale[..., None]
        result = reference.fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, add)
        result = result if out is None else out.copy_(result)
        return result[None] if as_partials else result
    check(scaled or (w1.dtype == hidden_states.dtype and w2.dtype == hidden_states.dtype),
          lambda: f"w1, w2 must have hidden_states' dtype {hidden_states.dtype}, got {w1.dtype}, {w2.dtype}")
    check(impl != "grouped_mm" or (not scaled and _grouped_mm_usable(hidden_states, w1, w2)),
          "torch._grouped_mm is not usable here (needs CUDA bf16, sizes multiple of 8)")
    check(impl != "scaled_grouped_mm" or (scaled and _scaled_grouped_mm_usable(hidden_states, w1, w2)),
          "torch._scaled_grouped_mm is not usable here (needs FP8 experts, CUDA Hopper, bf16, sizes multiple of 16)")
    check(add is None or add.stride(1) == 1, "add must have stride 1 along hidden")
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    if num_tokens == 0 or top_k == 0:
        out = out.copy_(add) if add is not None else out.zero_()
        return out[None] if as_partials else out
    if impl is None:
        if num_tokens * top_k <= DIRECT_MAX_PAIRS:
            impl = "direct"
        elif num_tokens * top_k > GROUPED_MM_MIN_ROWS_PER_EXPERT * num_experts and not scaled \
                and _grouped_mm_usable(hidden_states, w1, w2):
            impl = "grouped_mm"
        elif num_tokens * top_k > SCALED_GROUPED_MM_MIN_ROWS_PER_EXPERT * num_experts and scaled \
                and _scaled_grouped_mm_usable(hidden_states, w1, w2):
            impl = "scaled_grouped_mm"
        else:
            impl = "triton"

    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    w1 = w1 if w1.stride(2) == 1 else w1.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    if scaled:
        w1_scale, w2_scale = w1_scale.contiguous(), w2_scale.contiguous()
    if impl == "direct":
        res = _direct_moe(x, w1, w2, topk_weights, topk_ids, out, add, as_partials and add is None, w1_scale, w2_scale)
        return res[None] if as_partials and res.dim() == 2 else res
    num_rows = num_tokens * top_k
    # one row-tile height for both GEMMs (their configs share it): one routing for the layer
    block_m = grouped_gemm_config(num_rows / num_experts, True, x.is_cuda, x.element_size())[0]
    routing = _route(topk_ids, num_experts, block_m)
    if impl == "grouped_mm":
        offs_end = routing.offs[1:].to(torch.int32)  # cumulative group ends, as _grouped_mm takes them
        x_sorted = x.index_select(0, routing.token_of)  # (M, hidden)
        h = torch._grouped_mm(x_sorted, w1.transpose(1, 2), offs=offs_end)  # (M, 2 * inter)
        act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
        block = min(1024, next_power_of_2(inter))
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](h, act, inter, h.stride(0), act.stride(0), BLOCK=block)
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs_end)  # (M, hidden)
    elif impl == "scaled_grouped_mm":
        y = _scaled_grouped_moe(x, w1, w2, w1_scale, w2_scale, routing)
    else:
        act = _grouped_gemm(x, routing.token_of, w1, routing, True, x.dtype, w1_scale)  # (M, inter)
        y = _grouped_gemm(act, None, w2, routing, False, x.dtype, w2_scale)  # (M, hidden)

    weights = topk_weights.contiguous()
    block = min(1024, next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, routing.inv, weights, add if add is not None else out, out, hidden, y.stride(0),
        add.stride(0) if add is not None else 0, out.stride(0), TOP_K=top_k, GATHER=True, HAS_ADD=add is not None,
        BLOCK=block)
    return out[None] if as_partials else out
