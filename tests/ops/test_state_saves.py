"""State checkpoints written inside a prefill chunk (`varlen.StateSaves`, prefix caching):
the SSD scan and the varlen conv with saves against the same sequences cut at each save into
separate calls (a step ending there), on both backends."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import varlen
from tests.ops.kernel_helpers import DEVICES, packed

H, P, N, Q, G = 2, 16, 16, 8, 1
# sequence 0 is a decode, 1 has two saves (one on a chunk boundary of the call, one off it), 2 none
LENS, HAS = [1, 29, 11], [True, True, False]
SAVES = [(1, 8, 5), (1, 19, 6)]  # (sequence, offset, state row)
SLOTS = [2, 0, 3]
NUM_ROWS = 8


def _saves(qsl_host):
    return varlen.StateSaves(*map(tuple, zip(*[(i, o, r, int(qsl_host[i])) for i, o, r in SAVES])))


def _batch(states, device):
    """The batch's offsets, slots, initial-state flags and saves, and a copy of the state
    tensor with the save rows poisoned (each must be written before any read)."""
    qsl, _ = packed(LENS, device)
    ours = states.clone()
    for _, _, row in SAVES:
        ours[row] = float("nan")
    return (qsl, torch.tensor(SLOTS, dtype=torch.int32, device=device), torch.tensor(HAS, device=device),
            _saves(varlen.check_offsets(qsl.tolist())), ours)


def _pieces():
    """(sequence, first row, last row (exclusive), row its final state goes to) of each cut call."""
    out, row = [], 0
    for i, n in enumerate(LENS):
        cuts = [o for j, o, _ in SAVES if j == i]
        bounds = [0, *cuts, n]
        for k in range(len(bounds) - 1):
            out.append((i, row + bounds[k], row + bounds[k + 1], k > 0))
        row += n
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ssd_chunk_scan_saves_equal_cut_calls(device, backend):
    T = sum(LENS)
    x, dt, B, C, z = (torch.randn(T, H, P, device=device), torch.randn(T, H, device=device),
                      torch.randn(T, G, N, device=device) / 4, torch.randn(T, G, N, device=device) / 4,
                      torch.randn(T, H, P, device=device))
    A, D, dt_bias = -torch.rand(H, device=device) - 0.1, torch.randn(H, device=device), torch.randn(H, device=device)
    states = torch.randn(NUM_ROWS, H, P, N, device=device)
    qsl, idx, has, saves, ours = _batch(states, device)
    with ops.backend(backend):
        chunks = varlen.ssd_chunks(varlen.check_offsets(qsl.tolist()), Q, device, saves)
        y = ops.ssd_chunk_scan(x, dt, A, B, C, Q, D, z, dt_bias, ours, qsl, idx, has, chunks=chunks,
                               state_saves=saves)
        # the same work as separate one-sequence calls, each piece ending where a save is
        cut, y_cut = states.clone(), torch.full_like(y, float("nan"))
        for i, a, b, cont in _pieces():
            one = torch.tensor([0, b - a], dtype=torch.int32, device=device)
            y_cut[a:b] = ops.ssd_chunk_scan(x[a:b], dt[a:b], A, B[a:b], C[a:b], Q, D, z[a:b], dt_bias, cut, one,
                                            idx[i:i + 1], torch.tensor([HAS[i] or cont], device=device))
            save = [r for j, o, r in SAVES if j == i and a - int(qsl[i]) + (b - a) == o]
            if save:
                cut[save[0]] = cut[SLOTS[i]]
    assert torch.allclose(y, y_cut, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours, cut, rtol=1e-5, atol=1e-5)  # slots, saved rows; other rows untouched
    untouched = [r for r in range(NUM_ROWS) if r not in SLOTS and r not in [s[2] for s in SAVES]]
    assert torch.equal(ours[untouched], states[untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_saves_equal_cut_calls(device, backend, width):
    T, dim = sum(LENS), 24
    x = torch.randn(T, dim + 3, device=device)[:, 1:dim + 1]  # a column slice, as in the models
    w, bias = torch.randn(dim, width, device=device), torch.randn(dim, device=device)
    states = torch.randn(NUM_ROWS, width - 1, dim, device=device)
    qsl, idx, has, saves, ours = _batch(states, device)
    with ops.backend(backend):
        y = ops.causal_conv1d(x, w, bias, ours, qsl, idx, has, state_saves=saves)
        cut, y_cut = states.clone(), torch.full_like(y, float("nan"))
        for i, a, b, cont in _pieces():
            one = torch.tensor([0, b - a], dtype=torch.int32, device=device)
            y_cut[a:b] = ops.causal_conv1d(x[a:b], w, bias, cut, one, idx[i:i + 1],
                                           torch.tensor([HAS[i] or cont], device=device))
            save = [r for j, o, r in SAVES if j == i and a - int(qsl[i]) + (b - a) == o]
            if save:
                cut[save[0]] = cut[SLOTS[i]]
    assert torch.allclose(y, y_cut, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours, cut)


@pytest.mark.parametrize("device", DEVICES)
def test_state_saves_refused_where_they_cannot_be_written(device):
    qsl_host = varlen.check_offsets([0, 1, 30])
    with pytest.raises(ValueError, match="offset 29 of sequence 1"):
        varlen.StateSaves((1,), (29,), (5,), (1,)).check(qsl_host)  # at the end: the slot's final state
    with pytest.raises(ValueError, match="starts at row 0"):
        varlen.StateSaves((1,), (8,), (5,), (0,)).check(qsl_host)
    with pytest.raises(ValueError, match="sorted"):
        varlen.StateSaves((1, 1), (9, 8), (5, 6), (1, 1))
    x = torch.randn(30, 8, device=device)
    w, states = torch.randn(8, 4, device=device), torch.randn(8, 3, 8, device=device)
    qsl = torch.tensor([0, 1, 30], dtype=torch.int32, device=device)
    idx, has = torch.tensor([0, 1], dtype=torch.int32, device=device), torch.tensor([True, False], device=device)
    before = states.clone()
    with ops.backend("triton"), pytest.raises(ValueError, match="needs the 3 rows before it"):
        ops.causal_conv1d(x, w, None, states, qsl, idx, has, state_saves=varlen.StateSaves((1,), (2,), (5,), (1,)))
    with pytest.raises(ValueError, match="outside the 8 rows"):
        ops.causal_conv1d(x, w, None, states, qsl, idx, has, state_saves=varlen.StateSaves((1,), (8,), (9,), (1,)))
    assert torch.equal(states, before)  # refused before anything was written
