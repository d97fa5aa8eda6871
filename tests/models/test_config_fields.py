"""Config fields a family's model does not implement are refused with a ValueError naming the
field (a checkpoint setting them would otherwise run as another model); the values the model
does implement still build. Built on the meta device from the real configs (or, for a family
without one here, a tiny config of tests/models/tiny.py): no memory."""

from pathlib import Path

import pytest
import torch

from mambaserve.loader import load_config
from mambaserve.models import get_model_class
from tests.models.tiny import CONFIGS as TINY

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"

# (config file, field, refused value, value that builds)
REFUSED = [
    ("mamba-codestral-7b.json", "hidden_act", "gelu", "silu"),
    ("mamba-codestral-7b.json", "norm_before_gate", True, False),
    ("mamba-codestral-7b.json", "rms_norm", False, True),
    ("bamba-9b.json", "hidden_act", "relu", "silu"),
    ("granite-4.0-h-tiny.json", "hidden_act", "gelu", "silu"),
    ("granite-4.0-h-tiny.json", "normalization_function", "layernorm", "rmsnorm"),
    ("jamba-v0.1.json", "hidden_act", "gelu", "silu"),
    ("nemotron-h-8b.json", "mamba_hidden_act", "gelu", "silu"),
    ("nemotron-h-8b.json", "residual_in_fp32", True, False),
    ("nemotron-h-8b.json", "sliding_window", 4096, None),
    ("zamba2-2.7b.json", "use_long_context", True, False),
    ("mamba-130m.json", "rms_norm", False, True),
    ("falcon-h1", "mamba_use_mlp", False, True),
    ("falcon-h1", "attn_layer_indices", [0], None),
]


def _config(file: str):
    """The config of a file under benchmarks/configs, or of a tiny config by name."""
    if file.endswith(".json"):
        return load_config(CONFIGS / file)
    import transformers

    kw = dict(TINY[file])
    arch = kw.pop("arch")
    return getattr(transformers, f"{arch}Config")(**kw, architectures=[f"{arch}ForCausalLM"])


def _build(file: str, **fields):
    config = _config(file)
    for name, value in fields.items():
        setattr(config, name, value)
    with torch.device("meta"):
        return get_model_class(config)(config)


@pytest.mark.parametrize("file,field,refused,ok", REFUSED, ids=[f"{f}-{k}" for f, k, _, _ in REFUSED])
def test_unimplemented_config_value_is_refused(file, field, refused, ok):
    with pytest.raises(ValueError, match=field):
        _build(file, **{field: refused})
    _build(file, **{field: ok})


@pytest.mark.parametrize("file", ["bamba-9b.json", "granite-4.0-h-tiny.json", "zamba2-2.7b.json"])
@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_scaled_rope_is_refused(file, layout):
    """A RoPE scaling (here linear x4) would change every rotation angle: refused in transformers
    5's layout and in the older `rope_scaling` one; the unscaled config builds."""
    rope_on = ({"position_embedding_type": "rope"} if "granite" in file
               else {"use_mem_rope": True} if "zamba2" in file else {})
    theta = {"rope_type": "default", "rope_theta": 10000.0}
    scaled = ({"rope_parameters": {**theta, "rope_type": "linear", "factor": 4.0}} if layout == "rope_parameters"
              else {"rope_parameters": theta, "rope_scaling": {"type": "linear", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        _build(file, **rope_on, **scaled)
    _build(file, **rope_on, rope_parameters=theta)


def test_mamba2_residual_in_fp32_is_read():
    assert _build("mamba-codestral-7b.json").residual_in_fp32 is True
    assert _build("mamba-codestral-7b.json", residual_in_fp32=False).residual_in_fp32 is False


def test_odd_partial_rotary_width_is_refused_naming_the_factor():
    """Bamba's RoPE turns the first partial_rotary_factor of each head (128 features): a factor giving an
    odd width is refused by name; one giving an even width builds."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        _build("bamba-9b.json", rope_parameters={**rope, "partial_rotary_factor": 0.2})
    _build("bamba-9b.json", rope_parameters={**rope, "partial_rotary_factor": 0.25})
