"""Model families, and the registry from a checkpoint's HF `architectures` name to our class."""

from __future__ import annotations

import importlib

# HF architecture name -> (module, class). Imported lazily so one broken family can't break the rest.
_REGISTRY = {
    "MambaForCausalLM": ("mambaserve.models.mamba", "MambaForCausalLM"),
    "Mamba2ForCausalLM": ("mambaserve.models.mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("mambaserve.models.bamba", "BambaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("mambaserve.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "Zamba2ForCausalLM": ("mambaserve.models.zamba2", "Zamba2ForCausalLM"),
    "NemotronHForCausalLM": ("mambaserve.models.nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("mambaserve.models.falcon_h1", "FalconH1ForCausalLM"),
    "JambaForCausalLM": ("mambaserve.models.jamba", "JambaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(config):
    """The model class for a transformers config, by its `architectures` field.

    Raises ValueError naming the supported architectures when none of the config's is known.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _REGISTRY:
            module, name = _REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; "
        f"mambaserve supports: {', '.join(supported_architectures())}"
    )
