"""Tensor parallelism's processes: rank 0's `TensorParallelExecutor`, and every other rank's loop.

Rank 0 is the process that builds the engine: it schedules, samples and talks to the user; all
ranks load their shard and run every forward. At tensor_parallel_size N the executor

1. refuses a model that does not split N ways, with the reason, before anything starts
   (`loader.check_tensor_parallel`, on the meta device);
2. starts ranks 1..N-1 on this node as `python -m mambaserve.engine.worker` processes (as
   vLLM's multiprocessing executor does), or, when torchrun (or a user) started every rank
   with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, starts nothing;
3. joins the torch.distributed world (NCCL on CUDA, Gloo on the CPU) and sends the other ranks
   its EngineConfig (`_Build`), so that every rank builds the same engine whatever its own
   command line.

Every other rank then builds its `ModelRunner` (the same sizing, the same graph captures, in
the same order: their collectives meet) and runs each step rank 0 sends (`engine.step_input`)
until rank 0 shuts the engine down. Ranks the engine started are then kept, idle, for the
next engine of the same size in this process (starting a rank costs seconds of imports), and
end when the process exits. Under torchrun the engine's constructor does not return on ranks
other than 0: they serve rank 0's steps and exit the process when it is done.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mambaserve.config import EngineConfig
from mambaserve.distributed import TensorParallelGroup, broadcast_object, destroy_tensor_parallel, init_tensor_parallel
from mambaserve.distributed.launch import (
    Rendezvous,
    WorkerProcesses,
    exit_with_parent,
    free_local_port,
    rendezvous_from_env,
)
from mambaserve.distributed.parallel_state import set_nccl_env_defaults
from mambaserve.engine.step_input import receive, share
from mambaserve.loader import check_tensor_parallel

logger = logging.getLogger("mambaserve")

_RELEASE, _EXIT = "release", "exit"  # rank 0's messages besides steps and _Build


@dataclass(frozen=True)
class _Build:
    """Build the engine of `config` (ranks above 0: their runner); CPU ranks take num_threads."""

    config: EngineConfig
    num_threads: int


@dataclass
class _World:
    """A joined world and the workers this process started for it (None under torchrun)."""

    group: TensorParallelGroup
    device_type: str
    workers: WorkerProcesses | None

    def end(self, timeout: float, tell: bool = True) -> None:
        """Tell the other ranks to exit (unless not `tell`: after a failure they may be stuck
        in a step, so the started workers are ended), leave the world, wait for the workers."""
        if tell:
            try:
                share(_EXIT, self.group)
            except RuntimeError as e:  # a worker already gone (Gloo: connection closed): nothing to tell it
                logger.warning("tensor-parallel exit message not delivered: %s", e)
        destroy_tensor_parallel(self.group)
        if self.workers is not None:
            self.workers.stop(timeout if tell else 0.0)


_idle: _World | None = None  # the ranks of the last engine shut down, kept for the next one
_exiting = False  # the interpreter exits: nothing is kept idle any more


@atexit.register
def _end_idle_world() -> None:
    global _idle, _exiting
    _exiting = True
    if _idle is not None:
        world, _idle = _idle, None
        world.end(timeout=10.0)


class TensorParallelExecutor:
    """Rank 0's side of a tensor-parallel engine: the world it joined (`group`). Raises
    ValueError for a model that cannot split, more ranks than GPUs, a process already in
    another torch.distributed world, or a bad torchrun environment."""

    def __init__(self, config: EngineConfig):
        global _idle
        n = config.tensor_parallel_size
        check_tensor_parallel(config.model, n)
        device_type = config.resolved_device()
        world, _idle = _idle, None
        if world is not None and (world.group.world_size, world.device_type) != (n, device_type):
            world.end(timeout=10.0)
            world = None
        self._world = world or self._join(n, device_type)
        self.group = self._world.group
        try:
            share(_Build(config, torch.get_num_threads()), self.group)
        except BaseException:
            self._world.end(timeout=0.0, tell=False)
            raise
        self._open = True

    @staticmethod
    def _join(n: int, device_type: str) -> _World:
        rendezvous = rendezvous_from_env(n)
        workers = None
        if rendezvous is None:
            if dist.is_initialized():
                raise ValueError("this process already belongs to a torch.distributed world: one tensor-parallel "
                                 "engine at a time per process")
            if device_type == "cuda" and torch.cuda.device_count() < n:
                raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs, {torch.cuda.device_count()} are visible")
            init_method = f"tcp://127.0.0.1:{free_local_port()}"
            set_nccl_env_defaults()  # before the workers start: they inherit the environment
            workers = WorkerProcesses("mambaserve.engine.worker", n, init_method, ["--device", device_type])
            rendezvous = Rendezvous(0, n, 0, init_method, external=False)
        try:
            group = init_tensor_parallel(rendezvous.rank, n, local_rank=rendezvous.local_rank,
                                         device_type=device_type, init_method=rendezvous.init_method)
        except BaseException:
            if workers is not None:
                workers.stop(timeout=5.0)
            raise
        if not group.is_driver:  # started by torchrun: this process is one of the other ranks
            try:
                serve(group)
            finally:
                destroy_tensor_parallel(group)
            raise SystemExit(0)
        return _World(group, device_type, workers)

    def shutdown(self, timeout: float = 30.0) -> None:
        """End the engine on every rank. The ranks this process started are kept, idle, for
        its next engine of the same size (ended when the process exits); under torchrun the
        others exit (waited for up to `timeout` seconds). Safe to call twice."""
        global _idle
        if not getattr(self, "_open", False):
            return
        self._open = False
        world = self._world
        if world.workers is not None and not world.workers.failed() and not _exiting:
            try:
                share(_RELEASE, self.group)
            except RuntimeError as e:
                logger.warning("tensor-parallel ranks not released (%s): ending them", e)
            else:
                _idle = world  # one world per process: no other can be idle beside this engine's
                return
        world.end(timeout)

    def abort(self) -> None:
        """End the other ranks at once, after rank 0 failed to build the engine (they may
        wait in a collective that rank 0 will never join)."""
        if getattr(self, "_open", False):
            self._open = False
            self._world.end(timeout=0.0, tell=False)


def _build_runner(message: _Build, group: TensorParallelGroup):
    from mambaserve.engine.model_runner import ModelRunner

    config = message.config
    if config.resolved_device() == "cpu":
        torch.set_num_threads(message.num_threads)  # rank 0's setting: the ranks share the host's cores
    torch.manual_seed(config.seed)
    return ModelRunner(config, group)


def serve(group: TensorParallelGroup) -> None:
    """A rank above 0: build each engine rank 0 asks for and run every step it sends, until
    rank 0 says exit."""
    logging.getLogger("mambaserve").setLevel(logging.ERROR)  # rank 0 reports sizing and captures for all
    while (message := broadcast_object(None, group)) != _EXIT:
        assert isinstance(message, _Build), f"unexpected message {message!r} from rank 0"
        runner = _build_runner(message, group)
        while isinstance(message := receive(group, runner.device), tuple):
            runner.run(*message)
        del runner  # released (or exiting): its model and caches go before the next engine's
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if message == _EXIT:
            return


def main(argv: list[str] | None = None) -> None:
    """A worker started by rank 0 (`distributed.launch.WorkerProcesses`)."""
    parser = argparse.ArgumentParser(description="a tensor-parallel rank of a mambaserve engine (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    args = parser.parse_args(argv)
    exit_with_parent(args.parent_pid)
    group = init_tensor_parallel(args.rank, args.world_size, local_rank=args.rank, device_type=args.device,
                                 init_method=args.init_method)
    try:
        serve(group)
    finally:
        destroy_tensor_parallel(group)
