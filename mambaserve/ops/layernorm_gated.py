"""Triton kernel for the gated RMSNorm of Mamba2 (norm over groups of features, silu(z) gate).

One program normalizes a (block_m rows, one group) tile in a single pass when the group fits
in a block (the usual case: hidden / n_groups <= 8192), or in two passes over the group
otherwise. Rows may have any stride (z is usually a column slice of in_proj's output).

Math: `mambaserve.ops.reference.rms_norm_gated` (Mamba2 paper, section 7.2, "extra
normalization"). This module knows nothing about models or the engine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_N = 8192  # widest group handled in a single pass
TILE_ELEMENTS = 4096  # rows per program = TILE_ELEMENTS // block_n (at least 1)


@triton.jit(do_not_specialize=["num_rows"])  # a per-step count: one kernel for all
def _rms_norm_gated_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr, res_ptr,
    num_rows, group_size, eps, alpha, num_parts,
    stride_x_m, stride_z_m, stride_o_m, stride_r_m, stride_x_p,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS_BLOCK: tl.constexpr,
):
    # HAS_RESIDUAL: res <- res + alpha * x (rounded to res's dtype, stored in place) and the
    # rounded sum is what gets normalised: the residual stream's add fused into the next norm.
    # There x may come as num_parts partial sums (x_ptr + p * stride_x_p), added in order.
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    col0 = g * group_size
    cols = tl.arange(0, BLOCK_N)

    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < group_size)[None, :]
        c = col0 + cols
        if PARTS_BLOCK > 1:  # one row per program (BLOCK_M == 1): PARTS_BLOCK parts per load, summed
            parts = tl.arange(0, PARTS_BLOCK)
            v = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for p0 in range(0, num_parts, PARTS_BLOCK):
                tile = tl.load(x_ptr + (p0 + parts)[:, None] * stride_x_p + rows * stride_x_m + c[None, :],
                               mask=((p0 + parts) < num_parts)[:, None] & mask, other=0.0).to(tl.float32)
                v += tl.sum(tile, axis=0)[None, :]
        else:
            v = tl.load(x_ptr + rows[:, None] * stride_x_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r_ptrs = res_ptr + rows[:, None] * stride_r_m + c[None, :]
            r = (tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32) + alpha * v).to(res_ptr.dtype.element_ty)
            tl.store(r_ptrs, r, mask=mask)
            v = r.to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + rows[:, None] * stride_z_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if not NORM_BEFORE_GATE:
                v = v * zv * tl.sigmoid(zv)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / group_size + eps)
        w = tl.load(w_ptr + c, mask=cols < group_size, other=0.0).to(tl.float32)
        o = v * rstd[:, None] * w[None, :]
        if HAS_Z:
            if NORM_BEFORE_GATE:
                o = o * zv * tl.sigmoid(zv)
        tl.store(out_ptr + rows[:, None] * stride_o_m + c[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, group_size, BLOCK_N):
            c = col0 + n0 + cols
            mask = row_mask[:, None] & (n0 + cols < group_size)[None, :]
            v = tl.load(x_ptr + rows[:, None] * stride_x_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                for p in range(1, num_parts):
                    v += tl.load(x_ptr + p * stride_x_p + rows[:, None] * stride_x_m + c[None, :], mask=mask,
                                 other=0.0).to(tl.float32)
                r_ptrs = res_ptr + rows[:, None] * stride_r_m + c[None, :]
                r = (tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32) + alpha * v).to(res_ptr.dtype.element_ty)
                tl.store(r_ptrs, r, mask=mask)
                v = r.to(tl.float32)
            if HAS_Z:
                if not NORM_BEFORE_GATE:
                    zv = tl.load(z_ptr + rows[:, None] * stride_z_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
                    v = v * zv * tl.sigmoid(zv)
            sq += tl.sum(v * v, axis=1)
        rstd = 1.0 / tl.sqrt(sq / group_size + eps)
        for n0 in range(0, group_size, BLOCK_N):
            c = col0 + n0 + cols
            mask = row_mask[:, None] & (n0 + cols < group_size)[None, :]
            if HAS_RESIDUAL:  # the updated residual, written by this program in the first pass
                v = tl.load(res_ptr + rows[:, None] * stride_r_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                v = tl.load(x_ptr + rows[:, None] * stride_x_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_Z:
                zv = tl.load(z_ptr + rows[:, None] * stride_z_m + c[None, :], mask=mask, other=0.0).to(tl.float32)
                if not NORM_BEFORE_GATE:
                    v = v * zv * tl.sigmoid(zv)
            w = tl.load(w_ptr + c, mask=n0 + cols < group_size, other=0.0).to(tl.float32)
            o = v * rstd[:, None] * w[None, :]
            if HAS_Z:
                if NORM_BEFORE_GATE:
                    o = o * zv * tl.sigmoid(zv)
            tl.store(out_ptr + rows[:, None] * stride_o_m + c[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
    residual: torch.Tensor | None = None,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Gated RMSNorm over groups of group_size features.

    x, z: (num_tokens, hidden), any row stride (a non-unit feature stride is copied first);
    weight: (hidden,); hidden % group_size == 0. norm_before_gate=False computes
    weight * rmsnorm_g(x * silu(z)); True computes weight * rmsnorm_g(x) * silu(z).
    residual: optional (num_tokens, hidden) tensor, feature stride 1, updated in place to
    residual + alpha * x (rounded to its dtype); the norm then applies to that sum instead of x.
    With a residual, x may also be (num_parts, num_tokens, hidden) partial sums (any dtype,
    feature stride 1), added in order in float32: a split-K product's unreduced output.
    Returns a contiguous (num_tokens, hidden) tensor in x.dtype (residual's for partials).
    """
    parts = None
    if x.dim() == 3:
        if residual is None or z is not None:
            raise ValueError("partial sums (3-D x) are taken only with a residual and no gate")
        parts, x = x, x[0]
    num_rows, hidden = x.shape
    if hidden % group_size != 0:
        raise ValueError(f"hidden ({hidden}) must be a multiple of group_size ({group_size})")
    if x.stride(1) != 1:
        if parts is not None:
            raise ValueError("partial sums must have stride 1 along features")
        x = x.contiguous()
    if z is not None and z.stride(1) != 1:
        z = z.contiguous()
    weight = weight.contiguous()
    out = torch.empty((num_rows, hidden), dtype=x.dtype if parts is None else residual.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return out
    single = triton.next_power_of_2(group_size) <= MAX_BLOCK_N
    block_n = triton.next_power_of_2(group_size) if single else MAX_BLOCK_N // 2
    block_m = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(num_rows)))
    parts_block = 1
    if parts is not None and parts.shape[0] > 1 and single:
        # at most 16K values per load (registers): hidden 4,096 takes four parts at a time
        parts_block = min(triton.next_power_of_2(parts.shape[0]), max(2, 16384 // block_n))
        block_m = 1
    num_warps = 4 if parts_block * block_m * block_n <= 2048 else 8
    zz = z if z is not None else x
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} with stride 1 along features")
    rr = residual if residual is not None else x
    grid = (triton.cdiv(num_rows, block_m), hidden // group_size)
    _rms_norm_gated_kernel[grid](
        x, weight, zz, out, rr, num_rows, group_size, float(eps), float(alpha),
        1 if parts is None else parts.shape[0],
        x.stride(0), zz.stride(0), out.stride(0), rr.stride(0), 0 if parts is None else parts.stride(0),
        HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate), SINGLE_PASS=single,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, PARTS_BLOCK=parts_block,
        num_warps=num_warps,
    )
    return out
