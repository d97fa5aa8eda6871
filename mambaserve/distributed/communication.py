"""The collectives tensor parallelism uses, over a `TensorParallelGroup`.

Each returns its input untouched for a group of one rank: at tensor_parallel_size 1 the model
runs exactly the ops it runs without this package. Device collectives are synchronous calls
(`async_op=False`): ProcessGroupNCCL then issues them on the current CUDA stream (torch >= 2.8),
which is what lets a CUDA graph captured on that stream hold them; their NCCL communicator
exists from `init_tensor_parallel` on, never created inside a capture. Host collectives
(`broadcast_object`, `min_over_ranks`) go through the group's Gloo host group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mambaserve.distributed.parallel_state import TensorParallelGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """The sum of x over the ranks, in place when x is contiguous. x: any shape; returns x's
    shape and dtype (the same tensor on every rank: collectives return identical bits)."""
    if group.world_size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group.device_group)
    return x


def all_gather(x: torch.Tensor, group: TensorParallelGroup, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order. x: the same shape on every rank;
    returns that shape with `dim` world_size times longer."""
    if group.world_size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((group.world_size * x.shape[0], *x.shape[1:]))  # rank-major along dim 0 (Gloo's layout)
    _all_gather_single(out, x, group=group.device_group)
    out = out.view(group.world_size, *x.shape)
    dim = dim % x.dim()
    return out.movedim(0, dim).reshape(*x.shape[:dim], group.world_size * x.shape[dim], *x.shape[dim + 1:])


def broadcast(x: torch.Tensor, group: TensorParallelGroup, src: int = 0) -> torch.Tensor:
    """x of rank `src` on every rank, in place (x must be contiguous, of one shape and dtype on
    all ranks). In stream order on CUDA: the host does not wait for it."""
    if group.world_size > 1:
        assert x.is_contiguous(), "broadcast needs a contiguous tensor"
        dist.broadcast(x, src=src, group=group.device_group)
    return x


def broadcast_object(obj: Any, group: TensorParallelGroup, src: int = 0) -> Any:
    """A picklable object of rank `src`, returned on every rank (the others pass anything)."""
    if group.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group.host_group)
    return box[0]


def min_over_ranks(value: int, group: TensorParallelGroup) -> int:
    """The smallest of every rank's integer `value` (e.g. the bytes each can give the caches)."""
    if group.world_size == 1:
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.host_group)
    return int(t.item())


def host_barrier(group: TensorParallelGroup) -> None:
    """Wait until every rank gets here, over the host group: it fails at once (Gloo) where a
    rank has died, instead of leaving the others in a device collective until its timeout."""
    if group.world_size > 1:
        dist.barrier(group=group.host_group)
