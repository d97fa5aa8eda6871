"""The SSD scan's steps 1 and 2 in one launch of `ssd._chunk_state_cb_kernel` (PART 0) against
the same two steps as launches of their own (PART 1: chunk states, PART 2: C B^T; what long
prefills run): bit for bit the same dt', cumsum, chunk totals, chunk states and C B^T, and the
same scan output either way."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import ssd, varlen
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed
from tests.ops.test_ssd import _inputs


def _launch(la, parts, x, dt, A, dt_bias, B, C, chunks, work, T, H, P, N, G, Q):
    nc = chunks.num_chunks
    num_state = nc * H * -(-P // la.state_cb_kw["BLOCK_P"]) * -(-N // la.state_cb_kw["BLOCK_N"])
    num_cb = nc * G * la.num_cb_m * -(-Q // la.state_cb_kw["CB_BLOCK_K"])
    for part in parts:
        grid, nsp = {0: (num_state + num_cb, num_state), 1: (num_state, num_state), 2: (num_cb, 0)}[part]
        ssd._chunk_state_cb_kernel[(grid,)](
            x, dt, A, dt_bias, B, C, chunks.chunk_start, chunks.chunk_end, *work[:4], work[5],
            T, H, P, N, H // G, la.lo, la.hi, G, Q, nsp, nc * G, la.num_cb_m,
            *x.stride(), *dt.stride(), *B.stride(), *C.stride(), PART=part, **la.state_cb_kw)


def _compare(H, P, N, G, Q, lens, dtype, device):
    qsl, T = packed(lens, device)
    x, dt, B, C, _ = _inputs(T, H, P, G, N, dtype, device)
    A, dt_bias = -torch.rand(H, device=device) - 0.1, torch.randn(H, device=device)
    chunks = varlen.ssd_chunks(varlen.check_offsets(qsl.tolist()), Q, device)
    la = ssd._launch_params(chunks, H, P, N, G, x, False, False, True, True, (0.0, float("inf")))
    fused = [t.fill_(float("nan")) for t in ssd._workspace(chunks, T, H, P, N, G, dtype, device)]
    apart = [t.fill_(float("nan")) for t in ssd._workspace(chunks, T, H, P, N, G, dtype, device)]
    args = (x, dt, A, dt_bias, B, C, chunks)
    _launch(la, (0,), *args, fused, T, H, P, N, G, Q)
    _launch(la, (1, 2), *args, apart, T, H, P, N, G, Q)
    for name, a, b in zip(("dt'", "cumsum", "chunk totals", "chunk states", "", "C B^T"), fused, apart):
        if name:
            assert not a.isnan().all(), name  # the launch wrote something
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_state_and_cb_in_one_launch_equal_separate_launches(device):
    _compare(H=4, P=16, N=16, G=2, Q=16, lens=[1, 37, 16], dtype=torch.float32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_scan_output_the_same_with_the_steps_launched_apart(device, monkeypatch):
    """ssd_chunk_scan launches the two steps apart from SEPARATE_CB_MIN_TOKENS tokens: the
    result and the final states are bit for bit those of the one launch."""
    H, P, N, G, Q, lens = 4, 16, 16, 2, 16, [5, 40, 16]
    qsl, T = packed(lens, device)
    x, dt, B, C, _ = _inputs(T, H, P, G, N, torch.float32, device)
    A, dt_bias, D = -torch.rand(H, device=device) - 0.1, torch.randn(H, device=device), torch.randn(H, device=device)
    init = torch.randn(4, H, P, N, device=device)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    has = torch.tensor([True, False, True], device=device)
    outs = []
    for threshold in (10**9, 0):
        monkeypatch.setattr(ssd, "SEPARATE_CB_MIN_TOKENS", threshold)
        states = init.clone()
        with ops.backend("triton"):
            y = ops.ssd_chunk_scan(x, dt, A, B, C, Q, D, None, dt_bias, states, qsl, idx, has)
        outs.append((y, states))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_and_cb_in_one_launch_equal_separate_launches_granite_gpu(dtype):
    """granite-4.0-tiny's sizes (48 heads of 64, dstate 128, one group, chunk 256)."""
    _compare(H=48, P=64, N=128, G=1, Q=256, lens=[384, 1, 1000], dtype=dtype, device="cuda")
