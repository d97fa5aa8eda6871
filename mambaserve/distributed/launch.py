"""Starting the ranks of a tensor-parallel world, and finding its rendezvous.

Two ways to run N ranks:
- one node, started by the engine: rank 0 is the process that builds the engine; it starts
  ranks 1..N-1 as `python -m <worker module>` subprocesses (`WorkerProcesses`), which inherit
  its environment (and the package it imported first on their path) and meet it at a TCP
  rendezvous on a free local port;
- any number of nodes, started by torchrun (or by hand): every process has the torchrun-style
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment
  (`rendezvous_from_env`) and nothing is started.

A started worker watches its parent and exits when it is gone (`exit_with_parent`), so that a
killed engine leaves no rank behind. This module knows nothing of what the workers run.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("mambaserve")


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a process joins the world: rank of world_size, its GPU (local_rank),
    the init_method URL; external: started by torchrun (or by hand), not by the engine."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    external: bool


def rendezvous_from_env(world_size: int) -> Rendezvous | None:
    """The rendezvous of a process that torchrun (or a user) started, from RANK, WORLD_SIZE,
    LOCAL_RANK (default: RANK), MASTER_ADDR and MASTER_PORT; None when WORLD_SIZE is unset
    (the engine then starts its ranks itself). Raises ValueError when WORLD_SIZE is not the
    tensor-parallel size asked for or a variable is missing or malformed."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"WORLD_SIZE is set, so the rendezvous is read from the environment, but {e} is "
                         "missing or not an integer (RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)") from None
    if size != world_size:
        raise ValueError(f"tensor_parallel_size={world_size} but the environment's WORLD_SIZE is {size}: "
                         "one rank per process, every process a tensor-parallel rank")
    return Rendezvous(rank, size, local_rank, "env://", external=True)


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcesses:
    """Ranks 1..world_size-1 as subprocesses `python -m module --rank R --world-size N
    --init-method URL --parent-pid P [extra_args]`, with this process's environment, stdout
    and stderr.

    The directory holding the package this process imported goes first on their PYTHONPATH,
    so both sides run the same code.
    """

    def __init__(self, module: str, world_size: int, init_method: str, extra_args: list[str] = ()):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding mambaserve/
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            cmd = [sys.executable, "-m", module, "--rank", str(rank), "--world-size", str(world_size),
                   "--init-method", init_method, "--parent-pid", str(os.getpid()), *extra_args]
            self.procs.append(subprocess.Popen(cmd, env=env))

    def failed(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every worker that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def stop(self, timeout: float = 30.0) -> None:
        """Wait up to `timeout` seconds for the workers to exit (they were told to), then end the rest."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker %d did not exit: terminated", p.pid)
                p.terminate()
                p.wait()


def exit_with_parent(parent_pid: int, interval: float = 1.0) -> None:
    """End this process (exit code 1) as soon as its parent `parent_pid` is gone, from a daemon
    thread: a worker of an engine that was killed must not wait for it forever."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
