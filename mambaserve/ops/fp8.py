"""FP8 (float8_e4m3fn) quantization and matrix products: ops `quantize_fp8`, `fp8_linear`.

Symmetric scaled FP8 as in the compressed-tensors format and vLLM: q = clamp(x / s, -448, 448)
rounded to e4m3, x ~ q * s with s float32, per tensor (one s), per output channel of a weight
(one s per row) or per token of an activation (one s per row, computed at run time from the
row's absolute maximum: s = amax / 448).

`fp8_linear` multiplies by an FP8 weight. Decode-sized inputs (at most 16 rows) on the Triton
path take a weight-only GEMV (`gemv.fp8_gemv`: bf16 activations times the exactly widened FP8
weight, one launch for most shapes): cuBLASLt's FP8 GEMM is slow at M = 1 and its activation
quantize and bias add cost launches of their own, which a decode step's CUDA graph of a few
hundred small kernels feels. For more rows, on a CUDA device whose torch has `torch._scaled_mm`
(Hopper's FP8 tensor cores through cuBLASLt) the activations are quantized (per token, or with
a static per-tensor scale), and one `_scaled_mm` computes (x_q W_q^T) * s_x * s_w in float32
with a bfloat16 result; its layout rules (A row-major, B column-major: the transpose of a
row-major (N, K) weight is; K and N multiples of 16; bfloat16 out) are checked, and a call
that breaks them takes the reference; a weight's row-wise scale for it is built once and
cached (`_row_scale`). The reference (every CPU call) dequantizes the weight to the
activations' dtype and runs F.linear: activations are not quantized there (the weight is the
only rounding), so it is the "dequantized model" of the tests, and `reference_scaled_mm`
states the GEMM's math for tests of it.

This module knows nothing about models.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from mambaserve.ops.common import check, next_power_of_2
from mambaserve.ops.dispatch import current_backend, tl, triton, use_triton
from mambaserve.ops.gemv import fp8_gemv, gemv_max_tokens

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a row of zeros still gets a finite, positive scale
_HAS_SCALED_MM = hasattr(torch, "_scaled_mm")
# use_fast_accum of the FP8 GEMMs (`_scaled_mm` here, `_scaled_grouped_mm` in the MoE): Hopper's
# FP8 tensor cores then keep the sums in their own accumulator across K blocks instead of
# promoting them to float32 every few blocks. On an H200 the promotion made the experts' grouped
# mm 2x slower (granite-4.0-tiny, 31,500 tokens: 3,624 vs 1,774 us,
# benchmarks/results/h200/fp8/moe-paths-granite-4.0-tiny.json); the GPU tests hold the results to the
# float64 math of the quantized path.
FP8_FAST_ACCUM = True
# weight scale -> (its version, the (1, N) float32 row-wise scale `_scaled_mm` takes): built once
_ROW_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, min_scale,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """One row: its scale (amax / 448, or the static s_ptr[0]), then q = clamp(x / scale)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, min_scale)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None, *, per_row: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric FP8 quantization of x (..., K) -> (q in float8_e4m3fn of x's shape, scale float32).

    scale given (a static scale: 1 element, or one per row (..., 1)): q = clamp(x / scale).
    Otherwise a dynamic scale amax(|x|) / 448 (at least 1/229,376 so zeros stay finite):
    per_row=True one per row (shape (..., 1): per token, or per output channel of a weight
    (N, K) / (E, N, K)), per_row=False one for the tensor (shape (1,)). Raises ValueError for
    a static scale of another size. A 2-D x on the Triton path (CUDA: the activations of
    `fp8_linear`), per row or with one static scale, is one kernel launch; the rest runs
    `quantize_fp8_reference`, the same math in PyTorch."""
    if x.dim() == 2 and use_triton(x) and x.stride(1) == 1 and (per_row or scale is not None) \
            and (scale is None or scale.numel() == 1):
        M, K = x.shape
        q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
        s = scale.float().reshape(1).contiguous() if scale is not None else \
            torch.empty(M, 1, dtype=torch.float32, device=x.device)
        if M and K:
            _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), _MIN_SCALE,
                                        STATIC=scale is not None, BLOCK=min(1024, next_power_of_2(K)))
        return q, s
    return quantize_fp8_reference(x, scale, per_row=per_row)


def quantize_fp8_reference(x: torch.Tensor, scale: torch.Tensor | None = None, *, per_row: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of `quantize_fp8`, in PyTorch (float32 division, clamp, round to e4m3)."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True) if per_row else xf.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    else:
        scale = scale.float()
        check(scale.numel() == 1 or scale.shape == (*x.shape[:-1], 1),
              lambda: f"a static scale must have 1 element or shape {(*x.shape[:-1], 1)}, got {tuple(scale.shape)}")
    s = scale if scale.dim() == xf.dim() or scale.numel() != 1 else scale.reshape([1] * xf.dim())
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _silu_mul_quantize_kernel(h_ptr, q_ptr, s_ptr, inter, stride_h, stride_q, min_scale, BLOCK: tl.constexpr):
    """One row: a = silu(h[:inter]) * h[inter:] in float32, its scale amax(|a|) / 448, q = a / scale.
    a is computed twice (for the amax, then for q) rather than stored: h is read twice, and no
    (rows, inter) intermediate is written and read back."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        mask = k0 + offs < inter
        g = tl.load(h_ptr + row * stride_h + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * stride_h + inter + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(g * tl.sigmoid(g) * u))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, min_scale)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, inter, BLOCK):
        mask = k0 + offs < inter
        g = tl.load(h_ptr + row * stride_h + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * stride_h + inter + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(g * tl.sigmoid(g) * u / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def silu_mul_quantize_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of a fused [gate | up] product, quantized per row to FP8 in the same pass
    (the FP8 experts' down-projection input: the activation never lands in 16 bits).

    h: (rows, 2 * inter) float, stride 1 along features. Returns q (rows, inter) float8_e4m3fn
    and scale (rows,) float32 with silu(g) * u ~ q * scale[:, None], the product in float32 and
    the scale its row's amax / 448 (at least 1/229,376). One launch on the Triton path, the same
    math in PyTorch elsewhere. Math: GLU variants (Shazeer 2020), `quantize_fp8`. Raises
    ValueError on an odd feature count."""
    check(h.dim() == 2 and h.shape[1] % 2 == 0, lambda: f"h must be (rows, 2 * inter), got {tuple(h.shape)}")
    rows, inter = h.shape[0], h.shape[1] // 2
    if not use_triton(h):
        g, u = h.float().chunk(2, dim=-1)
        q, s = quantize_fp8_reference(F.silu(g) * u)
        return q, s.reshape(rows)
    h = h if h.stride(1) == 1 else h.contiguous()
    q = torch.empty(rows, inter, dtype=FP8_DTYPE, device=h.device)
    s = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows and inter:
        _silu_mul_quantize_kernel[(rows,)](h, q, s, inter, h.stride(0), q.stride(0), _MIN_SCALE,
                                           BLOCK=min(1024, next_power_of_2(inter)))
    return q, s


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., N, K) float8 times scale (1 element, or (..., N) / (..., N, 1): one per row), in
    float32, rounded once to `dtype`."""
    s = scale.float()
    if s.numel() != 1 and s.dim() == q.dim() - 1:
        s = s[..., None]
    return (q.float() * (s if s.numel() != 1 else s.reshape(()))).to(dtype)


def _scaled_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    N, K = weight.shape
    return (_HAS_SCALED_MM and x.is_cuda and current_backend() != "reference" and x.dtype == torch.bfloat16
            and K % 16 == 0 and N % 16 == 0 and weight.stride(1) == 1 and x.shape[0] > 0)


def _row_scale(weight_scale: torch.Tensor, N: int) -> torch.Tensor:
    """weight_scale (1 or N elements) as the (1, N) float32 contiguous tensor that row-wise
    `_scaled_mm` takes (contiguous scales are required there). A per-row float32 scale is a
    view; any other is built once per scale tensor (its version checked, so a weight loaded in
    place later is seen) and cached, except while a CUDA graph is captured (a copy made then
    holds nothing until the graph replays) and for an inference-mode scale (no version)."""
    s = weight_scale.reshape(-1)
    if s.numel() == N and s.dtype == torch.float32 and s.stride(0) == 1:
        return s.view(1, N)
    if weight_scale.is_inference():  # no version counter: not cached
        return s.float().expand(N).reshape(1, N).contiguous()
    hit = _ROW_SCALES.get(weight_scale)
    if hit is not None and hit[0] == weight_scale._version:
        return hit[1]
    row = s.float().expand(N).reshape(1, N).contiguous()
    if not (row.is_cuda and torch.cuda.is_current_stream_capturing()):
        _ROW_SCALES[weight_scale] = (weight_scale._version, row)
    return row


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (W_q * s_w)^T + b: a linear layer whose weight is stored in FP8.

    x: (..., K) float; weight: (N, K) float8_e4m3fn; weight_scale: float32, 1 element (per
    tensor) or N (per output channel, shape (N,) or (N, 1)); bias: (N,) or None; input_scale:
    the checkpoint's static per-tensor activation scale (1 element), or None for dynamic
    per-token scales (used by the FP8 GEMM only). Returns (..., N) in x's dtype.

    Backends: decode-sized x (at most `gemv_max_tokens()` rows) on the Triton path (CUDA, or
    the interpreter) runs `gemv.fp8_gemv`, weight-only: x stays in its dtype and input_scale is
    not applied (as the FP8 experts and the decode out_proj), one launch for most shapes where
    quantize + `_scaled_mm` + bias take four. More rows on CUDA: the FP8 GEMM of the module
    docstring. Elsewhere the reference (the dequantized weight, F.linear). Raises ValueError
    on shapes or dtypes that do not fit.
    """
    check(weight.dim() == 2 and weight.dtype == FP8_DTYPE and x.shape[-1] == weight.shape[1],
          lambda: f"weight must be (N, {x.shape[-1]}) float8_e4m3fn, got {tuple(weight.shape)} {weight.dtype}")
    N = weight.shape[0]
    check(weight_scale.numel() in (1, N),
          lambda: f"weight_scale must have 1 or {N} elements, got {weight_scale.numel()}")
    check(input_scale is None or input_scale.numel() == 1, "input_scale must be one per-tensor scale")
    check(bias is None or bias.shape == (N,), lambda: f"bias must be ({N},), got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if M == 0:  # no rows: no weight to dequantize
        return x.new_empty(*lead, N)
    if use_triton(x2) and M <= gemv_max_tokens():
        return fp8_gemv(x2, weight, weight_scale, bias).reshape(*lead, N)
    if not _scaled_mm_usable(x2, weight):
        return F.linear(x, dequantize_fp8(weight, weight_scale.reshape(-1), x.dtype), bias)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    xq, xs = quantize_fp8(x2, input_scale)  # (M, K) fp8, (M, 1) or (1,) float32
    if xs.numel() == 1 and weight_scale.numel() == 1:  # tensor-wise scaling
        a_scale, b_scale = xs.reshape(()), weight_scale.float().reshape(())
    else:  # row-wise: (M, 1) and (1, N), both contiguous; a dynamic xs already is
        a_scale = xs if xs.shape == (M, 1) else xs.reshape(1, 1).expand(M, 1).contiguous()
        b_scale = _row_scale(weight_scale, N)
    y = torch._scaled_mm(xq, weight.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                         use_fast_accum=FP8_FAST_ACCUM)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, N)


def reference_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The math of `fp8_linear`'s FP8 GEMM, in float64: x quantized as there (per token, or by
    input_scale), (x_q * s_x) (W_q * s_w)^T. x: (M, K) -> (M, N) float64 (tests of the GPU path)."""
    xq, xs = quantize_fp8_reference(x, input_scale)
    xs = xs.reshape(-1, 1) if xs.numel() > 1 else xs.reshape(())
    ws = weight_scale.double().reshape(-1)
    return (xq.double() * xs.double()) @ (weight.double() * (ws[:, None] if ws.numel() > 1 else ws)).t()
