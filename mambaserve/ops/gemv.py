"""Split-K matrix-vector products for decode-sized batches, left as partial sums: op
`linear_partials`, its Triton kernel and launcher.

At a decode step a projection multiplies a handful of rows by a large weight: the time is the
weight read, and cuBLAS spends two launches on it (a split-K product and its reduction). Here
one launch spreads the weight over many programs, each multiplying one (BLOCK_N x BLOCK_K) tile
by every row, and leaves the split partial sums (num_splits, num_tokens, N) in float32. The
reduction is folded into the consumer: `ops.fused_add_rms_norm` takes such partials as its
input, so the residual add, the sum of the splits and the next norm are one kernel.

`gated_norm_linear_partials` is the same product with a Mamba2 gated RMSNorm applied to x in
its prologue: the norm's sums of squares come from the state update that produced x
(`ssd_state_update(..., norm_sq=True)`), so the norm costs no launch of its own.

Math: `reference.linear_partials` and `reference.rms_norm_gated`. This module knows nothing
about models.
"""

from __future__ import annotations

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, check_positive_int, next_power_of_2
from mambaserve.ops.dispatch import fusions_enabled, tl, triton, use_triton
from mambaserve.ops.layernorm_gated import rms_norm_gated

MAX_TOKENS = 16  # more rows than this: a tensor-core matrix product is the better tool


@triton.jit(do_not_specialize=["num_tokens"])  # a per-step count: one kernel for all
def _linear_partials_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, num_tokens, N, K, stride_x, stride_w, stride_os,
                            stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    """out[s, t, n] = w[n, s-block] . x[t, s-block] for every row t, one weight tile per program
    (SCALED: an FP8 w, each sum times its row's scale ws[n])."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    offs_k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if SCALED:
        w = w * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    for t in range(num_tokens):
        xv = tl.load(x_ptr + t * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + s * stride_os + t * stride_ot + offs_n, tl.sum(w * xv[None, :], axis=1), mask=n_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _gated_norm_linear_partials_kernel(
    y_ptr, z_ptr, sq_ptr, nw_ptr, w_ptr, out_ptr, num_tokens, N, K, group_size, sq_per_group, eps,
    stride_y, stride_z, stride_sq, stride_w, stride_os, stride_ot,
    NORM_BEFORE_GATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SQ: tl.constexpr,
):
    """`_linear_partials_kernel` whose x is rms_norm_gated(y, z) computed in the prologue, as the
    norm kernel computes it (same order of operations, rounded to y's dtype). BLOCK_K divides
    group_size: a program's K-block lies in one group g, whose sum of squares is the sum of the
    sq_per_group parts sq[t, g * sq_per_group:]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    offs_k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    g = (s * BLOCK_K) // group_size
    offs_q = tl.arange(0, BLOCK_SQ)
    q_mask = offs_q < sq_per_group
    for t in range(num_tokens):
        ss = tl.sum(tl.load(sq_ptr + t * stride_sq + g * sq_per_group + offs_q, mask=q_mask, other=0.0), axis=0)
        rstd = 1.0 / tl.sqrt(ss / group_size + eps)
        v = tl.load(y_ptr + t * stride_y + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        zv = tl.load(z_ptr + t * stride_z + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM_BEFORE_GATE:
            xv = v * rstd * nw
            xv = xv * zv * tl.sigmoid(zv)
        else:
            v = v * zv * tl.sigmoid(zv)
            xv = v * rstd * nw
        xv = xv.to(y_ptr.dtype.element_ty).to(tl.float32)  # the norm's output, as stored for out_proj
        tl.store(out_ptr + s * stride_os + t * stride_ot + offs_n, tl.sum(w * xv[None, :], axis=1), mask=n_mask)


def gemv_max_tokens() -> int:
    """Most rows `linear_partials` takes on the Triton path (decode-sized batches)."""
    return MAX_TOKENS


def linear_partials(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T left as split-K partial sums, for decode-sized batches whose consumer is
    `fused_add_rms_norm` (which adds the splits): one launch where cuBLAS takes two (every
    family's out_proj at decode).

    x: (num_tokens, K); weight: (N, K), or float8_e4m3fn with weight_scale (N,) float32 (one
    scale per row: the FP8 layers' out_proj at decode, weight-only: x is not quantized).
    Returns (num_splits, num_tokens, N) float32 (float64 for float64 input on the reference)
    whose sum over the first axis is the product. The Triton path takes at most MAX_TOKENS
    rows and weight in x's dtype (or FP8); other calls run the reference (num_splits 1).
    Math: `reference.linear_partials`. Raises ValueError on bad shapes.
    """
    check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1],
          lambda: f"x must be (num_tokens, K) and weight (N, {x.shape[-1]}), got {tuple(x.shape)}, "
                  f"{tuple(weight.shape)}")
    scaled = weight_scale is not None
    check(not scaled or (weight.dtype == torch.float8_e4m3fn and weight_scale.shape == (weight.shape[0],)),
          lambda: f"an FP8 weight takes weight_scale ({weight.shape[0]},), got {weight.dtype}, "
                  f"{None if weight_scale is None else tuple(weight_scale.shape)}")
    if not (use_triton(x) and (weight.dtype == x.dtype or scaled) and x.shape[0] <= MAX_TOKENS):
        if scaled:  # the reference multiplies the dequantized weight
            weight = weight.float() * weight_scale.float()[:, None]
        return reference.linear_partials(x, weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    num_tokens, K = x.shape
    N = weight.shape[0]
    on_gpu = x.is_cuda
    block_n, block_k = (16, 512) if on_gpu else (8, 32)
    splits = triton.cdiv(K, block_k)
    out = torch.empty(splits, num_tokens, N, dtype=torch.float32, device=x.device)
    if num_tokens and N:
        _linear_partials_kernel[(triton.cdiv(N, block_n), splits)](
            x, weight, out, weight_scale.float().contiguous() if scaled else out, num_tokens, N, K, x.stride(0),
            weight.stride(0), out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scaled,
            num_warps=4)
    return out


def _norm_block_k(group_size: int, cap: int) -> int:
    """The largest power of two <= cap dividing group_size: a K-block inside one norm group."""
    return min(cap, group_size & -group_size)


def gated_norm_linear_partials(
    y: torch.Tensor,
    z: torch.Tensor,
    sq: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight: torch.Tensor,
) -> torch.Tensor:
    """`linear_partials(rms_norm_gated(y, norm_weight, z, eps, group_size, norm_before_gate),
    weight)` in one launch: the Mamba2 gated norm in the prologue of out_proj's split-K product
    (a decode step's mixer: state update -> this -> the residual add and next norm).

    y, z: (num_tokens, K) (z any row stride); norm_weight: (K,); weight: (N, K); group_size a
    positive int dividing K; sq: (num_tokens, nheads, parts) float32, the sums of squares of
    the gated y that `ssd_state_update(..., norm_sq=True, norm_gate=z or None)` returns beside
    y, nheads a multiple of K // group_size (the heads of group g are g * nheads / groups
    onwards). Returns (num_splits, num_tokens, N) float32 partial sums, as `linear_partials`.
    The one-launch path: Triton, at most MAX_TOKENS rows, weight in y's dtype, a power-of-two
    block of at least 8 features dividing group_size, fusions on (`ops.unfused()`); otherwise
    (the reference included) the two ops themselves, which recompute the sums from y.
    Math: `reference.rms_norm_gated`, `reference.linear_partials`. Raises ValueError on bad shapes.
    """
    check(y.dim() == 2 and z.shape == y.shape, lambda: f"y and z must be (num_tokens, K), got {tuple(y.shape)}, "
                                                       f"{tuple(z.shape)}")
    T, K = y.shape
    group_size = check_positive_int(group_size, "group_size")
    check(K % group_size == 0, lambda: f"K ({K}) must be a multiple of group_size ({group_size})")
    check(norm_weight.shape == (K,), lambda: f"norm_weight must be ({K},), got {tuple(norm_weight.shape)}")
    check(weight.dim() == 2 and weight.shape[1] == K, lambda: f"weight must be (N, {K}), got {tuple(weight.shape)}")
    groups = K // group_size
    check(sq.dim() == 3 and sq.shape[0] == T and sq.shape[1] % groups == 0,
          lambda: f"sq must be ({T}, nheads, parts) with nheads a multiple of {groups}, got {tuple(sq.shape)}")
    block_k = _norm_block_k(group_size, 512 if y.is_cuda else 32)
    fused = (use_triton(y) and fusions_enabled() and weight.dtype == y.dtype and T <= MAX_TOKENS and block_k >= 8
             and sq.dtype == torch.float32)
    if not fused:
        return linear_partials(rms_norm_gated(y, norm_weight, z, eps, group_size, norm_before_gate), weight)
    y = y if y.stride(1) == 1 else y.contiguous()
    z = z if z.stride(1) == 1 else z.contiguous()
    sq = sq.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    N = weight.shape[0]
    block_n = 16 if y.is_cuda else 8
    splits = triton.cdiv(K, block_k)
    out = torch.empty(splits, T, N, dtype=torch.float32, device=y.device)
    sq_per_group = sq.shape[1] // groups * sq.shape[2]
    if T and N:
        _gated_norm_linear_partials_kernel[(triton.cdiv(N, block_n), splits)](
            y, z, sq, norm_weight.contiguous(), weight, out, T, N, K, group_size, sq_per_group, float(eps),
            y.stride(0), z.stride(0), sq.stride(0), weight.stride(0), out.stride(0), out.stride(1),
            NORM_BEFORE_GATE=bool(norm_before_gate), BLOCK_N=block_n, BLOCK_K=block_k,
            BLOCK_SQ=next_power_of_2(sq_per_group), num_warps=4)
    return out
