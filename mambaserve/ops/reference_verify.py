"""The PyTorch twins of `ops.verify` (speculative decoding's verify rows): each position of a
verify sequence run as one decode step of `ops.reference`, its state row first set to the
previous position's state. The slot a sequence continues from is only read."""

from __future__ import annotations

import math

import torch

from mambaserve.ops import reference


def _verify_positions(states, query_start_loc, slots, state_rows):
    """Per position of each verify sequence: (its row, a (1,) index of its state row), that row
    set to the previous position's state (the slot's for the first) before it is yielded."""
    for i in range(slots.shape[0]):
        start, end, src = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(slots[i])
        for j in range(end - start):
            dst = int(state_rows[i, j])
            states[dst] = states[src]
            src = dst
            yield start + j, torch.tensor([dst], dtype=torch.int32, device=states.device)


def causal_conv1d_verify(x, conv_states, weight, bias, query_start_loc, slots, state_rows, activation="silu"):
    """The math of `ops.verify.causal_conv1d_verify`: a `causal_conv1d_update` per position."""
    out = torch.empty_like(x)
    for row, dst in _verify_positions(conv_states, query_start_loc, slots, state_rows):
        out[row] = reference.causal_conv1d_update(x[row : row + 1], conv_states, weight, bias, dst, activation)[0]
    return out


def ssd_state_verify(ssm_states, x, dt, A, B, C, D, z, dt_bias, query_start_loc, slots, state_rows,
                     dt_softplus=True, dt_limit=(0.0, math.inf)):
    """The math of `ops.verify.ssd_state_verify`: an `ssd_state_update` per position."""
    y = torch.empty_like(x)
    for row, dst in _verify_positions(ssm_states, query_start_loc, slots, state_rows):
        r = slice(row, row + 1)
        y[r] = reference.ssd_state_update(ssm_states, x[r], dt[r], A, B[r], C[r], D, None if z is None else z[r],
                                          dt_bias, dst, dt_softplus, dt_limit)
    return y
