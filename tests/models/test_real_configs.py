"""Every real architecture's config in benchmarks/configs builds at full size (on the meta
device: no memory) with exactly as many parameters as transformers' own class for it, and
declares one state cache per Mamba layer and one KV cache per attention use."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from mambaserve.loader import load_config
from mambaserve.models import get_model_class

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
SUPPORTED = sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("file", SUPPORTED)
def test_real_config_matches_transformers_parameter_count(file):
    raw = json.loads((CONFIGS / file).read_text())
    config = load_config(CONFIGS / file)
    with torch.device("meta"):
        ours = get_model_class(config)(config)
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))

    def count(m):
        return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())

    assert count(ours) == count(theirs)
    spec = ours.cache_spec()
    assert len(spec.mamba) + len(spec.attention) > 0
    layer_types = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and "zamba" not in file:
        n_mamba = sum(t in ("mamba", "linear_attention", "M") for t in layer_types)
        assert len(spec.mamba) == n_mamba


def test_mamba1_layernorm_config_is_refused():
    """transformers builds RMSNorm blocks whatever `rms_norm` says; a LayerNorm Mamba-1 checkpoint
    would run as another model, so it is refused."""
    config = load_config(CONFIGS / "mamba-130m.json")
    config.rms_norm = False
    with pytest.raises(ValueError, match="rms_norm"):
        get_model_class(config)(config)
