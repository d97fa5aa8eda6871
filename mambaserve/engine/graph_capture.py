"""What the two CUDA-graph runners share: the captured sizes and the capture loop.

`DecodeGraphRunner` (engine/cuda_graph.py: whole decode forwards per batch size) and
`PiecewiseGraphRunner` (engine/piecewise.py: mixed forwards per token count, split at the ops
that need the step's plans) both capture one forward per size, largest first so that smaller
ones reuse its memory pool, on a side stream (a graph cannot be captured on the default
stream), after a warm-up that compiles the kernels, and run a step in the smallest captured
size that holds it. `CapturedSizes` holds that, once; each runner says what one capture is.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("mambaserve")


class CapturedSizes:
    """The sizes a runner captures (batch sizes or token counts) and the loop that captures
    them. Raises ValueError on an empty list or a size below 1."""

    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = sorted(set(int(s) for s in sizes))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"capture sizes must be positive integers, got {sizes}")
        self.max_size = self.sizes[-1]
        self.device = device
        self.pool = None  # the graphs' shared memory pool, set by the first capture

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size >= n that a step of n runs in, or None if n is too large."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def warm_up(self, forward: Callable[[], object], times: int = 1) -> None:
        """Run forward `times` times outside any capture (compiles the kernels, builds the
        context's plans) and wait for it: a capture must not record the compilation."""
        for _ in range(times):
            forward()
        torch.cuda.synchronize(self.device)

    def capture_all(self, capture_one: Callable[[int, torch.cuda.Stream], None], what: str) -> None:
        """capture_one(size, stream) for every size, largest first, on a side stream ordered
        after the work already queued; then back on the current stream, synchronized."""
        t0 = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                capture_one(size, stream)
        current.wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.warning("captured %s for %d sizes (%s) in %.1f s", what, len(self.sizes), self.sizes,
                       time.perf_counter() - t0)
