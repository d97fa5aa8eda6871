"""Shared test helpers: seeded randomness, NaN poisoning, dtype-scaled tolerances."""

import os
import zlib

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tiny test models gain nothing from intra-op threads, and lose much when cores are shared.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def tolerance(dtype: torch.dtype) -> float:
    """Relative error a kernel may have against a float64 reference, by its input dtype."""
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (an element was not written)"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seed(request):
    # crc32, not hash(): str hashes change from process to process, and a failure must reproduce
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def nan_empty(*shape, dtype=torch.float32, device="cpu"):
    """torch.empty filled with NaN, so that any element a kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
