"""mambaserve: serving Mamba2 and hybrid state-space language models.

Public API: `LLM` (offline generation), `SamplingParams` and its `StructuredOutputsParams`.
They are imported on first use, so that importing a lower part of the package
(`mambaserve.ops`, `mambaserve.layers`) loads neither the engine nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mambaserve.llm import LLM
    from mambaserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "mambaserve.llm", "SamplingParams": "mambaserve.sampling_params",
         "StructuredOutputsParams": "mambaserve.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'mambaserve' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
