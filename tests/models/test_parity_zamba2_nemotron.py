"""Zamba2 and Nemotron-H against transformers' own classes, float32, tiny random checkpoints.

The tiny configs live in `tests.models.tiny.CONFIGS`, so `test_parity.py`'s packed prefill +
decode test runs them too, and its mixed chunked + decode steps test takes them. Here, what is
particular to these families: Zamba2's
shared blocks stored once with one KV cache per depth, Nemotron-H's MoE path used under CUDA
graph capture, checkpoint tensors that are skipped, the float32 SSM default, and the real
configs building at full size on the meta device.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambaserve.loader import load_config, load_model
from mambaserve.models import get_model_class
from tests.conftest import rel_err
from tests.models.harness import Harness
from tests.models.tiny import checkpoint, hf_model, skip_unless_transformers_per_group

REAL_CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_zamba2_shared_blocks_stored_once_with_a_kv_cache_per_depth():
    name = "zamba2"  # hybrid depths at layers 1, 3, 4; num_mem_blocks 2: blocks 0, 1, 0
    ours = load_model(checkpoint(name), dtype="float32")
    stored = set(load_file(str(Path(checkpoint(name)) / "model.safetensors")))
    names = {n for n, _ in ours.named_parameters()}
    assert names == stored - {"lm_head.weight"}
    assert not any(n.startswith("model.layers.4.shared_transformer") for n in names)
    assert "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.0.weight" in names
    blocks = ours.model.blocks
    assert len(blocks) == 2 and blocks[0] is ours.model.layers[1].shared_transformer
    spec = ours.cache_spec()
    assert len(spec.mamba) == 6 and len(spec.attention) == 3

    # depths 0 and 2 share block 0's weights but not its cache: after one prefill each depth's
    # cache holds its own keys, and nothing else of the pool was written
    h = Harness(ours, 1, 8)
    for k, v in h.caches.kv:
        k.fill_(float("nan")), v.fill_(float("nan"))
    h.step({0: torch.randint(3, 193, (8,)).tolist()})
    slots = [h.caches.kv[d][0].flatten(0, 1)[:8] for d in range(3)]  # seq 0 owns blocks 0..1
    assert all(not s.isnan().any() for s in slots)
    assert not torch.allclose(slots[0], slots[2])
    assert all(k.flatten(0, 1)[8:].isnan().all() for k, _ in h.caches.kv)


def test_zamba2_attention_adapters_need_equal_kv_heads():
    import transformers

    cfg = transformers.Zamba2Config(hidden_size=32, num_hidden_layers=2, layers_block_type=["hybrid", "mamba"],
                                    num_attention_heads=4, num_key_value_heads=2, use_shared_attention_adapter=True,
                                    n_mamba_heads=4, vocab_size=64)
    cfg.architectures = ["Zamba2ForCausalLM"]
    with torch.device("meta"), pytest.raises(ValueError, match="num_key_value_heads"):
        get_model_class(cfg)(cfg)


def test_nemotron_moe_capture_path_equals_eager_path():
    """Under CUDA graph capture the experts run densely and select rows: same values."""
    ours = load_model(checkpoint("nemotron-h-moe"), dtype="float32")
    moe = ours.backbone.layers[1].mixer
    x = torch.randn(13, 16)
    weights, ids = moe.gate(torch.randn(13, 32))
    with torch.no_grad():
        sparse = moe.experts._per_pair_sorted(x, ids)
        dense = moe.experts._per_pair_dense(x, ids)
    assert rel_err(dense, sparse) < 1e-6


def test_nemotron_defaults_and_skipped_mtp_weights(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("nemotron-h"), dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(4, 4)  # the unused multi-token head
    save_file(tensors, dst / "model.safetensors")
    model = load_model(dst, dtype="float32")
    assert model.default_mamba_ssm_cache_dtype == "float32"
    assert [layer.kind for layer in model.backbone.layers] == ["mamba", "attention", "mlp", "mamba", "mlp"]
    tensors["backbone.layers.0.mixer.extra"] = torch.zeros(2)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match="backbone.layers.0.mixer.extra"):
        load_model(dst, dtype="float32")


@pytest.mark.skipif(not REAL_CONFIGS.is_dir(), reason="needs benchmarks/configs")
@pytest.mark.parametrize("file, params, n_mamba, n_attn", [
    ("zamba2-2.7b.json", 2.66e9, 54, 9),
    ("nemotron-h-8b.json", 8.10e9, 24, 4),
])
def test_real_configs_build_on_meta(file, params, n_mamba, n_attn):
    config = load_config(REAL_CONFIGS / file)
    with torch.device("meta"):
        model = get_model_class(config)(config)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - params) / params < 0.01, f"{n / 1e9:.3f} B parameters"
    spec = model.cache_spec()
    assert (len(spec.mamba), len(spec.attention)) == (n_mamba, n_attn)


@pytest.mark.parametrize("name", ["granite-moe", "bamba", "mamba2", "zamba2", "nemotron-h"])
def test_whole_dim_gated_norm_is_detected(name):
    """The check that makes parity tests skip under transformers 5.17: a gated norm normalising
    over the whole inner dimension (5.17's formula, put into the model here) is found, by class;
    the installed transformers' own norms are judged by what they compute."""
    from tests.models.tiny import _gated_norm_per_group, n_groups_of, whole_dim_gated_norms

    hf = hf_model(name)
    n = n_groups_of(hf.config)
    assert n > 1 and hf.whole_dim_gated_norms == whole_dim_gated_norms(hf, n)
    norms = [m for m in hf.modules() if type(m).__name__.endswith("RMSNormGated")]
    assert norms
    for m in norms:
        width = m.weight.shape[0]
        m.forward = lambda x, z=None, m=m, width=width: _gated_norm_per_group(m, x, z, width)  # one group
    assert whole_dim_gated_norms(hf, n) == [type(norms[0]).__name__]
    hf.whole_dim_gated_norms = whole_dim_gated_norms(hf, n)
    with pytest.raises(pytest.skip.Exception, match="whole inner dimension"):
        skip_unless_transformers_per_group(hf)
