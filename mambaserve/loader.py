"""Checkpoint loading: a local Hugging Face directory -> a model on a device, in a dtype.

Reads config.json with `transformers.AutoConfig`, builds the registered model class on the
meta device, materialises it on the target device and fills it from safetensors files (one
file, or many through model.safetensors.index.json) by HF parameter name, or with random
"dummy" weights. Missing, unexpected or mis-shaped tensors raise an error naming the tensor.
A path to a bare config .json file (no weights) is accepted with load_format="dummy".

FP8 (`layers.quantization`): with a quantization config (the engine's `quantization`, or the
checkpoint's compressed-tensors `quantization_config`) the selected layers are built with FP8
weights and scales before any tensor is read. A compressed-tensors checkpoint fills them as
stored (a scale of another shape with as many elements, e.g. (N,) for (N, 1), is reshaped);
a float tensor arriving for an FP8 weight ("fp8" online, or a layer the checkpoint left
unquantized) is quantized as it loads; an FP8 tensor of a layer that stays in the model dtype
is dequantized with its weight_scale; `k_scale` / `v_scale` (or the older
`k_proj.output_scale` names) go to the attention layers when they take them, else are skipped.

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
from mambaserve.layers.quantization import (
    QuantizationConfig,
    fill_quantized,
    init_dummy_fp8,
    prepare_fp8_modules,
    resolve_quantization,
    widen_scales,
)
from mambaserve.models import get_model_class
from mambaserve.ops.fp8 import FP8_DTYPE, dequantize_fp8

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
                group: TensorParallelGroup = SINGLE, quantization: QuantizationConfig | None = None,
                kv_scales: bool = False) -> torch.nn.Module:
    """The registered model class for `config`, with uninitialised parameters on `device`:
    rank `group.rank`'s shard of it; `quantization`: its selected layers with FP8 weights;
    kv_scales: attention layers with k_scale / v_scale parameters (1.0 unless loaded). Raises
    ValueError for a model the group cannot split or a family that does not take FP8."""
    cls = get_model_class(config)
    with torch.device("meta"), building_with(group):
        model = cls(config)
    keep32 = _float32_names(model)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if name in keep32 else dtype)
    if quantization is not None:
        prepare_fp8_modules(model, quantization, group)
    if kv_scales or (quantization is not None and quantization.kv_cache_scales):
        for m in model.modules():
            if hasattr(m, "add_kv_scales"):
                m.add_kv_scales()
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


_KV_SCALE_NAMES = {".k_proj.output_scale": ".k_scale", ".v_proj.output_scale": ".v_scale"}


def _checkpoint_name(name: str) -> str:
    """A tensor's parameter name: the older compressed-tensors KV scale names mapped to ours."""
    for old, new in _KV_SCALE_NAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


class _Dequantizer:
    """FP8 weights (and their weight_scale) of layers that stay in the model dtype, gathered
    until both halves are read, then dequantized into the parameter."""

    def __init__(self, model):
        self.modules = getattr(model, "fp8_dequantize", {})
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def owner(self, name: str) -> tuple[str, str] | None:
        mod, _, leaf = name.rpartition(".")
        return (mod, leaf) if mod in self.modules and leaf in ("weight", "weight_scale", "input_scale") else None

    def add(self, mod: str, leaf: str, tensor: torch.Tensor, params, shards, loaded: set[str]) -> None:
        if leaf == "input_scale":
            return  # the layer's activations are not quantized
        got = self.pending.setdefault(mod, {})
        got[leaf] = tensor
        if "weight_scale" in got and "weight" in got:
            name = f"{mod}.weight"
            p = params[name]
            w, sc = got.pop("weight"), got.pop("weight_scale")
            full = dequantize_fp8(w, sc.reshape(-1) if sc.numel() > 1 else sc, p.dtype)
            if name in shards:
                shards[name].load(p, full, name)
            elif tuple(full.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(full.shape)}, expected {tuple(p.shape)}")
            else:
                p.copy_(full)
            loaded.add(name)


def _load_one(model, params, shards, name: str, f, file, loaded: set[str]) -> None:
    """Copy checkpoint tensor `name` of safetensors file f into its parameter (rules: module docstring)."""
    p = params[name]
    sharded = name in shards
    if p.dtype == FP8_DTYPE and f.get_slice(name).get_dtype() != "F8_E4M3":
        # a float weight for an FP8 layer: read it whole (or the rank's shard), quantize it here
        module = model.get_submodule(name.rpartition(".")[0])
        tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        if sharded:
            shards[name].load(tmp, f.get_slice(name), name)
        else:
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} in {file.name}, "
                                 f"expected {tuple(p.shape)}")
            tmp.copy_(t)
        fill_quantized(module, tmp)
        loaded.update((name, name.rpartition(".")[0] + ".weight_scale"))
        return
    if name.endswith("_scale"):  # scales: any shape of the right number of elements
        t = f.get_tensor(name).float()
        want = list(p.shape)
        if sharded:
            want[shards[name].dim] = shards[name].full_size
        if t.numel() != torch.Size(want).numel():
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} in {file.name}, expected {tuple(want)}")
        t = t.reshape(want)
        shards[name].load(p, t, name) if sharded else p.copy_(t)
        loaded.add(name)
        return
    if sharded:
        shards[name].load(p, f.get_slice(name), name)
        loaded.add(name)
        return
    tensor = f.get_tensor(name)
    if tuple(tensor.shape) != tuple(p.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in {file.name}, expected "
                         f"{tuple(p.shape)}")
    if tensor.dtype == FP8_DTYPE and p.dtype != FP8_DTYPE:
        raise ValueError(f"tensor {name!r} is FP8 in {file.name} but its layer is not quantized")
    p.copy_(tensor.to(p.dtype))
    loaded.add(name)


@torch.no_grad()
def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same HF name.

    Raises ValueError naming the tensor on an unexpected name, a shape mismatch, or a missing
    parameter. With tied embeddings a stored lm_head.weight is ignored (or read as the
    embedding when the checkpoint stores only it, as transformers ties them), and so are tensors
    under the model's `checkpoint_ignore_prefixes` (parts of the checkpoint it does not use),
    KV scales of attention layers that take none, and the input scales of FP8 experts (weight-only
    FP8 there). A parameter holding a tensor-parallel shard reads only its part of the tensor.
    FP8 layers: module docstring.
    """
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding's name
    shards = shards_of(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    ignored = tuple(getattr(model, "checkpoint_ignore_prefixes", ()))
    dequant = _Dequantizer(model)
    loaded: set[str] = set()
    files = safetensors_files(model_dir)
    embedding = _embedding_from_lm_head(model, files) if tied else None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                name = _checkpoint_name(stored)
                if tied and name == "lm_head.weight" and embedding is not None:
                    _load_one(model, params, shards, embedding, _Renamed(f, {embedding: stored}), file, loaded)
                    continue
                if (tied and name == "lm_head.weight") or (ignored and name.startswith(ignored)):
                    continue
                owner = dequant.owner(name)
                if owner is not None:
                    dequant.add(*owner, f.get_tensor(stored), params, shards, loaded)
                    continue
                if name not in params and (name.endswith((".k_scale", ".v_scale")) or (
                        name.endswith(".input_scale") and getattr(_module_of(model, name), "expert_weights", False))):
                    continue
                if name not in params:
                    why = getattr(model, "unexpected_tensor_reason", lambda n: None)(name)
                    raise ValueError(f"unexpected tensor {stored!r} in {file.name}: no such parameter in "
                                     f"{type(model).__name__}{': ' + why if why else ''}")
                try:
                    if name == stored:
                        _load_one(model, params, shards, name, f, file, loaded)
                    else:
                        _load_renamed(params, name, f.get_tensor(stored), loaded)
                except ValueError as e:
                    raise ValueError(f"{e} in {file.name}" if file.name not in str(e) else str(e)) from None
    # KV scales are optional: 1.0 unless the checkpoint has them
    missing = sorted(n for n in set(params) - loaded if not n.endswith((".k_scale", ".v_scale")))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _embedding_from_lm_head(model, files) -> str | None:
    """The embedding's parameter name when a tied checkpoint stores lm_head.weight and not the
    embedding (the tied tensor saved under its output name), else None."""
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    embedding = next(n for n, p in model.named_parameters() if p is model.lm_head.weight)
    return embedding if "lm_head.weight" in names and embedding not in names else None


class _Renamed:
    """A safetensors file whose tensors are asked for by other names ({asked: stored})."""

    def __init__(self, f, names: dict[str, str]):
        self.f, self.names = f, names

    def get_slice(self, name):
        return self.f.get_slice(self.names.get(name, name))

    def get_tensor(self, name):
        return self.f.get_tensor(self.names.get(name, name))


def _module_of(model, name: str):
    try:
        return model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


def _load_renamed(params, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    """A KV scale stored under an older name: one float32 element."""
    if tensor.numel() != 1:
        raise ValueError(f"tensor for {name!r} must hold one scale, got shape {tuple(tensor.shape)}")
    params[name].copy_(tensor.float().reshape(params[name].shape))
    loaded.add(name)


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    group: TensorParallelGroup = SINGLE,
    quantization: str | None = None,
    kv_scales: bool = False,
) -> torch.nn.Module:
    """Load a checkpoint directory (or build a config with random weights, load_format="dummy").

    quantization: the engine's (None, "fp8", "compressed-tensors"; with the checkpoint's
    quantization_config, `layers.quantization.resolve_quantization`). kv_scales: give the
    attention layers k_scale / v_scale parameters (an FP8 KV cache), loaded when the checkpoint
    has them, else 1.0.

    Returns the model in eval mode on `device` with `model.config` set: under tensor
    parallelism, rank `group.rank`'s shard (dummy weights then are drawn per shard). Raises
    ValueError for an unknown architecture or load_format, a missing file, a tensor that
    doesn't fit, or sizes the group cannot split (before any tensor is read).
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r}; expected 'auto', 'safetensors' or 'dummy'")
    config = load_config(model)
    torch_dtype = resolve_dtype(dtype, config)
    qconfig = resolve_quantization(config, quantization)
    net = build_model(config, torch_dtype, device, group, qconfig, kv_scales)
    if load_format == "dummy":
        net.init_dummy_weights(seed)
        init_dummy_fp8(net, seed, float(getattr(config, "initializer_range", 0.02)))
    else:
        if Path(model).is_file():
            raise ValueError(f"{model} is a bare config: use load_format='dummy'")
        load_weights(net, Path(model))
    widen_scales(net)
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
