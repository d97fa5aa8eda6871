"""BambaForCausalLM: Mamba2 layers with a few RoPE attention layers, each followed by a gated MLP.

HF names: model.embed_tokens, model.layers.{i}.input_layernorm, .mamba.* or .self_attn.*,
.pre_ff_layernorm, .feed_forward.{gate,up,down}_proj, model.final_layernorm, lm_head.
Attention layers are given by `attn_layer_indices`; RoPE rotates the first
partial_rotary_factor (0.5) of each head; the softmax scale is 1/sqrt(head_dim), with
head_dim = hidden_size // num_attention_heads unless the config sets one (as transformers).
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.linear import VocabParallelEmbedding
from mambaserve.layers.mlp import GatedMLP
from mambaserve.layers.norm import RMSNorm
from mambaserve.layers.rotary import RotaryEmbedding
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_checks import require_silu
from mambaserve.models.config_utils import (
    attention_from_config,
    attention_head_dim,
    cache_indices,
    layer_kinds,
    mamba_mixer_from_config,
    rotary_from_config,
)


class _Layer(nn.Module):
    def __init__(self, config, kind: str, cache_index: int, rotary: RotaryEmbedding | None):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if kind == "mamba":
            self.mamba = mamba_mixer_from_config(config, cache_index)
        else:
            self.self_attn = attention_from_config(config, cache_index, rotary=rotary)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size,
                                     bias=getattr(config, "mlp_bias", False))


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = rotary_from_config(config, attention_head_dim(config))
        kinds = layer_kinds(config)
        self.layers = nn.ModuleList(_Layer(config, kind, i, rotary if kind == "attention" else None)
                                    for kind, i in zip(kinds, cache_indices(kinds)))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BambaForCausalLM(HybridForCausalLM):
    """Bamba (ibm-ai-platform/Bamba-9B): Mamba2 and attention decoder layers, each followed by
    a SwiGLU MLP. forward(input_ids (T,), positions (T,), ctx) -> final-normed hidden (T, hidden).
    Raises ValueError for a hidden_act other than SiLU or a scaled RoPE type."""

    def __init__(self, config):
        super().__init__(config)
        require_silu(config, "Bamba", "hidden_act", "the Mamba conv and the MLP")
        self.model = _Model(config)
        self.make_lm_head(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # (T, hidden), the residual stream
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            x = layer.mamba(x, ctx, partials=True) if layer.kind == "mamba" else layer.self_attn(positions, x, ctx)
            x = layer.feed_forward(layer.pre_ff_layernorm.add_and_norm(x, h))  # h += x first
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.final_layernorm
            x = following.add_and_norm(x, h)
        return x
