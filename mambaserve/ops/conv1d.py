"""The depthwise causal conv1d of the Mamba mixers (the short conv on x, B, C): ops
`causal_conv1d` and `causal_conv1d_update`, their Triton kernels and launchers.

`causal_conv1d` runs one launch over a packed batch that mixes prefills and one-token decodes:
the grid is (token blocks of all sequences, feature blocks), so a long prompt is split along its
length and decodes cost one small program each; the token blocks are the step's plan
(`varlen.TokenBlocks`). `causal_conv1d_update` is the decode-only variant (one token per
sequence, no plan and no host sync: safe inside CUDA graphs).

Conv states are (num_slots, width - 1, dim), contiguous along dim, so every state row is one
coalesced load or store. A state index of -1 marks padding: its output is computed as if it had
no initial state and no slot is read or written.

Math: `reference.causal_conv1d` (Mamba2 paper, section 7: the short convolution before the
SSM; Mamba-1 has the same). This module knows nothing about models or the engine.
"""

from __future__ import annotations

import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, check_batch, next_power_of_2
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.varlen import NO_SAVES, StateSaves, TokenBlocks, conv_token_blocks, read_offsets

# Fixed launch configs (tuned offline with benchmarks/kernels.py; never autotuned, since the
# kernels write conv states in place).
CONV_CONFIG = {"block_t": 32, "block_d": 128, "num_warps": 4}
UPDATE_CONFIG = {"block_d": 256, "num_warps": 4}


@triton.jit
def _causal_conv1d_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr,
    qsl_ptr, state_idx_ptr, has_init_ptr, block_seq_ptr, block_start_ptr,
    dim,
    stride_x_t, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_t,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one flat grid, feature blocks fastest: neighbouring programs read neighbouring columns
    # of the same rows (whole rows of x per group of programs)
    pid = tl.program_id(0)
    num_d_blocks = tl.cdiv(dim, BLOCK_D)
    pid_t = pid // num_d_blocks
    pid_d = pid % num_d_blocks
    seq = tl.load(block_seq_ptr + pid_t)
    p0 = tl.load(block_start_ptr + pid_t)  # first position of this block inside its sequence
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    seqlen = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
    slot = tl.load(state_idx_ptr + seq).to(tl.int64)
    use_state = (slot >= 0) & (tl.load(has_init_ptr + seq) != 0)
    # state rows readable for this sequence (masks are built from integer bounds, not from
    # scalar booleans, which some Triton interpreter versions cannot combine with tensors)
    n_state = use_state.to(tl.int32) * (WIDTH - 1)

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
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (start + p)[:, None] * stride_o_t + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & d_mask[None, :])

    # The first block of a sequence is the only program that reads its old state, so it also
    # writes the new one: row r of the new state is element seqlen + r of concat(old, x).
    if p0 == 0:
        if slot >= 0:
            row = tl.arange(0, ROWS)
            row_src = seqlen + row - (WIDTH - 1)  # input position feeding new state row `row`
            row_mask = row < WIDTH - 1
            from_x = row_mask & (row_src >= 0)
            from_state = row_mask & (row_src < 0) & (row_src + (WIDTH - 1) < n_state)
            new = tl.load(x_ptr + (start + row_src)[:, None] * stride_x_t + d[None, :],
                          mask=from_x[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            new += tl.load(state_base + (row_src + (WIDTH - 1))[:, None] * stride_s_row + d[None, :],
                           mask=from_state[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            tl.debug_barrier()  # every read of the old state happens before the first write
            tl.store(state_base + row[:, None] * stride_s_row + d[None, :],
                     new.to(states_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, states_ptr, out_ptr, state_idx_ptr,
    dim,
    stride_x_b, stride_w_d, stride_w_k, stride_s_slot, stride_s_row, stride_o_b,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_d = tl.program_id(0)
    b = tl.program_id(1)
    slot = tl.load(state_idx_ptr + b).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    r = tl.arange(0, ROWS)
    r_mask = r < WIDTH - 1
    state_base = states_ptr + slot * stride_s_slot

    x = tl.load(x_ptr + b.to(tl.int64) * stride_x_b + d, mask=d_mask, other=0.0).to(tl.float32)
    n_state = (slot >= 0).to(tl.int32) * (WIDTH - 1)  # state rows readable (0 for padding)
    ms = (r < n_state)[:, None] & d_mask[None, :]
    old = tl.load(state_base + r[:, None] * stride_s_row + d[None, :], mask=ms, other=0.0).to(tl.float32)
    w_old = tl.load(w_ptr + d[None, :] * stride_w_d + r[:, None] * stride_w_k,
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + d * stride_w_d + (WIDTH - 1) * stride_w_k, mask=d_mask, other=0.0).to(tl.float32)
    acc = tl.sum(old * w_old, axis=0) + x * w_new
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)

    if slot >= 0:
        # new row r = old row r + 1, the last row = x
        ms1 = ((r + 1 < WIDTH - 1) & r_mask)[:, None] & d_mask[None, :]
        new = tl.load(state_base + (r + 1)[:, None] * stride_s_row + d[None, :], mask=ms1, other=0.0)
        new = tl.where((r == WIDTH - 2)[:, None], x[None, :].to(new.dtype), new)
        tl.debug_barrier()  # all reads of the slot precede the writes
        tl.store(state_base + r[:, None] * stride_s_row + d[None, :], new.to(states_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & d_mask[None, :])


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
    with CONV_CONFIG's block_t), used by the kernel; None builds them from a device read of
    query_start_loc (a host sync, so never inside a CUDA-graph capture).
    Returns (num_tokens, dim) in x.dtype; rows past query_start_loc[-1] are left unwritten.
    Sequence i is convolved as if preceded by conv_states[state_indices[i]] (zeros when it has
    no initial state); that slot then holds the last width - 1 inputs of the concatenation.
    state_saves (`varlen.StateSaves`, prefix caching's checkpoints inside the sequences): each
    save's row gets the width - 1 inputs before its position, what a step ending there would
    leave in the slot; on the Triton path a save needs at least width - 1 rows of its sequence
    before it (ValueError otherwise). Math: `reference.causal_conv1d`. Raises ValueError on
    inconsistent shapes, conv_states not contiguous along dim, query_start_loc that starts
    below 0, decreases or ends past x's rows, or blocks planned for another batch or block size.
    """
    dim, width = _check_conv(x, weight, bias, conv_states, activation)
    batch = check_batch(query_start_loc, state_indices, has_initial_state)
    num_tokens = x.shape[0]
    check(all(0 <= r < conv_states.shape[0] for r in state_saves.row),
          lambda: f"state save rows {state_saves.row} outside the {conv_states.shape[0]} rows of conv_states")
    if not use_triton(x):
        return reference.causal_conv1d(x, weight, bias, conv_states, query_start_loc, state_indices,
                                       has_initial_state, activation, state_saves)
    if len(state_saves) and width > 1:
        save_conv_states(x, conv_states, state_saves)
    cfg = CONV_CONFIG
    if blocks is None:
        blocks = conv_token_blocks(read_offsets(query_start_loc), cfg["block_t"], x.device)
    check((blocks.block_t, blocks.batch) == (cfg["block_t"], batch),
          lambda: f"token blocks of {blocks.block_t} for {blocks.batch} sequences; the call has {batch} "
                  f"sequences and the kernel blocks of {cfg['block_t']}")
    check(blocks.num_tokens <= num_tokens,
          lambda: f"query_start_loc ends at {blocks.num_tokens}, past the {num_tokens} rows of x")
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if blocks.num_blocks == 0 or dim == 0:
        return out
    grid = (blocks.num_blocks * triton.cdiv(dim, cfg["block_d"]),)
    _causal_conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, out,
        query_start_loc, state_indices, has_initial_state, blocks.block_seq, blocks.block_start,
        dim,
        x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1),
        out.stride(0),
        WIDTH=width, ROWS=max(1, next_power_of_2(width - 1)), HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"),
        BLOCK_T=cfg["block_t"], BLOCK_D=cfg["block_d"], num_warps=cfg["num_warps"],
    )
    return out


def save_conv_states(x: torch.Tensor, conv_states: torch.Tensor, state_saves: StateSaves) -> None:
    """conv_states[row] = the width - 1 rows of x (num_tokens, dim) before each save's position
    (`StateSaves`): one gather and one scatter, run before the conv kernel, which overwrites
    the slots but not x. Raises ValueError for a save with fewer than width - 1 rows of its
    sequence before it (those inputs are in the slot's initial state, which this does not read)."""
    width = conv_states.shape[1] + 1
    check(all(o >= width - 1 for o in state_saves.offset),
          lambda: f"a state save needs the {width - 1} rows before it inside its sequence, got offsets "
                  f"{state_saves.offset}")
    rows, src = state_saves.conv_index(width, x.device)
    conv_states[rows] = x[src].view(len(state_saves), width - 1, x.shape[1]).to(conv_states.dtype)


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
    cfg = UPDATE_CONFIG
    grid = (triton.cdiv(dim, cfg["block_d"]), batch)
    _causal_conv1d_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, out, state_indices,
        dim,
        x.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0), conv_states.stride(1),
        out.stride(0),
        WIDTH=width, ROWS=max(1, next_power_of_2(width - 1)), HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), BLOCK_D=cfg["block_d"], num_warps=cfg["num_warps"],
    )
    return out
