"""Pointwise activations named as Hugging Face configs name them (`hidden_act`, `mlp_hidden_act`).

Plain PyTorch: each is one elementwise op that torch.compile fuses with its neighbours. Only the
names our model families use are listed; any other name is a ValueError naming the known ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _relu2(x: torch.Tensor) -> torch.Tensor:
    # squared ReLU (So et al. 2021, "Primer", section 4), Nemotron's MLP activation
    return torch.square(F.relu(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # the exact, erf-based GELU (transformers' "gelu")
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": F.relu,
    "relu2": _relu2,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function for a config's activation name. Raises ValueError if unknown."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        expected = ", ".join(sorted(_ACTIVATIONS))
        raise ValueError(f"unsupported activation {name!r}; expected one of {expected}") from None
