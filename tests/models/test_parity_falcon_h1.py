"""Falcon-H1 against transformers' own FalconH1ForCausalLM, float32, tiny random checkpoints.

The tiny configs live in `tests.models.tiny.CONFIGS`, so `test_parity.py`'s shared tests take
them: packed prefill + decode, mixed chunked and decode steps against transformers, and the
whole model on the Triton path (the scan kernels taking the gate z when the mixer has no norm)
against the reference ops. Here, what only Falcon-H1 has: the muP multipliers are folded into
exactly the weights the module docstring names; configs we cannot run are refused.
"""

import pytest
import torch
from safetensors.torch import load_file

from mambaserve.loader import load_model
from tests.models.tiny import checkpoint, hf_model


def test_multipliers_are_folded_into_the_named_weights():
    name = "falcon-h1-norm"  # every projection has a bias here
    cfg = hf_model(name).config
    stored = load_file(f"{checkpoint(name)}/model.safetensors")
    ours = load_model(checkpoint(name), dtype="float32")
    params = dict(ours.named_parameters())
    p = "model.layers.1."
    I, GN, H = 48, 2 * 8, 6
    seg = torch.cat([torch.full((n,), v) for n, v in zip([I, I, GN, GN, H], cfg.ssm_multipliers)])
    a_in, km = cfg.attention_in_multiplier, cfg.key_multiplier
    expect = {
        "mamba.in_proj.weight": stored[p + "mamba.in_proj.weight"] * (seg * cfg.ssm_in_multiplier)[:, None],
        "mamba.in_proj.bias": stored[p + "mamba.in_proj.bias"] * seg,
        "mamba.out_proj.weight": stored[p + "mamba.out_proj.weight"] * cfg.ssm_out_multiplier,
        "mamba.out_proj.bias": stored[p + "mamba.out_proj.bias"] * cfg.ssm_out_multiplier,
        "self_attn.q_proj.weight": stored[p + "self_attn.q_proj.weight"] * a_in,
        "self_attn.q_proj.bias": stored[p + "self_attn.q_proj.bias"],
        "self_attn.k_proj.weight": stored[p + "self_attn.k_proj.weight"] * (a_in * km),
        "self_attn.k_proj.bias": stored[p + "self_attn.k_proj.bias"] * km,
        "self_attn.o_proj.bias": stored[p + "self_attn.o_proj.bias"] * cfg.attention_out_multiplier,
        "feed_forward.gate_proj.bias": stored[p + "feed_forward.gate_proj.bias"] * cfg.mlp_multipliers[0],
        "feed_forward.up_proj.weight": stored[p + "feed_forward.up_proj.weight"],
        "feed_forward.down_proj.weight": stored[p + "feed_forward.down_proj.weight"] * cfg.mlp_multipliers[1],
        "mamba.norm.weight": stored[p + "mamba.norm.weight"],
    }
    for key, want in expect.items():
        torch.testing.assert_close(params[p + key], want, rtol=1e-6, atol=0, msg=key)
    with pytest.raises(RuntimeError, match="already folded"):
        ours.finalize_weights()


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "rope_type"),
])
def test_unsupported_configs_are_refused(field, value, match):
    from mambaserve.models import get_model_class

    config = hf_model("falcon-h1").config
    config = type(config).from_dict({**config.to_dict(), field: value})
    config.architectures = ["FalconH1ForCausalLM"]
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        get_model_class(config)(config)


def test_documented_scale_builds_on_meta_with_transformers_parameter_count():
    """Falcon-H1-1.5B's shapes as transformers' model page tabulates them (24 layers, hidden
    2,048, 8 attention heads of 128 with 2 KV heads, 48 Mamba heads of 64, d_state 256); the
    fields the table omits keep transformers' defaults, so this is not the published config."""
    import transformers

    from mambaserve.models import get_model_class

    config = transformers.FalconH1Config(num_hidden_layers=24, hidden_size=2048, num_attention_heads=8,
                                         num_key_value_heads=2, head_dim=128, mamba_n_heads=48, mamba_d_head=64,
                                         mamba_d_ssm=3072, mamba_d_state=256, intermediate_size=8192)
    config.architectures = ["FalconH1ForCausalLM"]
    with torch.device("meta"):
        ours = get_model_class(config)(config)
        theirs = transformers.FalconH1ForCausalLM(config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    spec = ours.cache_spec()
    assert len(spec.mamba) == len(spec.attention) == 24
    assert spec.attention[0].head_dim == 128 and spec.mamba[0].ssm_shape == (48, 64, 256)
