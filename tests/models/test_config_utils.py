"""The shared config readers: one layer-pattern parser for every way configs write it, the
cache indices it implies, and attention / Mamba2 layers built from the usual HF fields."""

from types import SimpleNamespace

import pytest

from mambaserve.models.config_utils import (
    attention_from_config,
    cache_indices,
    layer_kinds,
    rope_settings,
    rotary_from_config,
)


def test_every_pattern_field_gives_the_same_kinds():
    want = ["mamba", "attention", "mamba", "mamba", "attention"]
    names = ["linear_attention", "full_attention", "mamba", "mamba", "attention"]
    assert layer_kinds(SimpleNamespace(num_hidden_layers=5, layers_block_type=names)) == want
    assert layer_kinds(SimpleNamespace(num_hidden_layers=5, layer_types=names)) == want
    assert layer_kinds(SimpleNamespace(num_hidden_layers=5, hybrid_override_pattern="M*MM*")) == want  # Nemotron-H
    assert layer_kinds(SimpleNamespace(num_hidden_layers=5, attn_layer_indices=[1, 4])) == want  # Bamba
    jamba = SimpleNamespace(num_hidden_layers=5, attn_layer_period=3, attn_layer_offset=1)
    assert layer_kinds(jamba) == ["mamba", "attention", "mamba", "mamba", "attention"]


def test_kinds_outside_the_family_and_bad_patterns_are_clear_errors():
    allowed = ("mamba", "attention", "mlp", "moe")
    # Nemotron-H without transformers 5's layers_block_type (and no num_hidden_layers to check)
    assert layer_kinds(SimpleNamespace(layers_block_type=None, hybrid_override_pattern="M*-E"), allowed) == [
        "mamba", "attention", "mlp", "moe"]
    with pytest.raises(ValueError, match="unknown layer symbols"):
        layer_kinds(SimpleNamespace(layers_block_type=None, hybrid_override_pattern="M*X"), allowed)
    with pytest.raises(ValueError, match=r"unknown layer types \['mlp'\]"):
        layer_kinds(SimpleNamespace(num_hidden_layers=2, layer_types=["mamba", "mlp"]))
    with pytest.raises(ValueError, match="'hybrid'"):
        layer_kinds(SimpleNamespace(num_hidden_layers=2, layer_types=["mamba", "cross"]), ("mamba", "hybrid"))
    with pytest.raises(ValueError, match="3 entries for num_hidden_layers=2"):
        layer_kinds(SimpleNamespace(num_hidden_layers=2, layers_block_type=["mamba"] * 3))
    with pytest.raises(ValueError, match="no layer pattern"):
        layer_kinds(SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(ValueError, match="attn_layer_offset"):
        layer_kinds(SimpleNamespace(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=2))


def test_cache_indices_count_each_cache_kind_apart():
    kinds = ["mamba", "attention", "mlp", "hybrid", "moe", "attention", "mamba"]
    assert cache_indices(kinds) == [0, 0, -1, 1, -1, 1, 2]


def _attention_config(**fields):
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    return SimpleNamespace(**{**base, **fields})


def test_attention_from_config_reads_the_usual_fields_and_takes_overrides():
    attn = attention_from_config(_attention_config(), 3)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.cache_indices) == (4, 2, 8, (3,))
    assert attn.scale == 8**-0.5 and attn.q_proj.bias is None and attn.rotary is None
    attn = attention_from_config(_attention_config(head_dim=16, attention_bias=True), 0)
    assert attn.head_dim == 16 and attn.scale == 0.25 and attn.q_proj.bias is not None
    assert attn.q_proj.weight.shape == (64, 32) and attn.o_proj.weight.shape == (32, 64)
    attn = attention_from_config(_attention_config(attention_bias=True), 0, bias=False, scale=0.5, head_dim=4)
    assert attn.q_proj.bias is None and attn.scale == 0.5 and attn.head_dim == 4
    # Zamba2's shared block: wider input, one KV cache and one set of q/k/v adapters per depth
    shared = attention_from_config(_attention_config(num_key_value_heads=4), (0, 2), input_size=64, lora_rank=3)
    assert shared.cache_indices == (0, 2) and shared.q_proj.weight.shape == (32, 64)
    assert sorted(shared.linear_k_adapter_list) == ["0", "2"]
    assert shared.linear_k_adapter_list["2"][0].weight.shape == (3, 64)


def test_rope_settings_read_both_layouts_and_reject_scaled_variants():
    assert rope_settings(SimpleNamespace(rope_theta=500.0)) == (500.0, 1.0)
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    assert rope_settings(new) == (1e6, 0.5)
    assert rotary_from_config(new, 16).rotary_dim == 8 and rotary_from_config(new, 16, whole_head=True).rotary_dim == 16
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        rope_settings(SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
