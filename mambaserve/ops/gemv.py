"""Split-K matrix-vector products for decode-sized batches, left as partial sums: op
`linear_partials`, its Triton kernel and launcher; `fp8_gemv` finishing them.

At a decode step a projection multiplies a handful of rows by a large weight: the time is the
weight read, and cuBLAS spends two launches on it (a split-K product and its reduction). Here
one launch spreads the weight over many programs, each multiplying one (BLOCK_N x BLOCK_K) tile
by every row, and leaves the split partial sums (num_splits, num_tokens, N) in float32. The
reduction is folded into the consumer: `ops.fused_add_rms_norm` takes such partials as its
input, so the residual add, the sum of the splits and the next norm are one kernel.

`fp8_gemv` is the same kernel finishing the product for `ops.fp8_linear` at decode: an FP8
weight read once, widened exactly in registers, its rows' scales and the bias applied and the
result stored in x's dtype, in one launch where `gemv_plan` finds one split enough to fill the
GPU (else the splits' partials and one launch summing them).

`gated_norm_linear_partials` is the same product with a Mamba2 gated RMSNorm applied to x in
its prologue: the norm's sums of squares come from the state update that produced x
(`ssd_state_update(..., norm_sq=True)`), so the norm costs no launch of its own.

Math: `reference.linear_partials` and `reference.rms_norm_gated`. This module knows nothing
about models.
"""

from __future__ import annotations

import functools

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, check_positive_int, next_power_of_2
from mambaserve.ops.dispatch import fusions_enabled, tl, triton, use_triton
from mambaserve.ops.layernorm_gated import rms_norm_gated

MAX_TOKENS = 16  # more rows than this: a tensor-core matrix product is the better tool
GPU_TILE = 32768  # weight elements one `fp8_gemv` program reads per split on a GPU (`gemv_plan`)


@triton.jit
def _finish_rows(acc, out_row_ptr, ws_ptr, b_ptr, offs_n, n_mask, stride_ws, SCALED: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """Store acc (BLOCK_N,) float32 at out_row_ptr[offs_n] in out's dtype, first times the rows'
    scales ws[n * stride_ws] (SCALED) and plus the bias b[n] (HAS_BIAS)."""
    if SCALED:
        acc = acc * tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_row_ptr + offs_n, acc.to(out_row_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["num_tokens"])  # a per-step count: one kernel for all
def _linear_partials_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, b_ptr, num_tokens, N, K, stride_x, stride_w, stride_ws,
                            stride_os, stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            K_CHUNKS: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[s, t, n] = w[n, split s] . x[t, split s] for every row t: program (i, s) multiplies the
    weight rows of block i over split s (K_CHUNKS blocks of BLOCK_K features, unrolled so that
    their loads are in flight together) by every row (SCALED: an FP8 w, each sum times its
    row's scale; HAS_BIAS: plus the bias, for a single split: the finished product)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    offs_k = s * (K_CHUNKS * BLOCK_K) + tl.arange(0, BLOCK_K)
    if K_CHUNKS == 1:  # one tile: read once, kept in registers for every row
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        for t in range(num_tokens):
            xv = tl.load(x_ptr + t * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            _finish_rows(tl.sum(w * xv[None, :], axis=1), out_ptr + s * stride_os + t * stride_ot, ws_ptr, b_ptr,
                         offs_n, n_mask, stride_ws, SCALED, HAS_BIAS)
    else:  # rows after the first read the split again, from the cache
        for t in range(num_tokens):
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c in tl.static_range(K_CHUNKS):
                offs = offs_k + c * BLOCK_K
                k_mask = offs < K
                w = tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                xv = tl.load(x_ptr + t * stride_x + offs, mask=k_mask, other=0.0).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            _finish_rows(acc, out_ptr + s * stride_os + t * stride_ot, ws_ptr, b_ptr, offs_n, n_mask, stride_ws,
                         SCALED, HAS_BIAS)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, splits, N, stride_ps, stride_pt, stride_y, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """y[t, n] = sum_s p[s, t, n] (+ b[n]), in y's dtype: one row t per program column."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * stride_ps + t * stride_pt + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


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
    x, weight = _unit_k_stride(x, weight)
    num_tokens, K = x.shape
    N = weight.shape[0]
    on_gpu = x.is_cuda
    block_n, block_k = (16, 512) if on_gpu else (8, 32)
    splits = triton.cdiv(K, block_k)
    out = torch.empty(splits, num_tokens, N, dtype=torch.float32, device=x.device)
    if num_tokens and N:
        _linear_partials_kernel[(triton.cdiv(N, block_n), splits)](
            x, weight, out, weight_scale.float().contiguous() if scaled else out, out, num_tokens, N, K, x.stride(0),
            weight.stride(0), 1, out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, K_CHUNKS=1,
            SCALED=scaled, HAS_BIAS=False, num_warps=4)
    return out


def _unit_k_stride(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) and weight (N, K) with stride 1 along K, as the GEMV kernels load them."""
    return (x if x.stride(1) == 1 else x.contiguous()), (weight if weight.stride(1) == 1 else weight.contiguous())


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_plan(N: int, K: int, programs: int, block_k: int, tile: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, K_CHUNKS, splits) of `fp8_gemv` for an (N, K) weight on a device that
    runs `programs` programs at once (its SMs; a small number on the interpreter).

    At decode the weight read is the time, and it is latency-bound: every SM needs bytes in
    flight. Rows per program shrink (16 down to 2) until there are 2 programs per SM, and each
    program reads its rows over as much of K as `tile` weight elements allow (its K_CHUNKS
    blocks are unrolled, their loads issued together). With the H200's 132 SMs and a tile of
    32768 that is one split, one launch, for K up to 2048 at N >= 4224, 4096 at N >= 2112,
    8192 at N >= 1056 and 16384 at N >= 264; a weight with fewer rows than SMs is split along
    K until it has ~2 programs per SM."""
    block_k = min(block_k, next_power_of_2(K))
    chunks = triton.cdiv(K, block_k)
    block_n = 16
    while block_n > 2 and triton.cdiv(N, block_n) < 2 * programs:
        block_n //= 2
    row_programs = triton.cdiv(N, block_n)
    k_chunks = max(1, min(chunks, tile // (block_n * block_k)))
    if row_programs < programs:  # too few rows to fill the device: more splits
        k_chunks = min(k_chunks, max(1, chunks * row_programs // (2 * programs)))
    splits = triton.cdiv(chunks, k_chunks)
    return block_n, block_k, triton.cdiv(chunks, splits), splits  # chunks spread evenly over the splits


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
             ) -> torch.Tensor:
    """y = x (W_q * s_w)^T + b for decode-sized x, weight-only: the Triton path of
    `ops.fp8_linear` at most MAX_TOKENS rows (its launcher checks the shapes and picks it).

    x: (M, K) (any row stride), M <= MAX_TOKENS; weight: (N, K) float8_e4m3fn; weight_scale:
    float32, 1 element (per tensor) or N (per row); bias: (N,) or None. Returns (M, N) in x's
    dtype. x is not quantized: the FP8 weight is widened exactly in registers, the products
    summed in float32, times the scale, plus the bias: one launch where one split suffices
    (`gemv_plan`), else the splits' partials and one launch that sums them."""
    assert x.dim() == 2 and x.shape[0] <= MAX_TOKENS and weight.dtype == torch.float8_e4m3fn
    x, weight = _unit_k_stride(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    ws = weight_scale.reshape(-1)
    ws = ws if ws.dtype == torch.float32 and ws.stride(0) == 1 else ws.float().contiguous()
    bias = None if bias is None else bias.contiguous()
    if x.is_cuda:
        block_n, block_k, k_chunks, splits = gemv_plan(N, K, _num_sms(x.device.index or 0), 512, GPU_TILE)
    else:  # the interpreter: small blocks, so that the tests reach both one and several splits
        block_n, block_k, k_chunks, splits = gemv_plan(N, K, 4, 32, 512)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    stride_os = 0 if splits == 1 else out.stride(0)
    _linear_partials_kernel[(triton.cdiv(N, block_n), splits)](
        x, weight, out, ws, out if bias is None else bias, M, N, K, x.stride(0), weight.stride(0),
        0 if ws.numel() == 1 else 1, stride_os, out.stride(-2), BLOCK_N=block_n, BLOCK_K=block_k,
        K_CHUNKS=k_chunks, SCALED=True, HAS_BIAS=bias is not None and splits == 1, num_warps=4)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(N, 1024), M)](
            out, y if bias is None else bias, y, splits, N, out.stride(0), out.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=1024, num_warps=4)
    return y


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
