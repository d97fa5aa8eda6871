"""Split-K matrix-vector products for decode-sized batches, left as partial sums: op
`linear_partials`, its Triton kernel and launcher.

At a decode step a projection multiplies a handful of rows by a large weight: the time is the
weight read, and cuBLAS spends two launches on it (a split-K product and its reduction). Here
one launch spreads the weight over many programs, each multiplying one (BLOCK_N x BLOCK_K) tile
by every row, and leaves the split partial sums (num_splits, num_tokens, N) in float32. The
reduction is folded into the consumer: `ops.fused_add_rms_norm` takes such partials as its
input, so the residual add, the sum of the splits and the next norm are one kernel.

Math: `reference.linear_partials`. This module knows nothing about models.
"""

from __future__ import annotations

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check
from mambaserve.ops.dispatch import tl, triton, use_triton

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
