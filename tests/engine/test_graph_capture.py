"""The graph runners' shared part: which captured size a step runs in (capture itself needs a
GPU: tests/engine/test_gpu.py)."""

import pytest
import torch

from mambaserve.engine.graph_capture import CapturedSizes


def test_padded_size_is_the_smallest_captured_size_that_holds_the_step():
    sizes = CapturedSizes([16, 1, 8, 2, 8, 4], torch.device("cpu"))
    assert sizes.sizes == [1, 2, 4, 8, 16] and sizes.max_size == 16
    assert [sizes.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert sizes.padded_size(17) is None


@pytest.mark.parametrize("bad", [[], [0, 4], [-1]])
def test_capture_sizes_must_be_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        CapturedSizes(bad, torch.device("cpu"))
