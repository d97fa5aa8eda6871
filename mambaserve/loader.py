"""Checkpoint loading: a local Hugging Face directory -> a model on a device, in a dtype.

Reads config.json with `transformers.AutoConfig`, builds the registered model class on the
meta device, materialises it on the target device and fills it from safetensors files (one
file, or many through model.safetensors.index.json) by HF parameter name, or with random
"dummy" weights. Missing, unexpected or mis-shaped tensors raise an error naming the tensor.
A path to a bare config .json file (no weights) is accepted with load_format="dummy".

Under tensor parallelism (a `TensorParallelGroup` of several ranks) the model is built for the
rank (`distributed.building_with`): its layers hold their shards, refusing sizes that do not
split before any tensor is read, and each sharded parameter reads only its ranges of the
checkpoint tensor (`layers.linear.Shard.load`, safetensors `get_slice`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from mambaserve.distributed import SINGLE, TensorParallelGroup, building_with
from mambaserve.layers.linear import shards_of
from mambaserve.models import get_model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
          "float": torch.float32}


def resolve_dtype(dtype: str | torch.dtype, config: PretrainedConfig | None = None) -> torch.dtype:
    """"auto" takes the checkpoint's dtype (float32 when it names none). Raises ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype == "auto":
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        return name if isinstance(name, torch.dtype) else DTYPES.get(str(name).replace("torch.", ""), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of float32, bfloat16, float16, auto")
    return DTYPES[dtype]


def load_config(model: str | os.PathLike) -> PretrainedConfig:
    """The transformers config of a checkpoint directory or of a bare config .json file."""
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        with open(path) as f:
            # save_pretrained writes non-finite floats as {"__float__": "Infinity"}
            data = json.load(f, object_hook=lambda d: float(d["__float__"]) if set(d) == {"__float__"} else d)
        if "model_type" not in data:
            raise ValueError(f"{path} has no model_type")
        return AutoConfig.for_model(**data)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r} is not a checkpoint directory with a config.json (or a config .json file)")
    return AutoConfig.from_pretrained(path)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    return files


def _float32_names(model: torch.nn.Module) -> set[str]:
    names = set()
    for mod_name, mod in model.named_modules():
        for p in getattr(mod, "float32_params", ()):
            names.add(f"{mod_name}.{p}" if mod_name else p)
    return names


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str,
                group: TensorParallelGroup = SINGLE) -> torch.nn.Module:
    """The registered model class for `config`, with uninitialised parameters on `device`:
    rank `group.rank`'s shard of it. Raises ValueError for a model the group cannot split."""
    cls = get_model_class(config)
    with torch.device("meta"), building_with(group):
        model = cls(config)
    keep32 = _float32_names(model)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if name in keep32 else dtype)
    model.to_empty(device=device)
    for m in model.modules():
        if hasattr(m, "init_buffers"):
            m.init_buffers()
    if getattr(config, "tie_word_embeddings", False):
        # to_empty breaks the tie: restore it
        _retie(model)
    return model.eval()


def _retie(model) -> None:
    emb = model.get_submodule("backbone.embeddings" if hasattr(model, "backbone") else "model.embed_tokens")
    model.lm_head.weight = emb.weight


@torch.no_grad()
def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same HF name.

    Raises ValueError naming the tensor on an unexpected name, a shape mismatch, or a missing
    parameter. With tied embeddings a stored lm_head.weight is ignored, and so are tensors
    under the model's `checkpoint_ignore_prefixes` (parts of the checkpoint it does not use).
    A parameter holding a tensor-parallel shard reads only its part of the tensor.
    """
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding's name
    shards = shards_of(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    ignored = tuple(getattr(model, "checkpoint_ignore_prefixes", ()))
    loaded: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if (tied and name == "lm_head.weight") or (ignored and name.startswith(ignored)):
                    continue
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}: no such parameter in "
                                     f"{type(model).__name__}")
                p = params[name]
                if name in shards:
                    try:
                        shards[name].load(p, f.get_slice(name), name)
                    except ValueError as e:
                        raise ValueError(f"{e} in {file.name}") from None
                    loaded.add(name)
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in {file.name}, expected "
                                     f"{tuple(p.shape)}")
                p.copy_(tensor.to(p.dtype))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    group: TensorParallelGroup = SINGLE,
) -> torch.nn.Module:
    """Load a checkpoint directory (or build a config with random weights, load_format="dummy").

    Returns the model in eval mode on `device` with `model.config` set: under tensor
    parallelism, rank `group.rank`'s shard (dummy weights then are drawn per shard). Raises
    ValueError for an unknown architecture or load_format, a missing file, a tensor that
    doesn't fit, or sizes the group cannot split (before any tensor is read).
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r}; expected 'auto', 'safetensors' or 'dummy'")
    config = load_config(model)
    torch_dtype = resolve_dtype(dtype, config)
    net = build_model(config, torch_dtype, device, group)
    if load_format == "dummy":
        net.init_dummy_weights(seed)
    else:
        if Path(model).is_file():
            raise ValueError(f"{model} is a bare config: use load_format='dummy'")
        load_weights(net, Path(model))
    finalize = getattr(net, "finalize_weights", None)
    if finalize is not None:  # layouts derived from the loaded weights (e.g. fused experts)
        finalize()
    return net


def check_tensor_parallel(model: str | os.PathLike, world_size: int) -> None:
    """Raise ValueError, with the reason, when the checkpoint (or config) `model` cannot be split
    over `world_size` tensor-parallel ranks; builds it on the meta device only (no memory, no
    weight read), as every rank would. The sharding rules are the layers' (their docstrings)."""
    config = load_config(model)
    with torch.device("meta"), building_with(TensorParallelGroup(rank=0, world_size=world_size)):
        get_model_class(config)(config)  # the rules do not depend on the rank: rank 0 stands for all
