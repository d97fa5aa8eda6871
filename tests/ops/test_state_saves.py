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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["roll", "tile"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_saves_written_by_the_conv_launch(device, kernel, state_dtype):
    """The save programs of the conv launch (both kernels) leave in each save row exactly the
    width - 1 rows of x before its offset, in the state dtype, and touch no other row."""
    width, dim = 4, 40
    T = sum(LENS)
    x = torch.randn(T, dim + 2, device=device, dtype=torch.bfloat16)[:, 2:]
    w, bias = torch.randn(dim, width, device=device), torch.randn(dim, device=device)
    states = torch.randn(NUM_ROWS, width - 1, dim, device=device).to(state_dtype)
    qsl, idx, has, saves, ours = _batch(states, device)
    cfg = {"kernel": "roll", "block_t": 8, "block_d": 16, "num_warps": 1, "group": 4} if kernel == "roll" else \
        {"kernel": "tile", "block_t": 8, "block_d": 16, "num_warps": 4}
    with ops.backend("triton"), ops.conv1d.config_override(varlen=cfg):
        blocks = varlen.conv_token_blocks(varlen.check_offsets(qsl.tolist()), 8, device, saves)
        y = ops.causal_conv1d(x, w, bias, ours, qsl, idx, has, blocks=blocks, state_saves=saves)
        ref_states = states.clone()
        expected = ops.reference.causal_conv1d(x, w, bias, ref_states, qsl, idx, has)
    for i, o, r in SAVES:
        start = int(qsl[i])
        assert torch.equal(ours[r], x[start + o - (width - 1):start + o].to(state_dtype))
    saved = [r for _, _, r in SAVES]
    others = [r for r in range(NUM_ROWS) if r not in saved]
    assert torch.allclose(ours[others].float(), ref_states[others].float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_one_conv_plan_shared_by_layers_equals_separate_plans(device, poison_empty):
    """Layers of two widths and dims sharing the step's conv plan (its cached launch configs,
    its save programs) compute bit for bit what each computes with a plan of its own."""
    from mambaserve.forward_context import ForwardContext

    T = sum(LENS)
    ctx = ForwardContext.build(query_lens=LENS, seq_lens=[n + 5 for n in LENS], state_indices=SLOTS,
                               has_initial_state=HAS, block_tables=None, block_size=1, device=device,
                               state_saves=SAVES)
    layers = []
    for width, dim in ((4, 24), (3, 17)):
        x = torch.randn(T, dim, device=device)
        w, bias = torch.randn(dim, width, device=device), torch.randn(dim, device=device)
        layers.append((x, w, bias, torch.randn(NUM_ROWS, width - 1, dim, device=device)))
    with ops.backend("triton"):
        shared = [states.clone() for *_, states in layers]
        ys = [ops.causal_conv1d(x, w, b, s, ctx.query_start_loc, ctx.state_indices, ctx.has_initial_state,
                                blocks=ctx.conv_blocks(), state_saves=ctx.state_saves)
              for (x, w, b, _), s in zip(layers, shared)]
        assert len(ctx.conv_blocks().launch) == 2  # one config per (dim, width), built once
        for k, (x, w, b, states) in enumerate(layers):
            own = states.clone()
            blocks = varlen.conv_token_blocks(ctx.query_start_loc_host, ctx.conv_blocks().block_t, device,
                                              ctx.state_saves)
            y = ops.causal_conv1d(x, w, b, own, ctx.query_start_loc, ctx.state_indices, ctx.has_initial_state,
                                  blocks=blocks, state_saves=ctx.state_saves)
            assert torch.equal(y[:T], ys[k][:T]) and torch.equal(own, shared[k])


@pytest.mark.parametrize("device", DEVICES)
def test_conv_plan_of_other_saves_refused(device):
    T, dim, width = sum(LENS), 8, 4
    x, w = torch.randn(T, dim, device=device), torch.randn(dim, width, device=device)
    states = torch.randn(NUM_ROWS, width - 1, dim, device=device)
    qsl, idx, has, saves, _ = _batch(states, device)
    qsl_host = varlen.check_offsets(qsl.tolist())
    before = states.clone()
    with ops.backend("triton"):
        for blocks, call_saves in ((varlen.conv_token_blocks(qsl_host, 32, device), saves),
                                   (varlen.conv_token_blocks(qsl_host, 32, device, saves), varlen.NO_SAVES)):
            with pytest.raises(ValueError, match="planned for other state saves"):
                ops.causal_conv1d(x, w, None, states, qsl, idx, has, blocks=blocks, state_saves=call_saves)
    assert torch.equal(states, before)


def test_step_conv_plan_follows_a_config_override():
    from mambaserve.forward_context import ForwardContext

    ctx = ForwardContext.build(query_lens=LENS, seq_lens=LENS, state_indices=SLOTS, has_initial_state=[True] * 3,
                               block_tables=None, block_size=1, device="cpu")
    default = ctx.conv_blocks()
    assert ctx.conv_blocks() is default
    cfg = {"kernel": "roll", "block_t": 4, "block_d": 16, "num_warps": 1, "group": 4}
    with ops.conv1d.config_override(varlen=cfg):
        assert ctx.conv_blocks().block_t == 4
    assert ctx.conv_blocks().block_t == default.block_t != 4
