"""The verify rows of speculative decoding in a Mamba layer: its state-dependent core run
position by position, so that the state after every verified position is kept.

A Mamba layer routes its core (conv + scan) through `run_state_op`. Without verify rows it
is the plain call. With them (`ForwardContext.verify`), the step's other sequences run as one
call over `ctx.main_part()`, and the verify sequences either through the layer's fused verify
function (the Mamba2 mixer: `ops.causal_conv1d_verify` and `ops.ssd_state_verify`, one launch
each over all positions) or, for a layer without one (Mamba-1), position by position: position
j as a one-token decode call whose state rows are the scratch rows of position j, after their
conv and SSM states were copied there from position j - 1's rows (the slot for j = 0; cost:
k + 1 small decode launches and 2 (k + 1) row copies per layer). Either way the slot is never
written: the engine copies the accepted position's row into it afterwards
(`StepInput.checkpoint_loads` of the next step). Exact by construction: position j's state is
the decode update of position j - 1's, as a plain decode step would compute it.

This module knows nothing of the engine; it reads the plan of `forward_context`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mambaserve.forward_context import ForwardContext


def run_state_op(fn: Callable[[torch.Tensor, ForwardContext], torch.Tensor], inputs: torch.Tensor,
                 ctx: ForwardContext, cache_index: int,
                 verify_fn: Callable[[torch.Tensor, ForwardContext], torch.Tensor] | None = None) -> torch.Tensor:
    """fn(inputs, ctx) for a layer whose (conv_states, ssm_states) are ctx.mamba_caches[cache_index],
    with the verify rows (module docstring) run by verify_fn(their rows, ctx) (the fused
    ops) or, without one, position by position through fn. inputs: (T, width_in) rows of the
    step; fn maps rows to rows, (T', width_in) -> (T', ...). Returns (T, ...); rows past the
    last sequence (padding) are left unwritten."""
    plan = ctx.verify
    if plan is None:
        return fn(inputs, ctx)
    parts = []
    if plan.first_row:
        parts.append((slice(0, plan.first_row), fn(inputs[: plan.first_row], ctx.main_part())))
    if verify_fn is not None:
        rows = slice(plan.first_row, plan.first_row + plan.num_tokens)
        parts.append((rows, verify_fn(inputs[rows], ctx)))
    else:
        states = ctx.mamba_caches[cache_index]
        for step in plan.steps():
            dst = step.ctx.state_indices.long()
            for t in states:
                t.index_copy_(0, dst, t.index_select(0, step.src))
            parts.append((step.rows, fn(inputs.index_select(0, step.rows), step.ctx)))
    y = parts[0][1]
    out = y.new_empty((inputs.shape[0],) + y.shape[1:])
    for rows, part in parts:
        if isinstance(rows, slice):
            out[rows] = part
        else:
            out.index_copy_(0, rows, part)
    return out
