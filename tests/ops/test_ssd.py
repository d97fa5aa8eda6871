"""Triton SSD chunked scan against the PyTorch reference."""

import math

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference as ref
from mambaserve.ops import ssd, varlen
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed, random_slots


def _inputs(T, H, P, G, N, dtype, device):
    """x, dt, B, C, z as views into in_proj/conv-shaped tensors (non-contiguous rows)."""
    xbc = torch.randn(T, H * P + 2 * G * N + 5, device=device).to(dtype)
    x = xbc[:, :H * P].view(T, H, P)
    B = xbc[:, H * P:H * P + G * N].view(T, G, N)
    C = xbc[:, H * P + G * N:H * P + 2 * G * N].view(T, G, N)
    dt = torch.randn(T, H + 3, device=device).to(dtype)[:, 1:H + 1]
    z = torch.randn(T, H, P, device=device).to(dtype)
    return x, dt, B, C, z


def _check(x, dt, A, B, C, Q, D, z, dt_bias, states, qsl, idx, has, dt_softplus=True,
           dt_limit=(0.0, math.inf), chunks=None):
    ours, expected_states = states.clone(), states.clone()
    with ops.backend("triton"):
        y = ops.ssd_chunk_scan(x, dt, A, B, C, Q, D, z, dt_bias, ours, qsl, idx, has,
                                 dt_softplus=dt_softplus, dt_limit=dt_limit, chunks=chunks)
    expected = ref.ssd_chunk_scan(x, dt, A, B, C, Q, D, z, dt_bias, expected_states, qsl, idx, has,
                                    dt_softplus=dt_softplus, dt_limit=dt_limit)
    assert rel_err(y, expected) < tolerance(x.dtype)
    state_tol = max(tolerance(x.dtype), tolerance(states.dtype))
    written = {int(i) for i in idx if i >= 0}
    for slot in range(states.shape[0]):
        if slot in written:
            assert rel_err(ours[slot], expected_states[slot]) < state_tol, f"slot {slot}"
        else:
            assert torch.equal(ours[slot], states[slot]), f"untouched slot {slot} changed"
    return y, ours


def _poison_fresh_slots(states, idx, has):
    """Slots of sequences without an initial state must be written and never read."""
    for i in range(idx.shape[0]):
        if idx[i] >= 0 and not has[i]:
            states[idx[i]] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ngroups", [1, 3])
@pytest.mark.slow
def test_ssd_chunk_scan_mixed_batch(device, dtype, ngroups):
    H, P, N, Q, num_slots = 3, 24, 16, 8, 16
    # lengths 1, 2, 3, Q - 1, Q, Q + 1, several chunks, then one-token decodes
    lens = [1, 2, 3, Q - 1, Q, Q + 1, 3 * Q + 5, 1, 1, 1]
    has = torch.tensor([True, False, True, True, False, True, False, True, True, False], device=device)
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[2, 8], device=device)
    x, dt, B, C, z = _inputs(T, H, P, ngroups, N, dtype, device)
    A = -torch.rand(H, device=device) * 2 - 0.1
    D = torch.randn(H, device=device)
    dt_bias = torch.randn(H, device=device)
    states = torch.randn(num_slots, H, P, N, device=device)
    _poison_fresh_slots(states, idx, has)
    limit = (0.0, math.inf) if ngroups == 1 else (0.01, 3.0)
    _check(x, dt, A, B, C, Q, D, z, dt_bias, states, qsl, idx, has, dt_limit=limit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]
)
@pytest.mark.slow
def test_ssd_chunk_scan_options(device, dtype, pool_dtype):
    """Low-precision state pools; no D, z, dt_bias or softplus (first case) and a chunk size
    that is not a power of two (second case)."""
    H, P, N, G, num_slots = 4, 16, 32, 2, 6
    plain = dtype == torch.bfloat16
    Q = 16 if plain else 12
    lens = [Q + 3, 2 * Q, 1, 5]
    has = torch.tensor([True, True, True, False], device=device)
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[], device=device)
    x, dt, B, C, z = _inputs(T, H, P, G, N, dtype, device)
    if plain:
        dt = (torch.rand(T, H, device=device) * 0.5).to(dtype)  # used as dt' directly: keep it positive
    A = -torch.rand(H, device=device) - 0.1
    D = None if plain else torch.randn(H, device=device)
    dt_bias = None if plain else torch.randn(H, device=device)
    states = torch.randn(num_slots, H, P, N, device=device).to(pool_dtype)
    _poison_fresh_slots(states, idx, has)
    _check(x, dt, A, B, C, Q, D, None if plain else z, dt_bias, states, qsl, idx, has,
           dt_softplus=not plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,fp32_intermediates", [(torch.float32, True), (torch.bfloat16, True),
                                                      (torch.bfloat16, False)])
@pytest.mark.slow
def test_ssd_chunk_scan_many_blocks_per_chunk(device, dtype, fp32_intermediates, monkeypatch):
    """Blocks smaller than the chunk (as at chunk 256 on the GPU): several row blocks per chunk
    in every kernel, blocks wholly below the diagonal, dstate split in the C B^T kernel and in
    the chunk scan's state read-out, several state blocks per head in the state passing; C B^T
    and the chunk states stored in float32 or in x's dtype."""
    monkeypatch.setattr(ssd, "CB_FP32", fp32_intermediates)
    monkeypatch.setattr(ssd, "CHUNK_STATES_FP32", fp32_intermediates)
    monkeypatch.setattr(ssd, "CHUNK_STATE_CONFIG", dict(ssd.CHUNK_STATE_CONFIG, block_k=16, block_n=16))
    monkeypatch.setattr(ssd, "CB_CONFIG", dict(ssd.CB_CONFIG, block_m=16, block_k=16, block_n=16))
    small_blocks = dict(ssd.SCAN_CONFIG, block_m=16, block_k=16, block_p=16, block_n=16)
    monkeypatch.setattr(ssd, "SCAN_CONFIG", small_blocks)
    monkeypatch.setattr(ssd, "SCAN_CONFIG_SMALL_STATE", small_blocks)  # N = 32 takes this one
    monkeypatch.setattr(ssd, "PASSING_CONFIG", dict(ssd.PASSING_CONFIG, block=128))
    H, P, N, G, Q, num_slots = 2, 24, 32, 2, 48, 5
    lens = [2 * Q + 37, Q - 1, 1]
    has = torch.tensor([True, False, True], device=device)
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[], device=device)
    x, dt, B, C, z = _inputs(T, H, P, G, N, dtype, device)
    A = -torch.rand(H, device=device) - 0.1
    states = torch.randn(num_slots, H, P, N, device=device)
    _poison_fresh_slots(states, idx, has)
    _check(x, dt, A, B, C, Q, torch.randn(H, device=device), z, torch.randn(H, device=device),
           states, qsl, idx, has)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_ssd_chunk_scan_split_prompt_continues(device):
    """A prompt scanned in two calls (the second from the state the first wrote) gives the
    output of one call; chunks built from the host offsets give what a device read gives, and
    chunks of another size or batch are refused."""
    H, P, N, Q, L1, L2 = 2, 16, 16, 8, 11, 14
    x, dt, B, C, z = _inputs(L1 + L2, H, P, 1, N, torch.float32, device)
    A = -torch.rand(H, device=device) - 0.1
    states = torch.zeros(2, H, P, N, device=device)
    idx = torch.tensor([1], dtype=torch.int32, device=device)
    no, yes = (torch.tensor([v], device=device) for v in (False, True))
    whole, _ = packed([L1 + L2], device)
    first, _ = packed([L1], device)
    second, _ = packed([L2], device)
    chunks = varlen.ssd_chunks(varlen.check_offsets([0, L1 + L2]), Q, device)
    with ops.backend("triton"):
        y = ops.ssd_chunk_scan(x, dt, A, B, C, Q, None, z, None, states.clone(), whole, idx, no, chunks=chunks)
        assert torch.equal(y, ops.ssd_chunk_scan(x, dt, A, B, C, Q, None, z, None, states.clone(), whole, idx, no))
        for other in (varlen.ssd_chunks(varlen.check_offsets([0, L1 + L2]), Q // 2, device),
                      varlen.ssd_chunks(varlen.check_offsets([0, L1, L1 + L2]), Q, device)):
            with pytest.raises(ValueError, match="SSD chunks"):
                ops.ssd_chunk_scan(x, dt, A, B, C, Q, None, z, None, states.clone(), whole, idx, no, chunks=other)
        s = states.clone()
        y1 = ops.ssd_chunk_scan(x[:L1], dt[:L1], A, B[:L1], C[:L1], Q, None, z[:L1], None, s, first, idx, no)
        y2 = ops.ssd_chunk_scan(x[L1:], dt[L1:], A, B[L1:], C[L1:], Q, None, z[L1:], None, s, second, idx, yes)
    assert rel_err(torch.cat([y1, y2]), y) < tolerance(torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_ssd_chunk_scan_layers_sharing_a_plan(device):
    """Two layers' calls with one plan (the step's, whose intermediates they share) each give
    what a call with a plan of its own gives."""
    H, P, N, Q, lens = 2, 16, 16, 8, [1, 13, 9]
    qsl, T = packed(lens, device)
    idx = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    has = torch.tensor([True, False, True], device=device)
    plan = varlen.ssd_chunks(varlen.check_offsets(qsl.tolist()), Q, device)
    with ops.backend("triton"):
        for layer in range(2):
            x, dt, B, C, z = _inputs(T, H, P, 1, N, torch.float32, device)
            A = -torch.rand(H, device=device) - 0.1
            states = torch.randn(3, H, P, N, device=device)
            shared, own = states.clone(), states.clone()
            y = ops.ssd_chunk_scan(x, dt, A, B, C, Q, None, z, None, shared, qsl, idx, has, chunks=plan)
            alone = ops.ssd_chunk_scan(x, dt, A, B, C, Q, None, z, None, own, qsl, idx, has,
                                       chunks=varlen.ssd_chunks(varlen.check_offsets(qsl.tolist()), Q, device))
            assert torch.equal(y, alone) and torch.equal(shared, own), f"layer {layer}"
    assert len(plan.workspace) == 1


# --- sizes too large for the interpreter -------------------------------------------------


@gpu_only
def test_ssd_chunk_scan_long_prompt_gpu(poison_empty):
    """A 31,500-token prompt (chunk 256, dstate 128, headdim 64) and three decodes with
    initial states, bfloat16 activations and a float32 state pool."""
    H, P, N, G, Q, num_slots = 8, 64, 128, 1, 256, 8
    lens = [31500, 1, 1, 1]
    has = torch.tensor([False, True, True, True], device="cuda")
    qsl, T = packed(lens, "cuda")
    idx = random_slots(len(lens), num_slots, padding=[2], device="cuda")
    x, dt, B, C, z = _inputs(T, H, P, G, N, torch.bfloat16, "cuda")
    A = -torch.rand(H, device="cuda") * 4 - 0.5
    D = torch.randn(H, device="cuda")
    dt_bias = torch.randn(H, device="cuda") - 2.0
    states = torch.randn(num_slots, H, P, N, device="cuda")
    _poison_fresh_slots(states, idx, has)
    _check(x, dt, A, B, C, Q, D, z, dt_bias, states, qsl, idx, has)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.slow
def test_ssd_chunk_scan_final_states_at_strong_decay(device, chunk_size):
    """dt' A of -1e3..-1e4 per token: the in-chunk cumsum reaches -1e5 and more, where one
    float32 ulp is 1e-2. Every chunk state is sum_l exp(cs_end - cs_l) dt'_l x_l B_l^T, so
    cs_end must be the cumsum of the chunk's last row itself: a chunk total summed in another
    order differs by ulps and scaled each chunk state by exp(ulps), a relative error near 1e-3
    (the final states are dominated by the last tokens; float32 must hold to 2e-4)."""
    H, P, N, G, num_slots = 4, 16, 16, 2, 5
    lens = [chunk_size, 2 * chunk_size + 5, chunk_size - 3]
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[], device=device)
    has = torch.tensor([False, True, False], device=device)
    x, _, B, C, z = _inputs(T, H, P, G, N, torch.float32, device)
    dt = 50.0 + 50.0 * torch.rand(T, H, device=device)  # used as dt' directly (no softplus)
    A = -50.0 - 50.0 * torch.rand(H, device=device)
    states = torch.randn(num_slots, H, P, N, device=device)
    ours, expected = states.clone(), states.clone()
    with ops.backend("triton"):
        ops.ssd_chunk_scan(x, dt, A, B, C, chunk_size, None, None, None, ours, qsl, idx, has, dt_softplus=False)
    ref.ssd_chunk_scan(x, dt, A, B, C, chunk_size, None, None, None, expected, qsl, idx, has, dt_softplus=False)
    for slot in idx.tolist():
        assert rel_err(ours[slot], expected[slot]) < tolerance(torch.float32), f"slot {slot}"
