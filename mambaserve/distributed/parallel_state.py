"""The tensor-parallel group a process belongs to: its rank, the world size and the process groups.

`TensorParallelGroup` is plain data: rank r of N, the local rank (which GPU of the node), the
device group (NCCL on CUDA, Gloo on the CPU: activations) and a Gloo group for host messages
(the step descriptions rank 0 broadcasts, the cache budget's minimum). `SINGLE` is one process
on one device: no process group at all, and every collective of `communication` returns its
input untouched.

Layers read the group when they are built (`current_group()`): the model loader builds a model
inside `building_with(group)`, so each layer takes its shard's sizes and keeps the group for its
collectives. Outside that block the group is `SINGLE`: a model built without it is whole.

`init_tensor_parallel` joins a torch.distributed world (`init_process_group` over a TCP
rendezvous, as torchrun's MASTER_ADDR / MASTER_PORT describe it) and returns the group; the
processes themselves are started by `distributed.launch`. This package knows no layer, model
or engine.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The GPU machines this engine runs on need NVLink multicast off (NVLS, symmetric-memory
# multicast); set for every rank unless the user set them already.
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Ranks above 0 wait for rank 0's next step on the host group, for as long as the engine idles
# (a server without requests): its timeout is the longest idle time, not a step's.
_HOST_GROUP_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank `rank` of `world_size` tensor-parallel ranks.

    local_rank: the rank's GPU on its node (cuda:local_rank). device_group: the process group
    of the collectives on activations (NCCL on CUDA, Gloo on the CPU); host_group: a Gloo group
    for Python objects and host integers. Both None for a group that only sizes a model
    (`building_with` on the meta device, tests) or for one process (`SINGLE`).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_group: dist.ProcessGroup | None = None
    host_group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} of world size {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules and samples; every rank runs the forward."""
        return self.rank == 0


SINGLE = TensorParallelGroup()
_building: contextvars.ContextVar[TensorParallelGroup] = contextvars.ContextVar("tensor_parallel_group",
                                                                              default=SINGLE)


def current_group() -> TensorParallelGroup:
    """The group the layers being built shard for (`SINGLE` outside `building_with`)."""
    return _building.get()


@contextlib.contextmanager
def building_with(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build layers for `group` inside the block: each takes its rank's shard."""
    token = _building.set(group)
    try:
        yield group
    finally:
        _building.reset(token)


def set_nccl_env_defaults() -> None:
    """NCCL_ENV_DEFAULTS into os.environ where unset (inherited by the processes started after)."""
    for name, value in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def init_tensor_parallel(rank: int, world_size: int, *, local_rank: int, device_type: str,
                         init_method: str) -> TensorParallelGroup:
    """Join the torch.distributed world as `rank` of `world_size` and return its group.

    device_type "cuda": NCCL on cuda:local_rank, its communicator created now (`device_id`) so
    that the first collective may be captured in a CUDA graph; "cpu": Gloo. init_method: a
    rendezvous URL ("tcp://host:port", or "env://" for MASTER_ADDR / MASTER_PORT). Blocks until
    every rank has joined. Raises ValueError when this process already joined another world.
    """
    set_nccl_env_defaults()
    if dist.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed world: one tensor-parallel "
                         "engine per process")
    kw = {}
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, **kw)
    host = dist.new_group(backend="gloo", timeout=_HOST_GROUP_TIMEOUT)
    group = TensorParallelGroup(rank, world_size, local_rank, dist.group.WORLD, host)
    warm = torch.ones(1, device=torch.device("cuda", local_rank) if device_type == "cuda" else "cpu")
    dist.all_reduce(warm, group=group.device_group)  # connections made now, not inside a capture
    return group


def destroy_tensor_parallel(group: TensorParallelGroup | None = None) -> None:
    """Leave the torch.distributed world (a no-op outside one) and let go of `group`'s process
    groups, so that they end (their threads joined) now, while the interpreter is alive.

    `dist.destroy_process_group` only unregisters the groups: a Gloo group that a layer or an
    executor still references keeps its worker threads until the interpreter finalizes, and a
    thread that then drops its last collective's tensors needs the GIL, which finalization no
    longer hands out: the process aborts ("terminate called without an active exception"). The
    group is a frozen dataclass shared by every layer; its fields are cleared in place, so a
    collective on it afterwards fails (torch.distributed is not initialized) instead of hanging.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    if group is not None:
        object.__setattr__(group, "device_group", None)
        object.__setattr__(group, "host_group", None)
