"""GraniteMoeHybridForCausalLM (IBM Granite 4.0-H): Mamba2 and attention layers by `layer_types`,
each followed by a MoE with a shared expert (or the shared dense MLP alone).

Granite's scalings: embeddings times embedding_multiplier, each residual branch times
residual_multiplier, attention scale attention_multiplier (not 1/sqrt(head_dim)), logits
divided by logits_scaling. Attention is NoPE or RoPE (position_embedding_type); RoPE turns the
whole head, as transformers' GraniteMoeHybrid does whatever a `partial_rotary_factor` says.
HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, mamba | self_attn,
post_attention_layernorm, block_sparse_moe.{router.layer, input_linear, output_linear},
shared_mlp.{input_linear, output_linear}}, model.norm, lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.linear import VocabParallelEmbedding
from mambaserve.layers.mlp import FusedGatedMLP
from mambaserve.layers.moe import GraniteMoE
from mambaserve.layers.norm import RMSNorm
from mambaserve.layers.rotary import RotaryEmbedding
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_checks import require_silu, require_value
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
            self.self_attn = attention_from_config(config, cache_index, scale=float(config.attention_multiplier),
                                                   rotary=rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_sparse_moe = None
        if config.num_local_experts > 0:
            self.block_sparse_moe = GraniteMoE(config.hidden_size, config.intermediate_size,
                                               config.num_local_experts, config.num_experts_per_tok)
        # with experts, the shared expert's partial sum is all-reduced with theirs (tensor parallelism)
        self.shared_mlp = FusedGatedMLP(config.hidden_size, config.shared_intermediate_size,
                                        reduce_results=self.block_sparse_moe is None)


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = None
        if getattr(config, "position_embedding_type", "nope") == "rope":
            rotary = rotary_from_config(config, attention_head_dim(config), whole_head=True)
        kinds = layer_kinds(config)
        self.layers = nn.ModuleList(_Layer(config, kind, i, rotary if kind == "attention" else None)
                                    for kind, i in zip(kinds, cache_indices(kinds)))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """IBM Granite 4.0-H: Mamba2 and attention layers, each followed by a top-k MoE and a shared
    expert, with Granite's embedding / residual / logits multipliers. forward(input_ids (T,),
    positions (T,), ctx) -> final-normed hidden (T, hidden). Raises ValueError for a hidden_act other
    than SiLU, a normalization_function other than rmsnorm or a scaled RoPE type."""

    def __init__(self, config):
        super().__init__(config)
        require_silu(config, "GraniteMoeHybrid", "hidden_act", "the Mamba conv, the experts and the shared MLP")
        # IBM's configs name their norm; transformers never reads the field and builds RMSNorms
        require_value(config, "GraniteMoeHybrid", "normalization_function", "rmsnorm", "every norm is an RMSNorm")
        self.model = _Model(config)
        self.make_lm_head(self.model.embed_tokens)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)
        self.logits_scale = float(config.logits_scaling)

    def finalize_weights(self) -> None:
        """After loading: each layer's shared expert joins its MoE as always-on experts when
        the sizes allow (GraniteMoE.absorb_shared_expert); its own module is then dropped."""
        for layer in self.model.layers:
            moe, shared = layer.block_sparse_moe, layer.shared_mlp
            if moe is not None and shared is not None and moe.absorb_shared_expert(shared):
                layer.shared_mlp = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # (T, hidden), the residual stream
        r = self.residual_multiplier
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            # partials: the mixer's / MoE's last sums are left to the next add_and_norm kernel
            x = layer.mamba(x, ctx, partials=True) if layer.kind == "mamba" else layer.self_attn(positions, x, ctx)
            x = layer.post_attention_layernorm.add_and_norm(x, h, r)  # h += r * x; x = norm(h)
            if layer.shared_mlp is None:  # absorbed into the MoE (finalize_weights)
                mlp = layer.block_sparse_moe(x, partials=True)
            else:
                mlp = layer.shared_mlp(x)
                if layer.block_sparse_moe is not None:
                    mlp = layer.block_sparse_moe(x, add=mlp)  # routed experts + shared expert
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = following.add_and_norm(mlp, h, r)
        return x
