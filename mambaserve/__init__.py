"""mambaserve: serving Mamba2 and hybrid state-space language models.

Public API: `LLM` (offline generation) and `SamplingParams`.
"""

from mambaserve.llm import LLM
from mambaserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
