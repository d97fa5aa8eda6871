"""The Mamba-1 selective scan (packed varlen, and the one-step decode update): the Triton kernel
and the PyTorch reference against a float64 loop written here from the paper's recurrence
(Gu & Dao 2023, Algorithm 2), element by element in (channel, state)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mambaserve import ops
from mambaserve.ops import varlen
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed, random_slots


def naive_scan(x, dt, A, B, C, D, z, dt_bias, states, lens, idx, has_init):
    """float64 y (T, dim) and the new pool, one token at a time: h <- exp(dt A) h + dt x B."""
    x, dt, A, B, C, D, z, dt_bias = (t.double() if t is not None else None for t in (x, dt, A, B, C, D, z, dt_bias))
    states = states.double().clone()
    y = torch.zeros_like(x)
    start = 0
    for i, n in enumerate(lens):
        slot = int(idx[i])
        h = states[slot].clone() if slot >= 0 and bool(has_init[i]) else torch.zeros(A.shape, dtype=torch.float64,
                                                                                     device=A.device)
        for t in range(start, start + n):
            delta = F.softplus(dt[t] + (dt_bias if dt_bias is not None else 0.0))  # (dim,)
            h = torch.exp(delta[:, None] * A) * h + delta[:, None] * x[t][:, None] * B[t][None, :]
            y[t] = (h * C[t][None, :]).sum(-1) + (D * x[t] if D is not None else 0.0)
            if z is not None:
                y[t] = y[t] * z[t] * torch.sigmoid(z[t])
        if slot >= 0:
            states[slot] = h
        start += n
    return y, states


def _inputs(T, dim, N, dtype, device, rank=3):
    """x, dt, z as column slices of one in_proj-like tensor; B, C of one x_proj-like tensor."""
    xz = torch.randn(T, 2 * dim + 5, device=device).to(dtype)
    x, z = xz[:, :dim], xz[:, dim + 5:]
    dt = (0.5 * torch.randn(T, dim, device=device) - 1.0).to(dtype)
    x_dbl = torch.randn(T, rank + 2 * N, device=device).to(dtype)
    B, C = x_dbl[:, rank:rank + N], x_dbl[:, rank + N:]
    A = -torch.exp(torch.randn(dim, N, device=device))  # a different rate per (channel, state)
    D = torch.randn(dim, device=device)
    dt_bias = 0.5 * torch.randn(dim, device=device)
    return x, dt, A, B, C, D, z, dt_bias


@pytest.fixture
def backend_of(monkeypatch):
    """impl name -> the ops backend to run; "triton" is the default config (chunks of 32 tokens);
    "triton-chunked" runs chunks of 4 tokens (sequences over several chunks, ending inside one,
    shorter than one); "triton-sequential" walks the tokens one by one."""
    from mambaserve.ops import mamba1_scan

    def select(impl):
        if impl == "triton-chunked":
            monkeypatch.setattr(mamba1_scan, "SCAN_CONFIG", {"block_d": 16, "num_warps": 4, "chunk": 4})
        if impl == "triton-sequential":
            monkeypatch.setattr(mamba1_scan, "SCAN_CONFIG", {"block_d": 16, "num_warps": 2, "chunk": 0})
        return "triton" if impl.startswith("triton") else impl

    return select


def _check_pool(ours, expected, before, idx, tol):
    written = {int(i) for i in idx if i >= 0}
    for slot in range(before.shape[0]):
        if slot in written:
            assert rel_err(ours[slot], expected[slot]) < tol, f"slot {slot}"
        else:
            assert torch.equal(ours[slot], before[slot]), f"untouched slot {slot} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["triton", "triton-chunked", "triton-sequential", "reference"])
@pytest.mark.parametrize("dtype,pool_dtype,N", [(torch.float32, torch.float32, 16), (torch.bfloat16, torch.float32, 24),
                                                (torch.bfloat16, torch.bfloat16, 16)])
@pytest.mark.slow
def test_selective_scan_packed_batch(device, impl, dtype, pool_dtype, N, backend_of):
    dim, num_slots = 40, 11  # dim: one full channel block and a partial one
    # decodes (length 1, with a state), fresh prompts, chunks continuing a state, an empty sequence
    lens = [1, 1, 7, 1, 3, 0, 12, 1]
    has = torch.tensor([True, True, False, True, True, True, False, False], device=device)
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[3, 6], device=device)
    x, dt, A, B, C, D, z, dt_bias = _inputs(T + 2, dim, N, dtype, device)  # two padding rows at the end
    states = torch.randn(num_slots, dim, N, device=device).to(pool_dtype)
    for i in range(len(lens)):  # slots written without being read: poisoned
        if idx[i] >= 0 and not has[i]:
            states[idx[i]] = float("nan")
    before, ours = states.clone(), states.clone()
    with ops.backend(backend_of(impl)):
        y = ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, ours, qsl, idx, has)
    ref_y, ref_states = naive_scan(x, dt, A, B, C, D, z, dt_bias, torch.nan_to_num(states), lens, idx.cpu(), has.cpu())
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y[:T], ref_y[:T]) < tolerance(dtype)
    _check_pool(ours, ref_states.to(pool_dtype), before, idx, max(tolerance(dtype), tolerance(pool_dtype)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_selective_scan_update_decode(device, impl, dtype):
    dim, N, num_slots, batch = 72, 16, 9, 6
    idx = random_slots(batch, num_slots, padding=[2], device=device)
    x, dt, A, B, C, D, z, dt_bias = _inputs(batch, dim, N, dtype, device)
    states = torch.randn(num_slots, dim, N, device=device)
    ours = states.clone()
    with ops.backend(impl):
        y = ops.selective_scan_update(ours, x, dt, A, B, C, D, z, dt_bias, idx)
    ref_y, ref_states = naive_scan(x, dt, A, B, C, D, z, dt_bias, states, [1] * batch, idx.cpu(), [True] * batch)
    assert rel_err(y, ref_y) < tolerance(dtype)
    _check_pool(ours, ref_states.float(), states, idx, tolerance(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_selective_scan_without_optional_inputs(device, backend_of):
    """No D, z or dt_bias, and dt taken as it is (dt_softplus=False)."""
    lens, dim, N = [4, 1, 6], 33, 16
    qsl, T = packed(lens, device)
    x, _, A, B, C, _, _, _ = _inputs(T, dim, N, torch.float32, device)
    dt = torch.rand(T, dim, device=device) * 0.3
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    has = torch.tensor([False, True, True], device=device)
    states = torch.randn(3, dim, N, device=device)
    results = []
    for impl in ("triton", "reference", "triton-chunked", "triton-sequential"):
        pool = states.clone()
        with ops.backend(backend_of(impl)):
            results.append((ops.selective_scan(x, dt, A, B, C, None, None, None, pool, qsl, idx, has,
                                               dt_softplus=False), pool))
    # softplus^-1(dt) through the naive loop's softplus is the same dt
    ref_y, ref_states = naive_scan(x, torch.log(torch.expm1(dt.double())), A, B, C, None, None, None, states, lens,
                                   idx.cpu(), has.cpu())
    for y, pool in results:
        assert rel_err(y, ref_y) < tolerance(torch.float32)
        assert rel_err(pool, ref_states) < tolerance(torch.float32)


def test_selective_scan_bad_shapes_are_value_errors():
    T, dim, N = 5, 8, 4
    x, dt, A, B, C, D, z, dt_bias = _inputs(T, dim, N, torch.float32, "cpu")
    qsl, _ = packed([2, 3], "cpu")
    idx, has = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([False, False])
    pool = torch.zeros(2, dim, N)
    with pytest.raises(ValueError, match="A must be"):
        ops.selective_scan(x, dt, A[:, None], B, C, D, z, dt_bias, pool, qsl, idx, has)  # Mamba2-style A
    with pytest.raises(ValueError, match="ssm_states must be"):
        ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, pool[:, :, :2], qsl, idx, has)
    with pytest.raises(ValueError, match="B and C must be"):
        ops.selective_scan(x, dt, A, B[:, :2], C, D, z, dt_bias, pool, qsl, idx, has)
    with pytest.raises(ValueError, match="state_indices must be"):
        ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, pool, qsl, idx[:1], has)
    with pytest.raises(ValueError, match="state_indices must be"):
        ops.selective_scan_update(pool, x, dt, A, B, C, D, z, dt_bias, idx)



@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("offsets", [[0, 2, 6], [0, 3, 2], [-1, 2, 5]])
def test_selective_scan_bad_offsets_are_value_errors(impl, offsets):
    """Offsets past x's rows, decreasing or below 0: refused, not read out of bounds."""
    x, dt, A, B, C, D, z, dt_bias = _inputs(5, 8, 4, torch.float32, "cpu")
    qsl = torch.tensor(offsets, dtype=torch.int32)
    idx, has = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([False, False])
    with ops.backend(impl), pytest.raises(ValueError, match="query_start_loc"):
        ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, torch.zeros(2, 8, 4), qsl, idx, has)
    # the step's host copy: checked where it is made (check_offsets), its end and size by the op
    with ops.backend(impl), pytest.raises(ValueError, match="query_start_loc"):
        ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, torch.zeros(2, 8, 4), qsl, idx, has,
                           query_start_loc_host=varlen.check_offsets(offsets))
    if impl == "triton":
        with ops.backend(impl), pytest.raises(ValueError, match="query_start_loc_host has 2 offsets"):
            ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, torch.zeros(2, 8, 4), qsl, idx, has,
                               query_start_loc_host=np.array([0, 2]))


@gpu_only
@pytest.mark.parametrize("impl", ["triton", "triton-chunked", "triton-sequential"])
def test_selective_scan_130m_shapes_gpu(impl, backend_of):
    """mamba-130m's layer (d_inner 1,536, d_state 16): a 1,000-token prompt beside 64 decodes, bf16."""
    backend_of(impl)
    lens = [1] * 64 + [1000, 37]
    qsl, T = packed(lens, "cuda")
    idx = random_slots(len(lens), 80, padding=[5], device="cuda")
    has = torch.ones(len(lens), dtype=torch.bool, device="cuda")
    has[-2] = False
    x, dt, A, B, C, D, z, dt_bias = _inputs(T, 1536, 16, torch.bfloat16, "cuda", rank=48)
    states = torch.randn(80, 1536, 16, device="cuda")
    ours = states.clone()
    y = ops.selective_scan(x, dt, A, B, C, D, z, dt_bias, ours, qsl, idx, has)
    ref_states = states.clone()
    expected = ops.reference.selective_scan(x, dt, A, B, C, D, z, dt_bias, ref_states, qsl, idx, has)
    assert rel_err(y, expected) < tolerance(torch.bfloat16)
    assert rel_err(ours, ref_states) < tolerance(torch.bfloat16)
