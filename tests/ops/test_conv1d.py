"""Triton causal conv1d kernels against the PyTorch reference."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import conv1d, varlen
from mambaserve.ops import reference as ref
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed, random_slots


def _run_both(x, w, b, states, qsl, idx, has, activation, blocks=None):
    """(ours, our states, reference, reference states) from the same inputs."""
    ours_states, ref_states = states.clone(), states.clone()
    with ops.backend("triton"):
        out = ops.causal_conv1d(x, w, b, ours_states, qsl, idx, has, activation, blocks=blocks)
    expected = ref.causal_conv1d(x, w, b, ref_states, qsl, idx, has, activation)
    return out, ours_states, expected, ref_states


def _check_states(ours, expected, before, idx):
    """Written slots equal the reference bit for bit (they are copies of inputs); every other
    slot is bit-identical to what it was."""
    written = {int(i) for i in idx if i >= 0}
    for slot in range(before.shape[0]):
        if slot in written:
            assert torch.equal(ours[slot], expected[slot]), f"slot {slot} differs from the reference"
        else:
            assert torch.equal(ours[slot], before[slot]), f"untouched slot {slot} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,width,activation,with_bias",
    [(torch.float32, 4, "silu", True), (torch.bfloat16, 4, "silu", True), (torch.float32, 3, None, False)],
)
@pytest.mark.slow
def test_causal_conv1d_mixed_batch(device, dtype, width, activation, with_bias):
    dim, num_slots = 300, 16  # dim is not a multiple of the feature block
    # prefills longer than a token block, shorter than the conv width, an empty sequence, decodes
    lens = [1, 2, 3, 70, 1, 0, 5, 1, 130, 1]
    has = torch.tensor([True, True, False, True, True, False, False, True, True, True], device=device)
    qsl, T = packed(lens, device)
    idx = random_slots(len(lens), num_slots, padding=[4, 7], device=device)
    wide = torch.randn(T, dim + 77, device=device).to(dtype)
    x = wide[:, 40:40 + dim]  # a column slice, row stride dim + 77
    w = torch.randn(dim, width, device=device).to(dtype)
    b = torch.randn(dim, device=device).to(dtype) if with_bias else None
    states = torch.randn(num_slots, width - 1, dim, device=device).to(dtype)
    for i in range(len(lens)):  # slots that must be written without being read
        if idx[i] >= 0 and not has[i]:
            states[idx[i]] = float("nan")
    out, ours, expected, ref_states = _run_both(x, w, b, states, qsl, idx, has, activation)
    assert rel_err(out, expected) < tolerance(dtype)
    _check_states(ours, ref_states, states, idx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_causal_conv1d_takes_the_step_plan(device):
    """Token blocks built from the step's host offsets give what blocks built from a device read
    give; blocks of another batch or block size are refused."""
    dim, width = 40, 4
    qsl, T = packed([5, 1, 9], device)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    has = torch.tensor([False, True, True], device=device)
    x = torch.randn(T, dim, device=device)
    w = torch.randn(dim, width, device=device)
    states = torch.randn(3, width - 1, dim, device=device)
    first = _run_both(x, w, None, states, qsl, idx, has, "silu")
    block_t = conv1d.CONV_CONFIG["block_t"]
    blocks = varlen.conv_token_blocks(varlen.check_offsets([0, 5, 6, 15]), block_t, device)
    second = _run_both(x, w, None, states, qsl, idx, has, "silu", blocks)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for other in (varlen.conv_token_blocks(varlen.check_offsets([0, 5, 6]), block_t, device),
                  varlen.conv_token_blocks(varlen.check_offsets([0, 5, 6, 15]), block_t // 2, device)):
        with pytest.raises(ValueError, match="token blocks"):
            _run_both(x, w, None, states, qsl, idx, has, "silu", other)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_causal_conv1d_update(device, dtype):
    batch, dim, width, num_slots = 7, 300, 4, 11
    idx = random_slots(batch, num_slots, padding=[1, 5], device=device)
    x = torch.randn(batch, dim + 9, device=device).to(dtype)[:, 3:3 + dim]
    w = torch.randn(dim, width, device=device).to(dtype)
    b = torch.randn(dim, device=device).to(dtype)
    states = torch.randn(num_slots, width - 1, dim, device=device).to(dtype)
    ours, ref_states = states.clone(), states.clone()
    with ops.backend("triton"):
        out = ops.causal_conv1d_update(x, ours, w, b, idx)
    expected = ref.causal_conv1d_update(x, ref_states, w, b, idx)
    assert rel_err(out, expected) < tolerance(dtype)
    _check_states(ours, ref_states, states, idx)


# --- sizes too large for the interpreter -------------------------------------------------


@gpu_only
def test_causal_conv1d_long_prompt_with_decodes_gpu(poison_empty):
    """A 31,500-token prompt plus decodes at the granite-4.0-tiny conv width (3328 features),
    x a column slice of an in_proj-shaped output."""
    dim, width, num_slots = 3328, 4, 64
    lens = [31500] + [1] * 20
    qsl, T = packed(lens, "cuda")
    idx = random_slots(len(lens), num_slots, padding=[3], device="cuda")
    has = torch.ones(len(lens), dtype=torch.bool, device="cuda")
    has[0] = False
    x = torch.randn(T, 6448, device="cuda", dtype=torch.bfloat16)[:, 3072:3072 + dim]
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(num_slots, width - 1, dim, device="cuda", dtype=torch.bfloat16)
    out, ours, expected, ref_states = _run_both(x, w, b, states, qsl, idx, has, "silu")
    assert rel_err(out, expected) < tolerance(torch.bfloat16)
    _check_states(ours, ref_states, states, idx)


@gpu_only
def test_causal_conv1d_update_256_gpu(poison_empty):
    batch, dim, width, num_slots = 256, 3328, 4, 300
    idx = random_slots(batch, num_slots, padding=[0, 100, 255], device="cuda")
    x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(num_slots, width - 1, dim, device="cuda", dtype=torch.bfloat16)
    ours, ref_states = states.clone(), states.clone()
    with ops.backend("triton"):
        out = ops.causal_conv1d_update(x, ours, w, b, idx)
    expected = ref.causal_conv1d_update(x, ref_states, w, b, idx)
    assert rel_err(out, expected) < tolerance(torch.bfloat16)
    _check_states(ours, ref_states, states, idx)


@gpu_only
def test_causal_conv1d_64bit_offsets_gpu():
    """Rows past 2^31 elements of x: the last sequence starts beyond the int32 range."""
    dim, width, row = 3328, 4, 6448
    T = (2**31) // row + 1000
    x = torch.empty(T, row, device="cuda", dtype=torch.bfloat16)[:, :dim]
    tail = 100
    x[T - tail:] = torch.randn(tail, dim, device="cuda", dtype=torch.bfloat16)
    x[: T - tail].fill_(1.0)
    qsl, _ = packed([T - tail, tail], "cuda")
    idx = torch.tensor([-1, 1], dtype=torch.int32, device="cuda")
    has = torch.tensor([False, True], device="cuda")
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    states = torch.randn(2, width - 1, dim, device="cuda", dtype=torch.bfloat16)
    ours, ref_states = states.clone(), states.clone()
    with ops.backend("triton"):
        out = ops.causal_conv1d(x, w, None, ours, qsl, idx, has)
    qsl_tail, _ = packed([tail], "cuda")
    expected = ref.causal_conv1d(x[T - tail:], w, None, ref_states, qsl_tail, idx[1:], has[1:])
    assert rel_err(out[T - tail:], expected) < tolerance(torch.bfloat16)
    assert torch.equal(ours, ref_states)
