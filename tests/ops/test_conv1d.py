"""Triton causal conv1d kernels against the PyTorch reference."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import conv1d, varlen
from mambaserve.ops import reference as ref
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed, random_slots

DEV = DEVICES[0]  # the config sweeps: the interpreter on the CPU, the real kernels on a GPU


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
    block_t = conv1d.varlen_block_t(conv1d.table_for(device), T)
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


# --- every candidate launch config, against float64 references ---------------------------


def _f64(t):
    return None if t is None else t.double()


def _varlen_case(lens, has, width, dim, dtype, device, padding=(), with_bias=True):
    """Inputs of a packed batch: x a column slice, slots scattered, NaN in the slots that must
    be written without being read (no initial state), -1 at `padding`."""
    qsl, T = packed(lens, device)
    num_slots = len(lens) + 5
    idx = random_slots(len(lens), num_slots, padding=list(padding), device=device)
    x = torch.randn(T, dim + 13, device=device).to(dtype)[:, 5:5 + dim]
    w = (torch.randn(dim, width, device=device) / width**0.5).to(dtype)
    b = torch.randn(dim, device=device).to(dtype) if with_bias else None
    states = torch.randn(num_slots, width - 1, dim, device=device).to(dtype)
    has_t = torch.tensor(has, device=device)
    for i in range(len(lens)):
        if idx[i] >= 0 and not has[i]:
            states[idx[i]] = float("nan")
    return x, w, b, states, qsl, idx, has_t


def _check_varlen_f64(args, cfg, activation="silu"):
    x, w, b, states, qsl, idx, has = args
    ours = states.clone()
    with ops.backend("triton"), conv1d.config_override(varlen=cfg):
        out = ops.causal_conv1d(x, w, b, ours, qsl, idx, has, activation)
    expected_states = states.double()
    expected = ref.causal_conv1d(x.double(), w.double(), _f64(b), expected_states, qsl, idx, has, activation)
    assert rel_err(out, expected) < tolerance(x.dtype), cfg
    _check_states(ours.double(), expected_states, states.double(), idx)


# lengths: 1, shorter than the conv width, an empty sequence, one longer than several blocks
# of every candidate (a block of 64 + tail), block boundaries +- 1
AWKWARD_LENS = [1, 2, 0, 3, 150, 1, 17, 15, 33, 1]
AWKWARD_HAS = [True, True, True, False, True, False, True, False, True, True]


@pytest.mark.parametrize("cfg", conv1d.VARLEN_CANDIDATES[:1] + conv1d.VARLEN_CANDIDATES[-1:],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv1d_configs_fast(poison_empty, cfg, width):
    """One roll and one tile config at each width (the fast loop); all of them: the slow test."""
    args = _varlen_case([1, 2, 0, 40, 3], [True, False, True, True, True], width, 48, torch.float32, DEV,
                        padding=[4])
    _check_varlen_f64(args, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", conv1d.VARLEN_CANDIDATES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_causal_conv1d_every_config(poison_empty, cfg):
    """Every candidate config at widths 2-4, awkward lengths, padded slots, with and without
    bias and activation, against float64 (dim not a multiple of any feature block)."""
    args = _varlen_case(AWKWARD_LENS, AWKWARD_HAS, 4, 300, torch.float32, DEV, padding=[1, 6])
    _check_varlen_f64(args, cfg)
    args = _varlen_case([2, 0, 70, 1], [True, True, False, True], 3, 40, torch.bfloat16, DEV, padding=[1],
                        with_bias=False)
    _check_varlen_f64(args, cfg, None)
    args = _varlen_case([1, 3, 33], [True, True, True], 2, 40, torch.float32, DEV, padding=[0])
    _check_varlen_f64(args, cfg)


@pytest.mark.slow
def test_causal_conv1d_many_sequences(poison_empty):
    """60 sequences of lengths 0-9 (most shorter than a block, many than the conv width)."""
    lens = [int(v) for v in torch.randint(0, 10, (60,))]
    has = [bool(v) for v in torch.randint(0, 2, (60,))]
    args = _varlen_case(lens, has, 4, 40, torch.float32, DEV, padding=[0, 31, 59])
    _check_varlen_f64(args, {"kernel": "roll", "block_t": 16, "block_d": 32, "num_warps": 1, "group": 8})


@pytest.mark.parametrize("width", [1, 5])
def test_causal_conv1d_other_widths_take_the_tile_kernel(poison_empty, width):
    """Widths outside 2-4 are not the roll kernel's: the config falls back to the tile kernel."""
    cfg = conv1d.varlen_config(conv1d.DEFAULT_TABLE, 100, 48, width)
    assert cfg["kernel"] == ("tile" if width > conv1d.MAX_ROLL_WIDTH else "roll")
    args = _varlen_case([1, 7, 20], [True, True, False], width, 48, torch.float32, DEV, padding=[1])
    _check_varlen_f64(args, conv1d.varlen_config(conv1d.DEFAULT_TABLE, 28, 48, width) | {"block_t": 8})


def _check_update_f64(batch, width, dim, dtype, cfg, padding, w_contiguous=True):
    num_slots = batch + 4
    idx = random_slots(batch, num_slots, padding=padding, device=DEV)
    x = torch.randn(batch, dim + 9, device=DEV).to(dtype)[:, 3:3 + dim]
    w = torch.randn(dim, width, device=DEV) if w_contiguous else torch.randn(width, dim, device=DEV).t()
    w = (w / width**0.5).to(dtype)  # (dim, width) either way
    b = torch.randn(dim, device=DEV).to(dtype)
    states = torch.randn(num_slots, width - 1, dim, device=DEV).to(dtype)
    ours, expected_states = states.clone(), states.double()
    with ops.backend("triton"), conv1d.config_override(update=cfg):
        out = ops.causal_conv1d_update(x, ours, w, b, idx)
    expected = ref.causal_conv1d_update(x.double(), expected_states, w.double(), b.double(), idx)
    assert rel_err(out, expected) < tolerance(dtype), cfg
    _check_states(ours.double(), expected_states, states.double(), idx)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv1d_update_configs_fast(poison_empty, width):
    _check_update_f64(5, width, 40, torch.float32, {"block_d": 32, "num_warps": 1, "block_b": 2}, padding=[3])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", conv1d.UPDATE_CANDIDATES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_causal_conv1d_update_every_config(poison_empty, cfg):
    """Every candidate; batch 1, and 7 (not a multiple of block_b) with padding; weights
    contiguous (one load, split) and strided (one load per tap); dim over one feature block."""
    _check_update_f64(1, 4, 300, torch.bfloat16, cfg, padding=[])
    _check_update_f64(7, 4, 300, torch.float32, cfg, padding=[0, 6], w_contiguous=False)
    _check_update_f64(7, 2, 130, torch.float32, cfg, padding=[2])
    _check_update_f64(3, 3, 130, torch.float32, cfg, padding=[1])


def test_launch_configs_are_a_pure_function_of_the_shape():
    table = {
        "varlen_block_t": [{"max_tokens": 100, "block_t": 16}, {"max_tokens": None, "block_t": 64}],
        "varlen": [{"max_tokens": 100, "max_dim": None, "config": conv1d.VARLEN_CANDIDATES[0]},
                   {"max_tokens": None, "max_dim": 4096, "config": conv1d.VARLEN_CANDIDATES[3]},
                   {"max_tokens": None, "max_dim": None, "config": conv1d.VARLEN_CANDIDATES[-1]}],
        "update": [{"max_batch": 1, "max_dim": None, "config": conv1d.UPDATE_CANDIDATES[0]},
                   {"max_batch": None, "max_dim": None, "config": conv1d.UPDATE_CANDIDATES[-1]}],
    }
    conv1d.check_table(table)
    assert conv1d.varlen_block_t(table, 100) == 16 and conv1d.varlen_block_t(table, 101) == 64
    small = conv1d.varlen_config(table, 50, 8448, 4)
    assert small["block_t"] == 16 and small["block_d"] == conv1d.VARLEN_CANDIDATES[0]["block_d"]
    assert small["group"] <= small["block_t"]
    assert conv1d.varlen_config(table, 5000, 3328, 4)["block_d"] == conv1d.VARLEN_CANDIDATES[3]["block_d"]
    assert conv1d.varlen_config(table, 5000, 8448, 4)["kernel"] == "tile"
    assert conv1d.varlen_config(table, 5000, 8448, 4) == conv1d.varlen_config(table, 5000, 8448, 4)
    assert conv1d.update_config(table, 1, 3328, 4) == conv1d.UPDATE_CANDIDATES[0]
    assert conv1d.update_config(table, 2, 3328, 4) == conv1d.UPDATE_CANDIDATES[-1]
    with pytest.raises(ValueError, match="unbounded"):
        conv1d.check_table({**table, "update": table["update"][:1]})
    with pytest.raises(ValueError, match="power of two"):
        conv1d.check_table({**table, "update": [{"max_batch": None, "max_dim": None,
                                                 "config": {"block_d": 96, "num_warps": 1, "block_b": 1}}]})


def test_committed_gpu_tables_are_valid():
    """Every configs/conv1d_*.json parses, covers every shape, and names only runnable configs."""
    import json
    import os

    names = [n for n in os.listdir(conv1d.CONFIG_DIR) if n.startswith("conv1d_") and n.endswith(".json")]
    assert conv1d.gpu_table_name("NVIDIA H200") in names
    for name in names:
        with open(os.path.join(conv1d.CONFIG_DIR, name)) as f:
            table = json.load(f)
        for width in (2, 3, 4):
            conv1d.check_table(table, width)
    assert conv1d.table_for("cpu") is conv1d.DEFAULT_TABLE


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
    # the last rows of the long first sequence (positions past 2^31 / row elements): all-ones
    # input, so each row is silu(sum of the taps)
    last = torch.nn.functional.silu(w.double().sum(1)).expand(5, dim)
    assert rel_err(out[T - tail - 5:T - tail], last) < tolerance(torch.bfloat16)
