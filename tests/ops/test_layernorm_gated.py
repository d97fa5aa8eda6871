"""Triton gated RMSNorm against the PyTorch reference."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import layernorm_gated
from mambaserve.ops import reference as ref
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only


def _check(x, w, z, group_size, norm_before_gate):
    with ops.backend("triton"):
        out = ops.rms_norm_gated(x, w, z, 1e-5, group_size, norm_before_gate)
    expected = ref.rms_norm_gated(x, w, z, 1e-5, group_size, norm_before_gate)
    assert rel_err(out, expected) < tolerance(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size,norm_before_gate", [(120, False), (40, True), (24, False)])
@pytest.mark.slow
def test_rms_norm_gated(device, dtype, group_size, norm_before_gate):
    T, hidden = 13, 120  # 40 features per group: not a power of two
    x = torch.randn(T, hidden, device=device).to(dtype)
    z = torch.randn(T, hidden + 30, device=device).to(dtype)[:, 10:10 + hidden]  # a column slice
    w = torch.randn(hidden, device=device).to(dtype)
    _check(x, w, z, group_size, norm_before_gate)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_rms_norm_gated_no_gate_and_two_pass(device, monkeypatch):
    x = torch.randn(5, 96, device=device)
    w = torch.randn(96, device=device)
    _check(x, w, None, 48, False)
    monkeypatch.setattr(layernorm_gated, "MAX_BLOCK_N", 16)  # groups wider than a block: two passes
    z = torch.randn(5, 96, device=device)
    _check(x, w, z, 96, False)
    _check(x, w, z, 48, True)


@gpu_only
def test_rms_norm_gated_long_prompt_gpu(poison_empty):
    x = torch.randn(31500, 3072, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(31500, 6448, device="cuda", dtype=torch.bfloat16)[:, :3072]
    w = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    _check(x, w, z, 3072, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.slow
def test_fused_add_rms_norm(device, dtype, two_pass, monkeypatch):
    """The residual add fused into the norm: the residual is updated in place exactly as
    torch.add(residual, x, alpha) rounds it, and the norm of the updated residual matches the
    float64 reference."""
    if two_pass:
        monkeypatch.setattr(layernorm_gated, "MAX_BLOCK_N", 32)
    T, hidden = 11, 72
    x = torch.randn(T, hidden + 8, device=device).to(dtype)[:, 8:]  # a column slice
    residual = torch.randn(T, hidden, device=device).to(dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    alpha = 0.37
    before = residual.clone()
    exact = before.double() + alpha * x.double()
    # within rounding of the exact sum (the interpreter rounds bfloat16 by truncation)
    bound = 2 * torch.finfo(dtype).eps * (before.double().abs() + alpha * x.double().abs())
    expected = ref.rms_norm_gated(exact, w.double(), None, 1e-5, hidden)
    with ops.backend("triton"):
        out = ops.fused_add_rms_norm(x, residual, w, 1e-5, alpha)
    assert residual.dtype == dtype and bool(((residual.double() - exact).abs() <= bound).all())
    assert out.dtype == dtype and rel_err(out, expected) < tolerance(dtype)
    # the reference op agrees with itself the same way
    res2 = before.clone()
    out_ref = ref.fused_add_rms_norm(x, res2, w, 1e-5, 1.0)
    assert torch.equal(res2, torch.add(before, x))
    assert rel_err(out_ref, ref.rms_norm_gated(res2.double(), w.double(), None, 1e-5, hidden)) < tolerance(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.slow
def test_fused_add_rms_norm_takes_partial_sums(device, two_pass, monkeypatch):
    """x as split-K partials (linear_partials' output) or strided MoE pairs: summed in order."""
    if two_pass:
        monkeypatch.setattr(layernorm_gated, "MAX_BLOCK_N", 32)
    T, K, hidden = 3, 100, 72
    a = torch.randn(T, K, device=device)
    w_lin = torch.randn(hidden, K, device=device) / K**0.5
    with ops.backend("triton"):
        parts = ops.linear_partials(a, w_lin)
    assert parts.dim() == 3 and parts.shape[1:] == (T, hidden) and parts.dtype == torch.float32
    assert rel_err(parts.sum(0), a.double() @ w_lin.double().t()) < 1e-5
    pairs = torch.randn(T, 4, hidden, device=device).transpose(0, 1)  # (4, T, hidden), strided like MoE pairs
    w = torch.randn(hidden, device=device)
    for x in (parts, pairs):
        residual = torch.randn(T, hidden, device=device).to(torch.bfloat16)
        before = residual.clone()
        exact = before.double() + 0.5 * x.double().sum(0)
        with ops.backend("triton"):
            out = ops.fused_add_rms_norm(x, residual, w, 1e-5, 0.5)
        assert out.dtype == torch.bfloat16
        assert rel_err(residual, exact) < tolerance(torch.bfloat16)
        assert rel_err(out, ref.rms_norm_gated(exact, w.double(), None, 1e-5, hidden)) < tolerance(torch.bfloat16)
        res_ref = before.clone()
        out_ref = ops.reference.fused_add_rms_norm(x, res_ref, w, 1e-5, 0.5)
        assert rel_err(res_ref, exact) < tolerance(torch.bfloat16) and rel_err(out_ref,
                                                                               out.double()) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_fused_add_rms_norm_many_partial_sums_of_a_wide_row(device):
    """16 partial sums of a 4,096-wide row: loaded four parts at a time (the register cap)."""
    parts = torch.randn(16, 2, 4096, device=device)
    residual = torch.randn(2, 4096, device=device)
    w = torch.randn(4096, device=device)
    exact = residual.double() + parts.double().sum(0)
    with ops.backend("triton"):
        out = ops.fused_add_rms_norm(parts, residual, w, 1e-5)
    assert rel_err(residual, exact) < 1e-6
    assert rel_err(out, ref.rms_norm_gated(exact, w.double(), None, 1e-5, 4096)) < tolerance(torch.float32)
