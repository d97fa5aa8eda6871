"""The rendezvous a rank reads from torchrun's environment, and the group of one process."""

import pytest
import torch

from mambaserve.distributed import SINGLE, TensorParallelGroup, all_gather, all_reduce, broadcast_object, min_over_ranks
from mambaserve.distributed.launch import rendezvous_from_env

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def env(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_world_size_means_the_engine_starts_its_ranks(env):
    assert rendezvous_from_env(4) is None


def test_torchrun_environment_gives_rank_gpu_and_env_rendezvous(env):
    for name, value in TORCHRUN.items():
        env.setenv(name, value)
    r = rendezvous_from_env(4)
    assert (r.rank, r.world_size, r.local_rank, r.init_method, r.external) == (3, 4, 1, "env://", True)


@pytest.mark.parametrize("change, reason", [
    ({"WORLD_SIZE": "8"}, "WORLD_SIZE is 8"),
    ({"MASTER_PORT": "x"}, "not an integer"),
    ({"RANK": None}, "RANK"),
])
def test_bad_torchrun_environment_is_refused(env, change, reason):
    for name, value in {**TORCHRUN, **change}.items():
        if value is not None:
            env.setenv(name, value)
    with pytest.raises(ValueError, match=reason):
        rendezvous_from_env(4)


def test_one_process_collectives_are_the_identity():
    x = torch.randn(3, 5)
    assert all_reduce(x, SINGLE) is x and all_gather(x, SINGLE) is x
    assert broadcast_object({"a": 1}, SINGLE) == {"a": 1} and min_over_ranks(7, SINGLE) == 7
    with pytest.raises(ValueError):
        TensorParallelGroup(rank=2, world_size=2)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="thread names from Linux's /proc")
def test_leaving_the_world_ends_the_gloo_threads_while_the_group_is_still_referenced():
    """A group a layer still holds must not keep Gloo's threads into interpreter finalization,
    where the last collective's tensors, dropped on such a thread, abort the process. A one-rank
    world in a subprocess (torch.distributed is once per process)."""
    import subprocess
    import sys
    import textwrap

    from mambaserve.distributed.launch import free_local_port

    script = textwrap.dedent(f"""
        import os
        from mambaserve.distributed import broadcast_object, destroy_tensor_parallel, init_tensor_parallel

        def gloo_threads():
            names = [open(f"/proc/self/task/{{t}}/comm").read() for t in os.listdir("/proc/self/task")]
            return sum("gloo" in n for n in names)

        group = init_tensor_parallel(0, 1, local_rank=0, device_type="cpu",
                                     init_method="tcp://127.0.0.1:{free_local_port()}")
        assert broadcast_object("step", group) == "step"
        before = gloo_threads()
        destroy_tensor_parallel(group)
        print(before, gloo_threads(), group.device_group, group.host_group)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, device_group, host_group = out.stdout.split()
    assert int(before) > 0 and (int(after), device_group, host_group) == (0, "None", "None")
