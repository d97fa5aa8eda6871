"""Helpers of the shard tests: one process standing for every tensor-parallel rank of a layer."""

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mambaserve.distributed import TensorParallelGroup, building_with
from mambaserve.layers.linear import shards_of


def load_like_the_loader(module, path):
    """Fill `module` from the safetensors file at `path` as the loader does (shards by ranges)."""
    shards = shards_of(module)
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        for name, p in module.named_parameters():
            if name in shards:
                shards[name].load(p, f.get_slice(name), name)
            else:
                p.copy_(f.get_tensor(name))
    return module


def per_rank(build, world_size, path):
    """`build()` for each rank of world_size, loaded from `path`."""
    out = []
    for rank in range(world_size):
        with building_with(TensorParallelGroup(rank=rank, world_size=world_size)):
            out.append(load_like_the_loader(build(), path))
    return out


def whole_and_file(build, tmp_path):
    torch.manual_seed(0)
    whole = build()
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_()
    path = tmp_path / "layer.safetensors"
    save_file({k: v.contiguous() for k, v in whole.state_dict().items()}, str(path))
    return whole, path
