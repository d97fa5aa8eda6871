"""The SiLU-gated product of a fused [gate | up] projection: op `silu_and_mul`, its Triton
kernel (shared with the MoE) and launcher.

silu_and_mul(h)[r] = silu(h[r, :inter]) * h[r, inter:], computed in float32 (GLU variants:
Shazeer 2020). One kernel where PyTorch runs a SiLU and a multiplication: at decode batch sizes
a step's time goes to the number of kernels. Math: `reference.silu_and_mul`.
This module knows nothing about models or the engine.
"""

from __future__ import annotations

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, next_power_of_2
from mambaserve.ops.dispatch import tl, triton, use_triton


@triton.jit
def _silu_mul_kernel(h_ptr, out_ptr, inter, stride_h, stride_o, BLOCK: tl.constexpr):
    """out[r] = silu(h[r, :inter]) * h[r, inter:] in float32."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(h_ptr + r * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + r * stride_h + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [gate | up] projection (the gated MLPs of every family).

    h: (num_rows, 2 * inter), any strides. Returns (num_rows, inter) in h.dtype, computed in
    float32. Math: GLU variants (Shazeer 2020); `reference.silu_and_mul`. Raises ValueError on
    an odd feature count.
    """
    check(h.dim() == 2 and h.shape[1] % 2 == 0, lambda: f"h must be (num_rows, 2 * inter), got {tuple(h.shape)}")
    if not use_triton(h):
        return reference.silu_and_mul(h)
    if h.stride(1) != 1:
        h = h.contiguous()
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows == 0:
        return out
    block = min(1024, next_power_of_2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](h, out, inter, h.stride(0), out.stride(0), BLOCK=block)
    return out
