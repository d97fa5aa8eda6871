"""Helpers shared by the Triton kernel tests: devices, packed batches, poisoned allocations.

Kernel tests run the Triton implementations (`mambaserve.ops.backend("triton")`) against
`mambaserve.ops.reference`: on CUDA when there is a GPU, otherwise on CPU tensors through the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU).
"""

import pytest
import torch

from tests.conftest import HAS_CUDA

# The interpreter only runs when no GPU is present, so CPU tensors are tested only then.
DEVICES = ["cuda"] if HAS_CUDA else ["cpu"]
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def poison_empty(monkeypatch):
    """Every torch.empty / torch.empty_like inside the test comes back NaN-filled (floats) or
    filled with a huge negative number (integers), so an element or intermediate buffer that a
    kernel forgets to write shows up in the result."""
    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-(2**30))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(orig_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(orig_empty_like(*a, **k)))
    yield


def packed(lens, device):
    """query_start_loc (batch + 1,) int32 for sequences of the given lengths, and the total."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return torch.tensor(qsl, dtype=torch.int32, device=device), qsl[-1]


def random_slots(batch, num_slots, padding, device):
    """state_indices (batch,) int32: distinct slots in random order, -1 at the given positions."""
    slots = torch.randperm(num_slots)[:batch].to(torch.int32)
    for i in padding:
        slots[i] = -1
    return slots.to(device)
