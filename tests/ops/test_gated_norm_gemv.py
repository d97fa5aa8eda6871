"""The Mamba2 decode step's gated norm folded into out_proj: `ssd_state_update(..., norm_sq=True)`
(the norm's sums of squares beside y) and `gated_norm_linear_partials` (the norm in the split-K
product's prologue), on the Triton path (the interpreter on the CPU) against float64 references
of the same math: rms_norm_gated then the product, and the sums of squares of the gated y. Small
awkward shapes (1 token, head sizes that leave a partial block, non-power-of-2 output sizes,
several groups, the norm before and after the gate), NaN-poisoned outputs, padded slots."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference as ref
from mambaserve.ops.state_update import gated_sum_of_squares
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, random_slots

pytestmark = pytest.mark.usefixtures("fusions_on")  # the fused decode paths are opt-in in the engine



DEVICE = DEVICES[0]


def _state_update_inputs(batch, H, P, G, N, dtype, num_slots=9):
    d = dict(device=DEVICE)
    x = torch.randn(batch, H, P, **d).to(dtype)
    dt = torch.randn(batch, H, **d).to(dtype)
    B, C = (torch.randn(batch, G, N, **d).to(dtype) for _ in range(2))
    A = -torch.rand(H, **d) * 2
    D, dt_bias = torch.randn(H, **d), torch.randn(H, **d)
    states = torch.randn(num_slots, H, P, N, **d)
    idx = random_slots(batch, num_slots, padding=[0] if batch > 1 else [], device=DEVICE)
    return states, x, dt, A, B, C, D, dt_bias, idx


@pytest.mark.parametrize("batch,H,P,G,N", [(1, 3, 16, 1, 8), (5, 4, 24, 2, 16)])  # headdim 24: a partial block
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_update_sums_of_squares(poison_empty, batch, H, P, G, N, gated, dtype):
    states, x, dt, A, B, C, D, dt_bias, idx = _state_update_inputs(batch, H, P, G, N, dtype)
    gate = torch.randn(batch, H, P + 3, device=DEVICE).to(dtype)[:, :, 3:] if gated else None  # strided
    plain_states, fused_states = states.clone(), states.clone()
    with ops.backend("triton"):
        y_plain = ops.ssd_state_update(plain_states, x, dt, A, B, C, D, None, dt_bias, idx)
        y, sq = ops.ssd_state_update(fused_states, x, dt, A, B, C, D, None, dt_bias, idx, norm_sq=True,
                                     norm_gate=gate)
    assert torch.equal(y, y_plain) and torch.equal(fused_states, plain_states)  # the state update is unchanged
    assert sq.dtype == torch.float32 and sq.shape[:2] == (batch, H)
    v = y.double() * (torch.nn.functional.silu(gate.double()) if gated else 1.0)  # y as returned, rounded
    assert rel_err(sq.sum(-1), v.pow(2).sum(-1)) < tolerance(torch.float32)
    ref_sq = gated_sum_of_squares(y, gate)
    assert ref_sq.shape == (batch, H, 1) and rel_err(ref_sq[..., 0], v.pow(2).sum(-1)) < tolerance(torch.float32)
    with ops.backend("reference"):  # the reference's pair: the same y and its sums
        y_ref, sq_ref = ops.ssd_state_update(states.clone(), x, dt, A, B, C, D, None, dt_bias, idx, norm_sq=True,
                                             norm_gate=gate)
    assert rel_err(y, y_ref) < tolerance(dtype)
    assert rel_err(sq.sum(-1), sq_ref[..., 0]) < 4 * tolerance(dtype)


def _norm_inputs(T, H, P, G, N_out, dtype, z_stride_pad=5):
    K = H * P
    y = torch.randn(T, H, P, device=DEVICE).to(dtype)
    zfull = torch.randn(T, K + z_stride_pad, device=DEVICE).to(dtype)
    z = zfull[:, z_stride_pad:]  # a column slice of a wider tensor, as in_proj's z
    norm_w = (1 + 0.3 * torch.randn(K, device=DEVICE)).to(dtype)
    w = torch.randn(N_out, K, device=DEVICE).to(dtype) / K**0.5
    return y, z, norm_w, w


def _expected(y, z, norm_w, w, eps, group_size, norm_before_gate):
    """float64: w @ rms_norm_gated(y, z) (rounded to y's dtype, as the norm's output is)."""
    normed = ref.rms_norm_gated(y.double(), norm_w.double(), z.double(), eps, group_size, norm_before_gate)
    return normed.to(y.dtype).double() @ w.double().t()


@pytest.mark.parametrize("T,H,P,G,N_out", [(1, 3, 16, 1, 37), (5, 6, 16, 2, 40),
                                           pytest.param(16, 4, 24, 4, 19, marks=pytest.mark.slow)])  # 16: the most rows
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_linear_partials(poison_empty, T, H, P, G, N_out, norm_before_gate, dtype):
    """The one-launch path (group sizes 48, 48, 24: blocks of 16 and 8 features) against float64."""
    y, z, norm_w, w = _norm_inputs(T, H, P, G, N_out, dtype)
    K, eps, group_size = H * P, 1e-5, H * P // G
    gate = None if norm_before_gate else z.reshape(T, H, P)
    sq = gated_sum_of_squares(y, gate).float()  # (T, H, 1): parts may be 1
    # spread each head's sum over 3 parts, as a launch with several row blocks leaves it
    sq3 = torch.cat([sq * 0.25, sq * 0.5, sq * 0.25], dim=-1)
    expected = _expected(y.view(T, K), z, norm_w, w, eps, group_size, norm_before_gate)
    with ops.backend("triton"):
        for s in (sq, sq3):
            parts = ops.gated_norm_linear_partials(y.view(T, K), z, s, norm_w, eps, group_size, norm_before_gate, w)
            assert parts.dtype == torch.float32 and parts.shape[1:] == (T, N_out) and parts.shape[0] > 1
            assert rel_err(parts.sum(0), expected) < tolerance(dtype)
        with ops.unfused():  # the norm kernel and the split-K product, as before
            split = ops.linear_partials(
                ops.rms_norm_gated(y.view(T, K), norm_w, z, eps, group_size, norm_before_gate), w)
    assert rel_err(parts.sum(0), split.sum(0)) < tolerance(dtype)


def test_gated_norm_linear_partials_falls_back_where_blocks_do_not_fit():
    """A group of 12 features (no power-of-two block of 8 or more divides it), and unfused():
    the two ops themselves, whatever sq holds."""
    T, H, P, G = 2, 3, 4, 1
    y, z, norm_w, w = _norm_inputs(T, H, P, G, 7, torch.float32)
    K = H * P
    junk = torch.full((T, H, 2), float("nan"), device=DEVICE)  # not read on these paths
    expected = _expected(y.view(T, K), z, norm_w, w, 1e-5, K, False)
    with ops.backend("triton"):
        out = ops.gated_norm_linear_partials(y.view(T, K), z, junk, norm_w, 1e-5, K, False, w)
    assert rel_err(out.sum(0), expected) < tolerance(torch.float32)
    y2, z2, nw2, w2 = _norm_inputs(T, 4, 16, 2, 9, torch.float32)
    junk2 = torch.full((T, 4, 1), float("nan"), device=DEVICE)
    with ops.backend("triton"), ops.unfused():
        out = ops.gated_norm_linear_partials(y2.view(T, 64), z2, junk2, nw2, 1e-5, 32, False, w2)
    assert rel_err(out.sum(0), _expected(y2.view(T, 64), z2, nw2, w2, 1e-5, 32, False)) < tolerance(torch.float32)


def test_gated_norm_linear_partials_rejects_bad_shapes():
    y, z, norm_w, w = _norm_inputs(2, 4, 16, 2, 9, torch.float32)
    y = y.view(2, 64)
    sq = torch.ones(2, 4, 1)
    cases = [
        (dict(z=z[:, :32]), "y and z"), (dict(group_size=24), "multiple of group_size"),
        (dict(norm_weight=norm_w[:32]), "norm_weight"), (dict(weight=w[:, :32]), "weight must be"),
        (dict(sq=torch.ones(2, 3, 1)), "sq must be"), (dict(group_size=0), "group_size"),
    ]
    args = dict(y=y, z=z, sq=sq, norm_weight=norm_w, eps=1e-5, group_size=32, norm_before_gate=False, weight=w)
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.gated_norm_linear_partials(**{**args, **change})
