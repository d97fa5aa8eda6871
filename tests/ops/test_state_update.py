"""Triton selective state update (the decode step) against the PyTorch reference."""

import math

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference as ref
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only, random_slots


def _check(states, x, dt, A, B, C, D, z, dt_bias, idx, **kw):
    ours, expected_states = states.clone(), states.clone()
    with ops.backend("triton"):
        y = ops.ssd_state_update(ours, x, dt, A, B, C, D, z, dt_bias, idx, **kw)
    expected = ref.ssd_state_update(expected_states, x, dt, A, B, C, D, z, dt_bias, idx, **kw)
    assert rel_err(y, expected) < tolerance(x.dtype)
    state_tol = max(tolerance(x.dtype), tolerance(states.dtype))
    written = {int(i) for i in idx if i >= 0}
    for slot in range(states.shape[0]):
        if slot in written:
            assert rel_err(ours[slot], expected_states[slot]) < state_tol, f"slot {slot}"
        else:
            assert torch.equal(ours[slot], states[slot]), f"untouched slot {slot} changed"


def _inputs(batch, H, P, G, N, dtype, device):
    x = torch.randn(batch, H, P, device=device).to(dtype)
    dt = torch.randn(batch, H + 2, device=device).to(dtype)[:, 2:]  # a column slice
    B = torch.randn(batch, G, N, device=device).to(dtype)
    C = torch.randn(batch, G, N, device=device).to(dtype)
    z = torch.randn(batch, H, P, device=device).to(dtype)
    return x, dt, B, C, z


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ngroups", [1, 3])
@pytest.mark.slow
def test_ssd_state_update(device, dtype, ngroups):
    batch, H, P, N, num_slots = 7, 3, 24, 16, 12  # headdim 24: a partial block of rows
    idx = random_slots(batch, num_slots, padding=[0, 4], device=device)
    x, dt, B, C, z = _inputs(batch, H, P, ngroups, N, dtype, device)
    A = -torch.rand(H, device=device) * 2
    D, dt_bias = torch.randn(H, device=device), torch.randn(H, device=device)
    states = torch.randn(num_slots, H, P, N, device=device)
    limit = (0.0, math.inf) if ngroups == 1 else (0.05, 2.0)
    _check(states, x, dt, A, B, C, D, z, dt_bias, idx, dt_limit=limit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.slow
def test_ssd_state_update_low_precision_pool(device, pool_dtype):
    """bfloat16 / float16 pools; no D, z, dt_bias or softplus."""
    batch, H, P, N, num_slots = 5, 4, 16, 32, 9
    idx = random_slots(batch, num_slots, padding=[3], device=device)
    x, _, B, C, _ = _inputs(batch, H, P, 2, N, torch.bfloat16, device)
    dt = torch.rand(batch, H, device=device).to(torch.bfloat16)
    A = -torch.rand(H, device=device)
    states = torch.randn(num_slots, H, P, N, device=device).to(pool_dtype)
    _check(states, x, dt, A, B, C, None, None, None, idx, dt_softplus=False)


@gpu_only
def test_ssd_state_update_256_gpu(poison_empty):
    """256 decode sequences at the granite-4.0-tiny Mamba layer's shapes, float32 pool."""
    batch, H, P, N, num_slots = 256, 48, 64, 128, 300
    idx = random_slots(batch, num_slots, padding=[7, 200], device="cuda")
    x, dt, B, C, z = _inputs(batch, H, P, 1, N, torch.bfloat16, "cuda")
    A = -torch.rand(H, device="cuda") * 4
    D, dt_bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    states = torch.randn(num_slots, H, P, N, device="cuda")
    _check(states, x, dt, A, B, C, D, z, dt_bias, idx)
