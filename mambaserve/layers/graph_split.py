"""Split points for piecewise CUDA graphs.

A layer routes the part of its work that depends on the step's launch plans (the Mamba mixer's
conv + scan, attention's cache write + paged attention) through `split_op`. Normally that just
calls the function. While the engine's piecewise graph runner captures a forward, it installs a
recorder: each split op then ends the current CUDA graph, is recorded as an eager "hole" to run
at replay time with the real step's context, and a new graph begins after it. Everything between
split points (projections, norms, MoE, residuals) is then replayed as graphs.

This module knows nothing about the engine beyond that one hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_recorder = None


def set_recorder(recorder) -> None:
    """Install (or, with None, remove) the piecewise capture recorder."""
    global _recorder
    _recorder = recorder


def recording() -> bool:
    """Whether a piecewise capture is running (split ops become holes): a layer that would call
    a state-dependent op outside `split_op` must not then."""
    return _recorder is not None


def split_op(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], ctx) -> torch.Tensor:
    """Run fn(*args, ctx), or record it as a piecewise-graph hole while a capture is running."""
    if _recorder is None:
        return fn(*args, ctx)
    return _recorder.hole(fn, args, ctx)
