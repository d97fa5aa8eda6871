"""The depthwise causal conv1d of the Mamba mixers (the short conv on x, B, C): ops
`causal_conv1d` and `causal_conv1d_update`, their Triton kernels, launchers and launch configs.

`causal_conv1d` runs one launch over a packed batch that mixes prefills and one-token decodes:
the grid is (token blocks of all sequences) x (feature blocks), so a long prompt is split along
its length and decodes cost one small program each; the token blocks are the step's plan
(`varlen.TokenBlocks`); prefix caching's state saves inside a prefill (`varlen.StateSaves`)
are programs of the same launch, past the token blocks' ones. `causal_conv1d_update` is the
decode-only variant (one token per sequence, no plan and no host sync: safe inside CUDA graphs).

Why the kernels look the way they do (the op moves bytes and does almost no arithmetic, so
everything is about loads in flight and loads not repeated):
- "roll" kernels read each input row once. A program walks its token block row by row,
  keeping the last width - 1 input rows in registers (a tuple, shifted each row), and loads
  `group` rows before computing any of them: loads written after a store are not moved above
  it by the compiler (x and out may alias as far as it knows), so a load-compute-store loop
  would wait one memory latency per row. The rows before a block (its halo) come from x, or
  from the conv state for a sequence's first block.
- The "tile" kernel (the first design, kept as a candidate and for widths over 4) loads its
  (block_t, block_d) tile once per tap, shifted by one row each time: width x the loads.
- Weights (dim, width) are read as one contiguous run and split into per-tap vectors when the
  width is 2 or 4 (a per-tap load is a stride-width gather).
- On Hopper and later the kernels use programmatic dependent launch: a launch may start while
  the previous kernel drains; each kernel waits (griddepcontrol.wait) before its first load,
  so it never reads what the previous kernel is still writing.

Launch configs are a pure function of the shape (`varlen_config`, `update_config`) over a
table per GPU: `configs/conv1d_<gpu>.json` (written by benchmarks/tune_conv1d.py on that GPU),
else `DEFAULT_TABLE`. The token-block size depends on the number of tokens only, so the step's
forward context builds the plan once for every layer (`varlen_block_t`). Never autotuned: the
kernels write conv states in place.

Conv states are (num_slots, width - 1, dim), contiguous along dim, so every state row is one
coalesced load or store. A state index of -1 marks padding: its output is computed as if it had
no initial state and no slot is read or written.

Math: `reference.causal_conv1d` (Mamba2 paper, section 7: the short convolution before the
SSM; Mamba-1 has the same). This module knows nothing about models or the engine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import cdiv, check, check_batch, next_power_of_2
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.varlen import NO_SAVES, StateSaves, TokenBlocks, conv_token_blocks, read_offsets

# --- launch configs ------------------------------------------------------------------------

# Used where no table of the GPU exists (and under the interpreter). Entries are tried in
# order; the first whose bounds hold (num_tokens <= max_tokens, dim <= max_dim, batch <=
# max_batch; null = no bound) gives the config.
DEFAULT_TABLE = {
    "varlen_block_t": [{"max_tokens": None, "block_t": 32}],
    "varlen": [{"max_tokens": None, "max_dim": None,
                "config": {"kernel": "roll", "block_d": 256, "num_warps": 1, "group": 8}}],
    "update": [{"max_batch": None, "max_dim": None, "config": {"block_d": 256, "num_warps": 1, "block_b": 1}}],
}
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
VARLEN_KEYS = {"roll": ("block_d", "num_warps", "group"), "tile": ("block_d", "num_warps")}
UPDATE_KEYS = ("block_d", "num_warps", "block_b")
MAX_ROLL_WIDTH = 4  # the roll kernels' weight split and unrolled taps are written for widths <= 4

_override = {}  # set by `config_override` (tests, the tuning sweep)
_override_version = [0]  # bumped by every `config_override`: plans key their cached configs by it


def config_version() -> int:
    """A number that changes whenever a `config_override` starts or ends: step plans that
    cache a launch config (or a block size chosen from one) key it by this."""
    return _override_version[0]

# What benchmarks/tune_conv1d.py times on a GPU (the interpreter tests and the sm_90 compile
# check run every one); a table entry may hold only these.
VARLEN_CANDIDATES = [
    {"kernel": "roll", "block_t": bt, "block_d": bd, "num_warps": nw, "group": g}
    for bt in (16, 32, 64) for bd, nw in ((256, 1), (256, 2), (512, 2), (1024, 4)) for g in (8, 16)
] + [{"kernel": "tile", "block_t": 32, "block_d": 128, "num_warps": 4},
     {"kernel": "tile", "block_t": 16, "block_d": 256, "num_warps": 4}]
UPDATE_CANDIDATES = [
    {"block_d": bd, "num_warps": nw, "block_b": bb}
    for bd, nw in ((128, 1), (256, 1), (256, 2), (512, 2), (1024, 4)) for bb in (1, 2, 4)
]


def gpu_table_name(device_name: str) -> str:
    """The table file of a GPU: "NVIDIA H200" -> "conv1d_h200.json" (vendor word dropped)."""
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower().replace("nvidia", "")).strip("_")
    return f"conv1d_{slug}.json"


@functools.cache
def _table_for(device_name: str) -> dict:
    path = os.path.join(CONFIG_DIR, gpu_table_name(device_name))
    if not os.path.exists(path):
        return DEFAULT_TABLE
    with open(path) as f:
        return json.load(f)


def table_for(device: torch.device | str | None) -> dict:
    """The config table of the GPU that `device` is (DEFAULT_TABLE for CPU tensors)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_TABLE
    return _table_of_device(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _table_of_device(index: int) -> dict:
    # one name lookup per device, not one per launch
    return _table_for(torch.cuda.get_device_name(index))


def _first(entries: list, **bounds) -> dict:
    for e in entries:
        if all(e.get(f"max_{k}") is None or v <= e[f"max_{k}"] for k, v in bounds.items()):
            return e
    raise ValueError(f"no conv1d config entry covers {bounds}: the table's last entry must be unbounded")


def varlen_block_t(table: dict, num_tokens: int) -> int:
    """Token-block size of `causal_conv1d` for a batch of num_tokens tokens (any dim): the
    plan of the step, built once for all layers, depends on it alone."""
    if "block_t" in _override:
        return _override["block_t"]
    return int(_first(table["varlen_block_t"], tokens=num_tokens)["block_t"])


def varlen_config(table: dict, num_tokens: int, dim: int, width: int) -> dict:
    """Launch config of `causal_conv1d`: {"kernel", "block_t", "block_d", "num_warps"[, "group"]}.
    A pure function of the shape (and the table). Widths over MAX_ROLL_WIDTH take the tile kernel."""
    cfg = dict(_override.get("varlen") or _first(table["varlen"], tokens=num_tokens, dim=dim)["config"])
    cfg["block_t"] = varlen_block_t(table, num_tokens)
    if width > MAX_ROLL_WIDTH and cfg["kernel"] == "roll":
        cfg = {"kernel": "tile", "block_t": cfg["block_t"], "block_d": min(cfg["block_d"], 128), "num_warps": 4}
    if cfg["kernel"] == "roll":
        cfg["group"] = min(cfg["group"], cfg["block_t"])
    return cfg


def update_config(table: dict, batch: int, dim: int, width: int) -> dict:
    """Launch config of `causal_conv1d_update`: {"block_d", "num_warps", "block_b"}."""
    cfg = dict(_override.get("update") or _first(table["update"], batch=batch, dim=dim)["config"])
    return cfg


def check_config(kind: str, cfg: dict, width: int) -> None:
    """Raise ValueError unless cfg is a launch config the kernels can run (tables, overrides)."""
    if kind == "varlen":
        check(cfg.get("kernel") in VARLEN_KEYS, lambda: f"unknown conv1d kernel in {cfg}")
        keys = ("block_t",) + VARLEN_KEYS[cfg["kernel"]]
    else:
        keys = UPDATE_KEYS
    for k in keys:
        v = cfg.get(k)
        check(isinstance(v, int) and v > 0 and v & (v - 1) == 0, lambda k=k: f"{k} must be a power of two in {cfg}")
    if kind == "varlen":
        # only a sequence's first block may read its conv state (it also writes the new one)
        check(cfg["block_t"] >= width - 1, lambda: f"block_t {cfg['block_t']} < width - 1 = {width - 1}")
        if cfg["kernel"] == "roll":
            check(cfg["block_t"] % cfg["group"] == 0, lambda: f"group must divide block_t in {cfg}")


def check_table(table: dict, width: int = 4) -> None:
    """Raise ValueError unless table (a GPU's JSON) has the three lists, each ending in an
    unbounded entry, and only configs the kernels can run at this conv width."""
    for key, bounds in (("varlen_block_t", ("max_tokens",)), ("varlen", ("max_tokens", "max_dim")),
                        ("update", ("max_batch", "max_dim"))):
        entries = table.get(key)
        check(isinstance(entries, list) and entries, lambda key=key: f"conv1d table: {key} must be a non-empty list")
        check(all(entries[-1].get(b) is None for b in bounds),
              lambda key=key: f"conv1d table: the last {key} entry must be unbounded")
    for e in table["varlen"]:
        for bt in {b["block_t"] for b in table["varlen_block_t"]}:
            cfg = {**e["config"], "block_t": bt}
            if "group" in cfg:
                cfg["group"] = min(cfg["group"], bt)
            check_config("varlen", cfg, width)
    for e in table["update"]:
        check_config("update", e["config"], width)


@contextlib.contextmanager
def config_override(varlen: dict | None = None, update: dict | None = None) -> Iterator[None]:
    """Force launch configs inside the block (tests and the tuning sweep; not thread-safe).
    varlen: a full config with "block_t" (the plan is then built at that size)."""
    saved = dict(_override)
    _override_version[0] += 1
    if varlen is not None:
        _override["varlen"] = varlen
        _override["block_t"] = varlen["block_t"]
    if update is not None:
        _override["update"] = update
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)
        _override_version[0] += 1


def _launch_pdl(x: torch.Tensor) -> bool:
    """Programmatic dependent launch: compiled kernels for Hopper (sm_90) or later."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _target_arch(x.device.index) >= 90


@functools.cache
def _target_arch(device_index: int | None) -> int:
    # the architecture Triton compiles for on the current device (what the launch runs on)
    target = triton.runtime.driver.active.get_current_target()
    arch = target.arch
    return arch if isinstance(arch, int) else 0


# --- kernels -------------------------------------------------------------------------------

@triton.jit
def _weight_taps(w_ptr, pid_d, d, d_mask, dim, stride_w_d, stride_w_k,
                 WIDTH: tl.constexpr, W_FLAT: tl.constexpr, BLOCK_D: tl.constexpr):
    """The WIDTH weight columns of features d, float32 (BLOCK_D,) each, as a tuple. W_FLAT
    (contiguous (dim, WIDTH) weights, WIDTH 2 or 4): one contiguous load, split in registers."""
    taps = ()
    if W_FLAT:
        offs = pid_d * BLOCK_D * WIDTH + tl.arange(0, BLOCK_D * WIDTH)
        flat = tl.load(w_ptr + offs, mask=offs < dim * WIDTH, other=0.0).to(tl.float32)
        if WIDTH == 2:
            w0, w1 = tl.split(tl.reshape(flat, (BLOCK_D, 2)))
            taps = (w0, w1)
        else:  # 4: [d, a, b] = w[d, 2a + b]; the last axis splits into taps (0, 2) and (1, 3)
            even, odd = tl.split(tl.reshape(flat, (BLOCK_D, 2, 2)))
            w0, w2 = tl.split(even)
            w1, w3 = tl.split(odd)
            taps = (w0, w1, w2, w3)
    else:
        for k in tl.static_range(WIDTH):
            taps = taps + (tl.load(w_ptr + d * stride_w_d + k * stride_w_k, mask=d_mask, other=0.0).to(tl.float32),)
    return taps


@triton.jit
def _conv_row(taps, window, xt, bias, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One output row: bias + sum_k taps[k] * (window + (xt,))[k], then SiLU (float32)."""
    acc = taps[WIDTH - 1] * xt
    for k in tl.static_range(WIDTH - 1):
        acc += taps[k] * window[k]
    if HAS_BIAS:
        acc += bias
    if SILU:
        acc = _silu(acc)
    return acc


@triton.jit
def _silu(x):
    # x / (1 + exp(-x)) with the fast exp2 and a non-IEEE division (a reciprocal and a
    # multiply, 2 ulp): the IEEE division and sigmoid cost ~20 instructions an element, a
    # fifth of the kernel's issue slots at full bandwidth
    return tl.fdiv(x, 1.0 + tl.exp2(x * -1.4426950408889634), ieee_rounding=False)


@triton.jit
def _shift(window, xt, WIDTH: tl.constexpr):
    """The window of the next row: drop the oldest row, append xt."""
    new = ()
    if WIDTH > 1:
        for k in tl.static_range(1, WIDTH - 1):
            new = new + (window[k],)
        new = new + (xt,)
    return new


@triton.jit
def _write_new_state(x_ptr, state_base, start, seqlen, n_state, d, d_mask, stride_x_t, stride_s_row,
                     WIDTH: tl.constexpr, ROWS: tl.constexpr):
    """Row r of the new conv state is element seqlen + r of concat(old state, x) (the first
    block of each sequence calls this, after its own reads of the old state)."""
    row = tl.arange(0, ROWS)
    row_src = seqlen + row - (WIDTH - 1)  # input position feeding new state row `row`
    row_mask = row < WIDTH - 1
    from_x = row_mask & (row_src >= 0)
    from_state = row_mask & (row_src < 0) & (row_src + (WIDTH - 1) < n_state)
    new = tl.load(x_ptr + (start + row_src)[:, None] * stride_x_t + d[None, :],
                  mask=from_x[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    new += tl.load(state_base + (row_src + (WIDTH - 1))[:, None] * stride_s_row + d[None, :],
                   mask=from_state[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    tl.debug_barrier()  # every read of the old state (this program's) happens before the first write
    tl.store(state_base + row[:, None] * stride_s_row + d[None, :],
             new.to(state_base.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _write_save(x_ptr, states_ptr, qsl_ptr, block_seq_ptr, block_start_ptr, save_row_ptr, num_blocks, dim,
                stride_x_t, stride_s_slot, stride_s_row, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A save program (a flat program id past the token blocks' programs): state row
    save_row[k] gets the width - 1 input rows before save k's offset (`varlen.TokenBlocks`),
    in the state dtype. It reads x only and writes a checkpoint row no other program touches
    (save rows are never slots of the step's sequences), so it needs no ordering."""
    pid = tl.program_id(0)
    num_d_blocks = tl.cdiv(dim, BLOCK_D)
    j = pid // num_d_blocks
    d = (pid % num_d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    seq = tl.load(block_seq_ptr + j)
    src = tl.load(qsl_ptr + seq).to(tl.int64) + tl.load(block_start_ptr + j) - (WIDTH - 1)  # first input row
    row = tl.load(save_row_ptr + (j - num_blocks)).to(tl.int64)
    r = tl.arange(0, ROWS)
    mask = (r < WIDTH - 1)[:, None] & (d < dim)[None, :]
    vals = tl.load(x_ptr + (src + r)[:, None] * stride_x_t + d[None, :], mask=mask, other=0.0)
    tl.store(states_ptr + row * stride_s_slot + r[:, None] * stride_s_row + d[None, :],
             vals.to(states_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_coords(block_seq_ptr, block_start_ptr, qsl_ptr, state_idx_ptr, has_init_ptr, dim,
                  WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    # one flat grid, feature blocks fastest: neighbouring programs read neighbouring columns
    # of the same rows
    pid = tl.program_id(0)
    num_d_blocks = tl.cdiv(dim, BLOCK_D)
    pid_t = pid // num_d_blocks
    pid_d = pid % num_d_blocks
    seq = tl.load(block_seq_ptr + pid_t)
    # first position of this block inside its sequence; int64, so that p * row stride cannot wrap
    p0 = tl.load(block_start_ptr + pid_t).to(tl.int64)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    seqlen = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)
    use_state = (slot >= 0) & (tl.load(has_init_ptr + seq) != 0)
    # state rows readable for this sequence (masks are built from integer bounds, not from
    # scalar booleans, which some Triton interpreter versions cannot combine with tensors)
    n_state = use_state.to(tl.int32) * (WIDTH - 1)
    return pid_d, p0, start, seqlen, slot, n_state


@triton.jit(do_not_specialize=["num_blocks"])  # a per-step count: one kernel for all
def _causal_conv1d_roll_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr,
    qsl_ptr, state_idx_ptr, has_init_ptr, block_seq_ptr, block_start_ptr, save_row_ptr,
    dim, num_blocks,
    stride_x_t, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_t,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    W_FLAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    HAS_SAVES: tl.constexpr, launch_pdl: tl.constexpr,
):
    if launch_pdl:
        tl.extra.cuda.gdc_wait()  # x may be the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_SAVES:
        if tl.program_id(0) >= num_blocks * tl.cdiv(dim, BLOCK_D):
            _write_save(x_ptr, states_ptr, qsl_ptr, block_seq_ptr, block_start_ptr, save_row_ptr, num_blocks, dim,
                        stride_x_t, stride_s_slot, stride_s_row, WIDTH, ROWS, BLOCK_D)
            return
    pid_d, p0, start, seqlen, slot, n_state = _block_coords(
        block_seq_ptr, block_start_ptr, qsl_ptr, state_idx_ptr, has_init_ptr, dim, WIDTH, BLOCK_D)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    x_base = x_ptr + start * stride_x_t + d  # (BLOCK_D,) pointers of the sequence's row 0
    out_base = out_ptr + start * stride_o_t + d
    state_base = states_ptr + slot * stride_s_slot

    # the halo: positions p0 - (width - 1) .. p0 - 1, from x inside the sequence, from the
    # state (or zeros) before it
    window = ()
    for j in tl.static_range(WIDTH - 1):
        q = p0 - (WIDTH - 1) + j
        lim_x = dim * (q >= 0).to(tl.int32)
        lim_s = dim * ((q < 0) & (q + (WIDTH - 1) < n_state)).to(tl.int32)
        h = tl.load(x_base + q * stride_x_t, mask=d < lim_x, other=0.0).to(tl.float32)
        h += tl.load(state_base + (q + (WIDTH - 1)) * stride_s_row + d, mask=d < lim_s, other=0.0).to(tl.float32)
        window = window + (h,)
    taps = _weight_taps(w_ptr, pid_d, d, d_mask, dim, stride_w_d, stride_w_k, WIDTH, W_FLAT, BLOCK_D)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)

    for g in tl.static_range(BLOCK_T // GROUP):
        rows = ()  # GROUP rows in flight before the first of them is used
        for i in tl.static_range(GROUP):
            p = p0 + g * GROUP + i
            rows = rows + (tl.load(x_base + p * stride_x_t, mask=d < dim * (p < seqlen).to(tl.int32), other=0.0),)
        for i in tl.static_range(GROUP):
            p = p0 + g * GROUP + i
            xt = rows[i].to(tl.float32)
            acc = _conv_row(taps, window, xt, bias, WIDTH, HAS_BIAS, SILU)
            tl.store(out_base + p * stride_o_t, acc.to(out_ptr.dtype.element_ty),
                     mask=d < dim * (p < seqlen).to(tl.int32))
            window = _shift(window, xt, WIDTH)

    if p0 == 0:
        if slot >= 0:
            _write_new_state(x_ptr, state_base, start, seqlen, n_state, d, d_mask, stride_x_t, stride_s_row,
                             WIDTH, ROWS)


@triton.jit(do_not_specialize=["num_blocks"])  # a per-step count: one kernel for all
def _causal_conv1d_tile_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr,
    qsl_ptr, state_idx_ptr, has_init_ptr, block_seq_ptr, block_start_ptr, save_row_ptr,
    dim, num_blocks,
    stride_x_t, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_t,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SAVES: tl.constexpr, launch_pdl: tl.constexpr,
):
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_SAVES:
        if tl.program_id(0) >= num_blocks * tl.cdiv(dim, BLOCK_D):
            _write_save(x_ptr, states_ptr, qsl_ptr, block_seq_ptr, block_start_ptr, save_row_ptr, num_blocks, dim,
                        stride_x_t, stride_s_slot, stride_s_row, WIDTH, ROWS, BLOCK_D)
            return
    pid_d, p0, start, seqlen, slot, n_state = _block_coords(
        block_seq_ptr, block_start_ptr, qsl_ptr, state_idx_ptr, has_init_ptr, dim, WIDTH, BLOCK_D)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    p = p0 + tl.arange(0, BLOCK_T)  # positions inside the sequence
    p_mask = p < seqlen
    state_base = states_ptr + slot * stride_s_slot

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        # tap k reads input position p + k - (width - 1); negative positions are state rows
        src = p + (k - (WIDTH - 1))
        m = (src >= 0) & p_mask
        xk = tl.load(x_ptr + (start + src)[:, None] * stride_x_t + d[None, :],
                     mask=m[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        if p0 < WIDTH - 1:
            ms = (src + (WIDTH - 1) < n_state) & p_mask
            xk += tl.load(state_base + (src + (WIDTH - 1))[:, None] * stride_s_row + d[None, :],
                          mask=ms[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + d * stride_w_d + k * stride_w_k, mask=d_mask, other=0.0).to(tl.float32)
        acc += xk * wk[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + (start + p)[:, None] * stride_o_t + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & d_mask[None, :])

    if p0 == 0:
        if slot >= 0:
            _write_new_state(x_ptr, state_base, start, seqlen, n_state, d, d_mask, stride_x_t, stride_s_row,
                             WIDTH, ROWS)


@triton.jit(do_not_specialize=["batch"])  # a per-step count: one kernel for all
def _causal_conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr, state_idx_ptr,
    batch, dim,
    stride_x_b, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_b,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W_FLAT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, launch_pdl: tl.constexpr,
):
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_d = tl.program_id(0)
    b0 = tl.program_id(1) * BLOCK_B
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim

    # every load of the program's BLOCK_B sequences is issued before the first store
    xs = ()
    slots = ()
    olds = ()  # (width - 1) rows per sequence, oldest first
    for bb in tl.static_range(BLOCK_B):
        b = b0 + bb
        valid = b < batch
        slot = tl.load(state_idx_ptr + b, mask=valid, other=-1).to(tl.int64)
        slots = slots + (slot,)
        lim_x = dim * valid.to(tl.int32)
        lim_s = dim * (slot >= 0).to(tl.int32)  # padding (-1): zeros, nothing read
        xs = xs + (tl.load(x_ptr + b.to(tl.int64) * stride_x_b + d, mask=d < lim_x, other=0.0),)
        for r in tl.static_range(WIDTH - 1):
            olds = olds + (tl.load(states_ptr + slot * stride_s_slot + r * stride_s_row + d,
                                   mask=d < lim_s, other=0.0),)
    taps = _weight_taps(w_ptr, pid_d, d, d_mask, dim, stride_w_d, stride_w_k, WIDTH, W_FLAT, BLOCK_D)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)

    for bb in tl.static_range(BLOCK_B):
        b = b0 + bb
        valid = b < batch
        window = ()
        for r in tl.static_range(WIDTH - 1):
            window = window + (olds[bb * (WIDTH - 1) + r].to(tl.float32),)
        acc = _conv_row(taps, window, xs[bb].to(tl.float32), bias, WIDTH, HAS_BIAS, SILU)
        tl.store(out_ptr + b.to(tl.int64) * stride_o_b + d, acc.to(out_ptr.dtype.element_ty),
                 mask=d < dim * valid.to(tl.int32))
    tl.debug_barrier()  # all reads of the slots precede the writes
    for bb in tl.static_range(BLOCK_B):
        slot = slots[bb]
        lim_s = dim * (slot >= 0).to(tl.int32)
        # new row r = old row r + 1; the last row = x
        for r in tl.static_range(WIDTH - 1):
            if r < WIDTH - 2:
                row = olds[bb * (WIDTH - 1) + r + 1]
            else:
                row = xs[bb]
            tl.store(states_ptr + slot * stride_s_slot + r * stride_s_row + d, row.to(states_ptr.dtype.element_ty),
                     mask=d < lim_s)


# --- launchers -----------------------------------------------------------------------------

def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                activation: str | None) -> tuple[int, int]:
    """(dim, width) of the arguments both conv ops share. Raises ValueError on bad ones."""
    check(x.dim() == 2 and x.stride(1) == 1,
          lambda: f"x must be (rows, dim) with stride 1 on dim, got {tuple(x.shape)} strides {x.stride()}")
    dim = x.shape[1]
    check(weight.dim() == 2 and weight.shape[0] == dim,
          lambda: f"weight must be ({dim}, width), got {tuple(weight.shape)}")
    width = weight.shape[1]
    check(bias is None or bias.shape == (dim,), lambda: f"bias must be ({dim},), got {tuple(bias.shape)}")
    check(conv_states.dim() == 3 and conv_states.shape[1:] == (width - 1, dim),
          lambda: f"conv_states must be (num_slots, {width - 1}, {dim}), got {tuple(conv_states.shape)}")
    # the kernels load and store whole state rows along dim (both backends take the same layout)
    check(conv_states.stride(2) == 1 or dim <= 1,
          lambda: f"conv_states must be contiguous along dim (stride 1), got strides {conv_states.stride()}")
    check(activation in (None, "silu", "swish"), lambda: f"unsupported activation {activation!r}")
    return dim, width


def _w_flat(weight: torch.Tensor, width: int) -> bool:
    """Whether the kernels may read weight as one contiguous run per feature block."""
    return width in (2, 4) and weight.is_contiguous()


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    blocks: TokenBlocks | None = None,
    state_saves: StateSaves = NO_SAVES,
) -> torch.Tensor:
    """Depthwise causal conv1d over a packed batch mixing prefills and decodes (Mamba2 and Mamba-1).

    x: (num_tokens, dim) with feature stride 1 (a column slice of a wider tensor is fine);
    weight: (dim, width); bias: (dim,) or None; conv_states: (num_slots, width - 1, dim),
    contiguous along dim, updated in place; query_start_loc: (batch + 1,) int32;
    state_indices: (batch,) int32, -1 = padding (no state read or written);
    has_initial_state: (batch,) bool; activation: "silu" (or "swish") or None.
    blocks: the step's token blocks (`ForwardContext.conv_blocks`, or `varlen.conv_token_blocks`
    at `varlen_block_t(table_for(x.device), num_tokens)` with the same state_saves), used by
    the kernel, which also keeps its launch config in them; None builds them from a device
    read of query_start_loc (a host sync, so never inside a CUDA-graph capture).
    Returns (num_tokens, dim) in x.dtype; rows past query_start_loc[-1] are left unwritten.
    Sequence i is convolved as if preceded by conv_states[state_indices[i]] (zeros when it has
    no initial state); that slot then holds the last width - 1 inputs of the concatenation.
    state_saves (`varlen.StateSaves`, prefix caching's checkpoints inside the sequences): each
    save's row gets the width - 1 inputs before its position, what a step ending there would
    leave in the slot, written by the conv kernel's launch itself (programs past the token
    blocks'), so a save row must not be a slot of the batch; on the Triton path a save needs
    at least width - 1 rows of its sequence before it (ValueError otherwise). Math:
    `reference.causal_conv1d`. Raises ValueError on inconsistent shapes, conv_states not
    contiguous along dim, query_start_loc that starts below 0, decreases or ends past x's
    rows, or blocks planned for another batch, block size or state saves.
    """
    dim, width = _check_conv(x, weight, bias, conv_states, activation)
    batch = check_batch(query_start_loc, state_indices, has_initial_state)
    num_tokens = x.shape[0]
    check(state_saves.rows_within(conv_states.shape[0]),
          lambda: f"state save rows {state_saves.row} outside the {conv_states.shape[0]} rows of conv_states")
    if not use_triton(x):
        return reference.causal_conv1d(x, weight, bias, conv_states, query_start_loc, state_indices,
                                       has_initial_state, activation, state_saves)
    # the kernel takes a save's inputs from this step's rows, not from the slot's initial state
    check(not len(state_saves) or state_saves.bounds[0] >= width - 1,
          lambda: f"a state save needs the {width - 1} rows before it inside its sequence, got offsets "
                  f"{state_saves.offset}")
    if blocks is None:
        offsets = read_offsets(query_start_loc)
        block_t = varlen_block_t(table_for(x.device), int(offsets[-1]))
        blocks = conv_token_blocks(offsets, block_t, x.device, state_saves)
    check(blocks.saves is state_saves or blocks.saves == state_saves,
          "the conv token blocks were planned for other state saves")
    # the config and its checks, once per plan, dim and width (every layer of a step shares them)
    key = (dim, width, config_version())
    cfg = blocks.launch.get(key)
    if cfg is None:
        cfg = varlen_config(table_for(x.device), blocks.num_tokens, dim, width)
        check_config("varlen", cfg, width)
        check(blocks.block_t == cfg["block_t"],
              lambda: f"token blocks of {blocks.block_t}; the kernel takes blocks of {cfg['block_t']}")
        blocks.launch[key] = cfg
    check(blocks.batch == batch, lambda: f"token blocks for {blocks.batch} sequences; the call has {batch}")
    check(blocks.num_tokens <= num_tokens,
          lambda: f"query_start_loc ends at {blocks.num_tokens}, past the {num_tokens} rows of x")
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if blocks.num_blocks == 0 or dim == 0:
        return out
    has_saves = len(blocks.saves) > 0
    grid = ((blocks.num_blocks + len(blocks.saves)) * cdiv(dim, cfg["block_d"]),)
    args = (x, weight, bias if bias is not None else weight, conv_states, out,
            query_start_loc, state_indices, has_initial_state, blocks.block_seq, blocks.block_start,
            blocks.save_row if has_saves else blocks.block_seq,
            dim, blocks.num_blocks,
            x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1),
            out.stride(0))
    common = dict(WIDTH=width, ROWS=max(1, next_power_of_2(width - 1)), HAS_BIAS=bias is not None,
                  SILU=activation in ("silu", "swish"), BLOCK_T=cfg["block_t"], BLOCK_D=cfg["block_d"],
                  HAS_SAVES=has_saves, num_warps=cfg["num_warps"], launch_pdl=_launch_pdl(x))
    if cfg["kernel"] == "roll":
        _causal_conv1d_roll_kernel[grid](*args, W_FLAT=_w_flat(weight, width), GROUP=cfg["group"], **common)
    else:
        _causal_conv1d_tile_kernel[grid](*args, **common)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """`causal_conv1d` for a decode-only batch: one token per sequence, always with an initial
    state (Mamba2 and Mamba-1 decode). No plan and no host sync: safe inside CUDA graphs.

    x: (batch, dim), feature stride 1; conv_states: (num_slots, width - 1, dim), contiguous
    along dim, updated in place; weight: (dim, width); bias: (dim,) or None; state_indices:
    (batch,) int32, -1 = padding (output as if from a zero state, no slot touched).
    Returns (batch, dim) in x.dtype. Math: `reference.causal_conv1d_update`. Raises ValueError
    on inconsistent shapes or conv_states not contiguous along dim.
    """
    dim, width = _check_conv(x, weight, bias, conv_states, activation)
    batch = x.shape[0]
    check(state_indices.shape == (batch,),
          lambda: f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    if not use_triton(x):
        return reference.causal_conv1d_update(x, conv_states, weight, bias, state_indices, activation)
    out = torch.empty((batch, dim), dtype=x.dtype, device=x.device)
    if batch == 0 or dim == 0:
        return out
    cfg = update_config(table_for(x.device), batch, dim, width)
    check_config("update", cfg, width)
    grid = (cdiv(dim, cfg["block_d"]), cdiv(batch, cfg["block_b"]))
    _causal_conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, out, state_indices,
        batch, dim,
        x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1),
        out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish"), W_FLAT=_w_flat(weight, width),
        BLOCK_D=cfg["block_d"], BLOCK_B=cfg["block_b"], num_warps=cfg["num_warps"], launch_pdl=_launch_pdl(x),
    )
    return out
