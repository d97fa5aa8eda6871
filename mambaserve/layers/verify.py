"""The verify rows of speculative decoding in a Mamba layer: its state-dependent core run
position by position, so that the state after every verified position is kept.

A Mamba layer routes its core (conv + scan) through `run_state_op`. Without verify rows it
is the plain call. With them (`ForwardContext.verify`), the step's other sequences run as one
call over `ctx.main_part()`, and position j of the verify sequences as a one-token decode call
whose state rows are the scratch rows of position j, after their conv and SSM states were
copied there from position j - 1's rows (the slot for j = 0). The slot is never written: the
engine copies the accepted position's row into it afterwards (`StepInput.checkpoint_loads` of
the next step). Exact by construction: position j's state is the decode kernels' update of
position j - 1's, as a plain decode step would compute it. Cost: k + 1 small decode launches
and 2 (k + 1) row copies per layer; a multi-token decode kernel writing per-position states
would fuse them.

This module knows nothing of the engine; it reads the plan of `forward_context`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mambaserve.forward_context import ForwardContext


def run_state_op(fn: Callable[[torch.Tensor, ForwardContext], torch.Tensor], inputs: torch.Tensor,
                 ctx: ForwardContext, cache_index: int) -> torch.Tensor:
    """fn(inputs, ctx) for a layer whose (conv_states, ssm_states) are ctx.mamba_caches[cache_index],
    the verify rows run position by position (module docstring). inputs: (T, width_in) rows of
    the step; fn maps rows to rows, (T', width_in) -> (T', ...). Returns (T, ...); rows past the
    last sequence (padding) are left unwritten."""
    plan = ctx.verify
    if plan is None:
        return fn(inputs, ctx)
    states = ctx.mamba_caches[cache_index]
    out = None
    if plan.first_row:
        main = fn(inputs[: plan.first_row], ctx.main_part())
        out = main.new_empty((inputs.shape[0],) + main.shape[1:])
        out[: plan.first_row] = main
    for step in plan.steps:
        dst = step.ctx.state_indices.long()
        for t in states:
            t.index_copy_(0, dst, t.index_select(0, step.src))
        y = fn(inputs.index_select(0, step.rows), step.ctx)
        if out is None:
            out = y.new_empty((inputs.shape[0],) + y.shape[1:])
        out.index_copy_(0, step.rows, y)
    return out
