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
