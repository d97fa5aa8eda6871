"""The verify-row ops (speculative decoding): one launch over k + 1 positions per sequence
against j + 1 decode steps of the float64 reference, every position's state in its own row."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference as ref
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES


def _tables(lens, num_rows, device, seed=0):
    """query_start_loc, slots, state_rows (padded -1), token_seq for sequences of `lens` positions;
    slots and rows drawn distinct from num_rows rows."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_rows, generator=g).tolist()
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    slots = [perm.pop() for _ in lens]
    rows = [[perm.pop() for _ in range(n)] + [-1] * (max(lens) - n) for n in lens]
    token_seq = [i for i, n in enumerate(lens) for _ in range(n)]
    i32 = dict(dtype=torch.int32, device=device)
    return (torch.tensor(qsl, **i32), torch.tensor(slots, **i32), torch.tensor(rows, **i32),
            torch.tensor(token_seq, **i32))


def _sequential(update, states, qsl, slots, rows, *row_args):
    """The float64 reference: per sequence, decode steps from its slot, each position's state
    copied out to its row. update(state (1, ...), [row args (1, ...)]) -> output, in place."""
    states = states.double().clone()
    outs = []
    for i in range(slots.shape[0]):
        work = states[int(slots[i])].clone()
        for j in range(int(qsl[i + 1] - qsl[i])):
            t = int(qsl[i]) + j
            scratch = work[None].clone()
            outs.append((t, update(scratch, [a[t : t + 1].double() for a in row_args])))
            work = scratch[0]
            states[int(rows[i, j])] = work
    return states, outs


def _check_rows(ours, before, expected, rows):
    written = {int(r) for r in rows.flatten() if r >= 0}
    for r in range(ours.shape[0]):
        if r in written:
            assert rel_err(ours[r], expected[r]) < tolerance(torch.float32), r
        else:
            assert torch.equal(ours[r], before[r]), f"row {r} (a slot, or untouched) changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_verify(device, backend, width):
    lens, dim, num_rows = [3, 1, 6, 2], 40, 24  # a one-position sequence, lengths past the width
    qsl, slots, rows, token_seq = _tables(lens, num_rows, device)
    x = torch.randn(sum(lens), dim + 3, device=device)[:, 3:]  # a column slice, stride 1 on dim
    w, b = torch.randn(dim, width, device=device), torch.randn(dim, device=device)
    states = torch.randn(num_rows, width - 1, dim, device=device)
    ours = states.clone()
    with ops.backend(backend):
        out = ops.causal_conv1d_verify(x, ours, w, b, qsl, slots, rows, token_seq)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    expected, outs = _sequential(
        lambda s, a: ref.causal_conv1d_update(a[0], s, w.double(), b.double(), idx)[0], states, qsl, slots, rows, x)
    for t, y in outs:
        assert rel_err(out[t], y) < tolerance(torch.float32), t
    _check_rows(ours, states, expected, rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("with_z", [False, True])
def test_ssd_state_verify(device, backend, with_z):
    lens, H, P, G, N, num_rows = [4, 1, 5], 4, 24, 2, 16, 20  # headdim 24: a partial block
    qsl, slots, rows, _ = _tables(lens, num_rows, device, seed=1)
    T = sum(lens)
    x = torch.randn(T, H, P, device=device)
    dt = torch.randn(T, H + 1, device=device)[:, 1:]
    B, C = torch.randn(T, G, N, device=device), torch.randn(T, G, N, device=device)
    z = torch.randn(T, H, P, device=device) if with_z else None
    A, D, dt_bias = -torch.rand(H, device=device) * 2, torch.randn(H, device=device), torch.randn(H, device=device)
    states = torch.randn(num_rows, H, P, N, device=device)
    ours = states.clone()
    limit = (0.01, 3.0)
    with ops.backend(backend):
        y = ops.ssd_state_verify(ours, x, dt, A, B, C, D, z, dt_bias, qsl, slots, rows, dt_limit=limit)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    args = (x, dt, B, C) + ((z,) if with_z else ())
    expected, outs = _sequential(
        lambda s, a: ref.ssd_state_update(s, a[0], a[1], A.double(), a[2], a[3], D.double(),
                                          a[4] if with_z else None, dt_bias.double(), idx, dt_limit=limit)[0],
        states, qsl, slots, rows, *args)
    for t, yt in outs:
        assert rel_err(y[t], yt) < tolerance(torch.float32), t
    _check_rows(ours, states, expected, rows)
