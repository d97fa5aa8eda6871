"""Checkpoint loading: sharded files, tied embeddings, dtypes, dummy weights, and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambaserve.loader import load_model
from tests.models.tiny import checkpoint


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(checkpoint(name), dst)
    return dst


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    src = _copy("bamba", tmp_path)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    (src / "model.safetensors").unlink()
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, src / file)
        weight_map.update({k: file for k in keys})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = dict(load_model(checkpoint("bamba")).named_parameters())
    b = dict(load_model(src).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_share_storage():
    m = load_model(checkpoint("granite-moe"))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    m = load_model(checkpoint("mamba2"))
    assert m.lm_head.weight.data_ptr() == m.backbone.embeddings.weight.data_ptr()


@pytest.mark.parametrize("name, embedding", [("granite-moe", "model.embed_tokens.weight"),
                                             ("mamba2", "backbone.embeddings.weight")])
def test_a_tied_checkpoint_storing_only_lm_head_loads_it_as_the_embedding(tmp_path, name, embedding):
    """transformers ties the two and loads either name; such checkpoints used to be refused as
    lacking the embedding."""
    src = _copy(name, tmp_path)
    tensors = load_file(src / "model.safetensors")
    table = torch.randn_like(tensors.pop(embedding))  # fresh values: not the embedding it replaces
    save_file({**tensors, "lm_head.weight": table}, src / "model.safetensors")
    m = load_model(src)
    assert torch.equal(m.get_parameter(embedding), table.to(m.get_parameter(embedding).dtype))
    assert m.lm_head.weight is m.get_parameter(embedding)
    ref = dict(load_model(checkpoint(name)).named_parameters())
    assert all(torch.equal(p, ref[k]) for k, p in m.named_parameters() if k != embedding)


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    src = _copy("mamba2", tmp_path)
    tensors = load_file(src / "model.safetensors")
    name = "backbone.layers.1.mixer.D"
    save_file({k: v for k, v in tensors.items() if k != name}, src / "model.safetensors")
    with pytest.raises(ValueError, match="backbone.layers.1.mixer.D"):
        load_model(src)
    save_file({**tensors, "backbone.extra.weight": torch.ones(2)}, src / "model.safetensors")
    with pytest.raises(ValueError, match="backbone.extra.weight"):
        load_model(src)
    bad = dict(tensors)
    bad[name] = torch.ones(7)
    save_file(bad, src / "model.safetensors")
    with pytest.raises(ValueError, match=r"backbone.layers.1.mixer.D.*\(7,\)"):
        load_model(src)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_keep_ssm_parameters_in_float32(dtype):
    m = load_model(checkpoint("bamba"), dtype=dtype)
    assert m.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert m.model.layers[0].mamba.A_log.dtype == torch.float32


def test_dummy_weights_from_a_bare_config(tmp_path):
    path = tmp_path / "cfg.json"
    src = json.loads(open(checkpoint("granite-moe") + "/config.json").read())
    path.write_text(json.dumps(src))
    m = load_model(path, load_format="dummy", dtype="float32")
    w = m.model.layers[0].mamba.in_proj.weight.detach()
    std = src["initializer_range"]
    assert torch.isfinite(w).all() and 0.8 * std < float(w.std()) < 1.2 * std
    with pytest.raises(ValueError, match="dummy"):
        load_model(path)
    with pytest.raises(ValueError, match="load_format"):
        load_model(path, load_format="pt")


def test_granite_shared_expert_absorbed_once_and_moves_with_the_model():
    """The absorbed shared expert lives in the MoE's own stacked parameters: a second
    finalize_weights changes nothing, and .to() converts it with the rest of the model."""
    import torch

    from mambaserve.loader import load_model
    from tests.models.tiny import checkpoint

    model = load_model(checkpoint("granite-moe-absorbed"), dtype="float32")
    moe = model.model.layers[0].block_sparse_moe
    E = model.config.num_local_experts
    assert moe.num_shared == 2 and moe.input_linear.weight.shape[0] == E + 2
    x = torch.randn(1, model.config.hidden_size)
    before = moe(x)
    model.finalize_weights()  # idempotent
    assert moe.num_shared == 2 and moe.input_linear.weight.shape[0] == E + 2
    model.to(torch.float64)
    assert moe.input_linear.weight.dtype == torch.float64 and moe.output_linear.weight.dtype == torch.float64
    assert torch.allclose(moe(x.double()).float(), before, atol=1e-5)


def test_a_zamba2_shared_block_copied_per_depth_is_refused_saying_why(tmp_path):
    """transformers 5 saves an untied Zamba2's shared blocks once per depth; the error used to
    name only the tensor."""
    src = _copy("zamba2", tmp_path)
    tensors = load_file(src / "model.safetensors")
    first = sorted({k.split(".shared_transformer.")[0] for k in tensors if ".shared_transformer." in k})[0]
    later = [k for k in tensors if k.startswith("model.layers.") and ".linear." in k and not k.startswith(first + ".")]
    layer = later[0].split(".linear.")[0]
    copy = {k.replace(first, layer, 1): v.clone() for k, v in tensors.items() if k.startswith(first + ".shared_")}
    save_file({**tensors, **copy}, src / "model.safetensors")
    with pytest.raises(ValueError, match=r"shared_transformer.*copy of a shared transformer block at a later depth"):
        load_model(src)
