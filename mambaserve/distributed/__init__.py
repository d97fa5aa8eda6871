"""Tensor parallelism's plumbing over torch.distributed: the group of a rank
(`parallel_state`), the collectives (`communication`) and the start of the ranks (`launch`).

Beneath layers/, models/ and engine/: it imports none of them.
"""

from mambaserve.distributed.communication import (
    all_gather,
    all_reduce,
    broadcast,
    broadcast_object,
    host_barrier,
    min_over_ranks,
)
from mambaserve.distributed.parallel_state import (
    SINGLE,
    TensorParallelGroup,
    building_with,
    current_group,
    destroy_tensor_parallel,
    init_tensor_parallel,
)

__all__ = [
    "SINGLE",
    "TensorParallelGroup",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_object",
    "building_with",
    "current_group",
    "destroy_tensor_parallel",
    "host_barrier",
    "init_tensor_parallel",
    "min_over_ranks",
]
