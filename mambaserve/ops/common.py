"""Helpers shared by the op files: argument checks, the next power of two, Triton dtypes, and
the SSM step size dt' = clamp(softplus(dt + dt_bias), dt_limit) in its Triton form with its
launch arguments (its PyTorch twin is in `reference`).

The checks run on every op call of every layer, on both backends: each is a cheap comparison,
and its message is formatted only on failure.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from mambaserve.ops.dispatch import tl, triton

# torch dtype -> Triton dtype, for the matrix-product operands of the kernels
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def check(cond: bool, msg) -> None:
    """Raise ValueError(msg) unless cond; msg may be a callable (an f-string built only on failure)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (`triton.cdiv` is a constexpr function in recent Triton,
    several microseconds a call from the host)."""
    return -(-a // b)


def check_positive_int(value, name: str) -> int:
    """value as a Python int (a numpy integer is not a Triton kernel argument). Raises
    ValueError unless it is a positive integer (bool excluded)."""
    if type(value) is int and value > 0:  # the common case, without the ABC check's cost
        return value
    check(isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0,
          lambda: f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_batch(query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor | None = None) -> int:
    """The batch size of a packed batch: query_start_loc (batch + 1,), state_indices (batch,),
    has_initial_state (batch,) when given. Raises ValueError on other shapes."""
    check(query_start_loc.dim() == 1 and query_start_loc.numel() >= 1,
          lambda: f"query_start_loc must be (batch + 1,), got {tuple(query_start_loc.shape)}")
    batch = query_start_loc.numel() - 1
    check(state_indices.shape == (batch,),
          lambda: f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    if has_initial_state is not None:
        check(has_initial_state.shape == (batch,),
              lambda: f"has_initial_state must be ({batch},), got {tuple(has_initial_state.shape)}")
    return batch


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without the host waiting: a CUDA copy is made from pinned
    memory (from pageable memory cudaMemcpyAsync waits for every kernel queued before it, which
    serialises the host's launches with the GPU's work). The pinned staging block stays
    reserved until the copy is done (PyTorch's caching host allocator records the stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


_NUMPY_INTS = {torch.int32: np.int32, torch.int64: np.int64}  # what `pack_to_device` packs


def pack_to_device(arrays: list, device, dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Several small host arrays (lists or numpy) in one host-to-device copy (`to_device`);
    returns a view of the copy per array, each starting on a 16-byte boundary (pieces padded).
    Why aligned: Triton specializes a pointer argument on 16-byte alignment, so views at
    offsets that vary with the batch (a packed table's second array after n + 1 entries)
    would compile a new kernel variant in the middle of serving whenever the remainder
    changes (3 s each for some of ours on an H200). dtype: torch.int32 or torch.int64."""
    np_dtype = _NUMPY_INTS[dtype]
    per = 16 // np_dtype().itemsize
    pieces = [np.asarray(a).reshape(-1) for a in arrays]
    sizes = [p.size for p in pieces]
    starts = np.concatenate([[0], np.cumsum([-(-n // per) * per for n in sizes])]).astype(np.int64)
    flat = np.zeros(int(starts[-1]), dtype=np_dtype)
    for p, s in zip(pieces, starts):
        flat[s : s + p.size] = p
    packed = to_device(torch.from_numpy(flat), device)
    return [packed[int(s) : int(s) + n] for s, n in zip(starts, sizes)]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dt_limit_args(dt_limit: tuple[float, float]) -> tuple[bool, float, float]:
    """(apply the clamp, lower, upper) as the reference does: only a non-default limit clamps."""
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has = lo > 0.0 or hi != math.inf
    return has, lo, (hi if hi != math.inf else 3.0e38)


@triton.jit
def softplus(x):
    # log(1 + exp(x)) like torch.nn.functional.softplus (threshold 20), accurate for x << 0
    u = tl.exp(-tl.abs(x))
    log1p_u = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_u)


@triton.jit
def process_dt(dt, dt_bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
               HAS_DT_LIMIT: tl.constexpr, dt_min, dt_max):
    """dt' = clamp(softplus(dt + dt_bias), dt_limit), each step optional (float32 in/out)."""
    if HAS_DT_BIAS:
        dt = dt + dt_bias
    if DT_SOFTPLUS:
        dt = softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt
