"""The RMSNorms: ops `rms_norm_gated` (Mamba2's gated norm over groups of features) and
`fused_add_rms_norm` (a residual add and the next layer's RMSNorm), one Triton kernel.

One program normalizes a (block_m rows, one group) tile in a single pass when the group fits
in a block (the usual case: hidden / n_groups <= 8192), or in two passes over the group
otherwise. Rows may have any stride (z is usually a column slice of in_proj's output).

Math: `reference.rms_norm_gated` and `reference.fused_add_rms_norm`. This module knows nothing
about models or the engine.
"""

from __future__ import annotations

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, check_positive_int, next_power_of_2
from mambaserve.ops.dispatch import tl, triton, use_triton

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


def _launch(x, weight, z, eps, group_size, norm_before_gate, residual=None, alpha=1.0, parts=None):
    """The kernel on checked arguments: x (rows, hidden), or with parts (num_parts, rows,
    hidden) partial sums (x = parts[0]) and a residual. Returns (rows, hidden), contiguous."""
    num_rows, hidden = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(1) != 1:
        z = z.contiguous()
    weight = weight.contiguous()
    out = torch.empty((num_rows, hidden), dtype=x.dtype if parts is None else residual.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return out
    single = next_power_of_2(group_size) <= MAX_BLOCK_N
    block_n = next_power_of_2(group_size) if single else MAX_BLOCK_N // 2
    block_m = max(1, min(TILE_ELEMENTS // block_n, next_power_of_2(num_rows)))
    parts_block = 1
    if parts is not None and parts.shape[0] > 1 and single:
        # at most 16K values per load (registers): hidden 4,096 takes four parts at a time
        parts_block = min(next_power_of_2(parts.shape[0]), max(2, 16384 // block_n))
        block_m = 1
    num_warps = 4 if parts_block * block_m * block_n <= 2048 else 8
    zz = z if z is not None else x
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


def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of group_size features (Mamba2, and Falcon-H1's variants).

    x, z: (num_tokens, hidden), any row stride (z may be None: no gate); weight: (hidden,);
    group_size: a positive int dividing hidden. norm_before_gate=False computes
    weight * rmsnorm_g(x * silu(z)); True computes weight * rmsnorm_g(x) * silu(z), where
    rmsnorm_g divides each group of features by its root mean square (+ eps).
    Returns (num_tokens, hidden) in x.dtype, contiguous. Math: Mamba2 paper, section 7.2
    ("extra normalization"); `reference.rms_norm_gated`. Raises ValueError when group_size is
    not a positive int, hidden is not a multiple of it, or shapes disagree.
    """
    check(x.dim() == 2, lambda: f"x must be (num_tokens, hidden), got {tuple(x.shape)}")
    group_size = check_positive_int(group_size, "group_size")
    check(x.shape[1] % group_size == 0,
          lambda: f"hidden ({x.shape[1]}) must be a multiple of group_size ({group_size})")
    check(weight.shape == (x.shape[1],), lambda: f"weight must be ({x.shape[1]},), got {tuple(weight.shape)}")
    check(z is None or z.shape == x.shape, "z must have the shape of x")
    if not use_triton(x):
        return reference.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate)
    return _launch(x, weight, z, eps, group_size, norm_before_gate)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    alpha: float = 1.0,
) -> torch.Tensor:
    """residual <- residual + alpha * x in place (rounded once to residual's dtype), then
    weight * rmsnorm(residual), returned in x.dtype: a residual add and the next layer's norm
    in one kernel (every family's residual stream).

    x, residual: (num_tokens, hidden), residual with feature stride 1; weight: (hidden,).
    x may also be (num_parts, num_tokens, hidden) partial sums of the added term, feature
    stride 1 (as `linear_partials` or `fused_moe(..., as_partials=True)` leave them), summed
    in float32 in a fixed order; the result is then in residual's dtype. Math: RMSNorm (Zhang &
    Sennrich 2019); `reference.fused_add_rms_norm`. Raises ValueError when shapes disagree, and
    on the Triton path when residual or the partial sums are not contiguous along features.
    """
    rows = x.shape[-2:] if x.dim() in (2, 3) else None
    check(rows is not None and residual.shape == rows,
          lambda: f"x must be (num_tokens, hidden) or (num_parts, num_tokens, hidden) and residual "
                  f"(num_tokens, hidden), got {tuple(x.shape)}, {tuple(residual.shape)}")
    check(weight.shape == (x.shape[-1],), lambda: f"weight must be ({x.shape[-1]},), got {tuple(weight.shape)}")
    if not use_triton(residual):
        return reference.fused_add_rms_norm(x, residual, weight, eps, alpha)
    check(residual.stride(1) == 1, "residual must have stride 1 along features")
    parts = None
    if x.dim() == 3:
        check(x.stride(2) == 1, "partial sums must have stride 1 along features")
        parts, x = x, x[0]
    return _launch(x, weight, None, eps, x.shape[-1], False, residual=residual, alpha=alpha, parts=parts)
