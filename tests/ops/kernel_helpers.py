"""Helpers shared by the Triton kernel tests: devices, packed batches, padded slots.

The `poison_empty` fixture (NaN-filled allocations) is in conftest.py.

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
