"""Triton kernel for the SiLU-gated product of a fused [gate | up] projection.

silu_and_mul(h)[r] = silu(h[r, :inter]) * h[r, inter:], computed in float32 (GLU variants:
Shazeer 2020). One kernel where PyTorch runs a SiLU and a multiplication: at decode batch sizes
a step's time goes to the number of kernels. Math: `mambaserve.ops.reference.silu_and_mul`.
This module knows nothing about models or the engine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(h_ptr, out_ptr, inter, stride_h, stride_o, BLOCK: tl.constexpr):
    """out[r] = silu(h[r, :inter]) * h[r, inter:] in float32."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(h_ptr + r * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + r * stride_h + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def silu_and_mul_triton(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """h: (num_rows, 2 * inter), stride 1 along features -> (num_rows, inter) in h.dtype."""
    rows, two_inter = h.shape
    inter = two_inter // 2
    if out is None:
        out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows == 0:
        return out
    block = min(1024, _next_pow2(inter))
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](h, out, inter, h.stride(0), out.stride(0), BLOCK=block)
    return out
