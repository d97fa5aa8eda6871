"""Which implementation an op runs: its Triton kernel or its PyTorch reference twin.

On CUDA tensors an op runs its Triton kernel; everywhere else the reference of
`mambaserve.ops.reference`. `backend("reference" | "triton" | "auto")` forces one inside a
`with` block, in the calling thread (tests run "triton" on CPU tensors under TRITON_INTERPRET=1).

The decode-step fusions (the router's logits and top-k in one launch, the Mamba2 gated norm
folded into out_proj) are off by default until measured (MAMBASERVE_DECODE_FUSIONS=1 turns
them on); `fused()` / `unfused()` turn them on / off inside a `with` block, in the calling
thread: the unfused paths are the reference the fused ones are tested against.

Also `triton` and `tl` for the kernel files: the real modules where Triton is installed (it is
a Linux-only dependency), else stand-ins under which the kernel files still import and the
reference backend runs alone (launching a kernel then raises RuntimeError).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # tests/ops/test_imports.py runs this with Triton hidden
    HAS_TRITON = False

    class _NoTriton:
        """Any attribute, call or decorator gives another stand-in; launching one fails."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

        def __getitem__(self, grid):
            raise RuntimeError("Triton is not installed: only the reference backend runs here")

    triton = tl = _NoTriton()

_BACKENDS = ("auto", "reference", "triton")
_local = threading.local()


def current_backend() -> str:
    """The backend `backend(...)` selected in this thread: "auto", "reference" or "triton"."""
    return getattr(_local, "backend", "auto")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Force the implementation of the ops called inside the block.

    name: "auto" (Triton on CUDA tensors, the reference elsewhere), "reference" or "triton".
    Raises ValueError for any other name, and for "triton" where Triton is not installed.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; expected one of {_BACKENDS}")
    if name == "triton" and not HAS_TRITON:
        raise ValueError("the triton backend needs Triton, which is not installed")
    previous = current_backend()
    _local.backend = name
    try:
        yield
    finally:
        _local.backend = previous


# The decode-step fusions are opt-in (MAMBASERVE_DECODE_FUSIONS=1, or `fused()`): timed on an
# H200 (granite-4.0-tiny-preview, full decode graphs) they saved 4% of the kernel time at batch 1
# (1.96 vs 2.04 ms, 384 vs 460 launches) and cost 7% at batch 16 (8.09 vs 7.58 ms: the fused
# GEMV's norm prologue re-reads every row's inputs per program). The 2x slower prefix-repetition
# run once blamed on them was Triton compiling kernel variants mid-run (pointer alignment).
DECODE_FUSIONS = os.environ.get("MAMBASERVE_DECODE_FUSIONS", "0") == "1"


def fusions_enabled() -> bool:
    """Whether ops (and the layers that ask) take their fused decode paths in this thread:
    inside `fused()` yes, inside `unfused()` no, else DECODE_FUSIONS (off unless
    MAMBASERVE_DECODE_FUSIONS=1)."""
    return getattr(_local, "fusions", DECODE_FUSIONS)


@contextlib.contextmanager
def _fusions(on: bool) -> Iterator[None]:
    previous = getattr(_local, "fusions", DECODE_FUSIONS)
    _local.fusions = on
    try:
        yield
    finally:
        _local.fusions = previous


def fused() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the fused decode paths are on in this thread (tests, the profiler)."""
    return _fusions(True)


def unfused() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the fused decode paths are off in this thread: each op and layer takes
    its unfused kernels (the same results up to float32 summation order). Graphs captured
    inside the block keep the unfused launches."""
    return _fusions(False)


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op whose main input is t runs its Triton kernel under the current backend."""
    name = current_backend()
    if name == "auto":
        return t.is_cuda and HAS_TRITON
    return name == "triton"
