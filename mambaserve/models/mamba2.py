"""Mamba2ForCausalLM (Mamba-Codestral): a stack of pre-norm Mamba2 mixers, no attention.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head (tied to the embeddings when tie_word_embeddings).
Each block is h = h + mixer(rmsnorm(h)); with residual_in_fp32 (the config default, set in
Mamba-Codestral's config) the residual stream h is kept in float32 whatever the model dtype, as
in transformers and mamba_ssm: rounding h to bfloat16 at every layer adds an error that grows
with depth. The normed activations that feed the mixers are in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.norm import RMSNorm
from mambaserve.models.base import HybridForCausalLM, MambaBackbone
from mambaserve.models.config_checks import require_silu, require_value
from mambaserve.models.config_utils import dt_limit


class _Block(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            d_state=config.state_size,
            n_groups=config.n_groups,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            intermediate_size=int(config.expand * config.hidden_size),
            use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias,
            eps=config.layer_norm_epsilon,
            dt_limit=dt_limit(config),
            cache_index=index,
        )


class Mamba2ForCausalLM(HybridForCausalLM):
    """Mamba2 (Mamba-Codestral): pre-norm Mamba2 mixers only. forward(input_ids (T,), positions
    (T,), ctx) -> final-normed hidden (T, hidden) in the model dtype; positions are unused.
    Raises ValueError for a hidden_act other than SiLU, and for the mamba_ssm options that
    Mamba-Codestral's config carries but transformers never reads (`norm_before_gate`,
    `rms_norm`) set to another gated norm than the one both compute."""

    def __init__(self, config):
        super().__init__(config)
        require_silu(config, "Mamba2", "hidden_act", "the Mamba conv")
        require_value(config, "Mamba2", "norm_before_gate", False,
                      "the mixer's RMSNorm normalises y * silu(z), gating before the norm")
        require_value(config, "Mamba2", "rms_norm", True, "the mixer's output always goes through its gated RMSNorm")
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))
        self.backbone = MambaBackbone(config, _Block)
        self.make_lm_head(self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        emb = self.backbone.embeddings(input_ids)  # (T, hidden), model dtype
        layers = self.backbone.layers
        x = layers[0].norm(emb)
        h = emb.float() if self.residual_in_fp32 else emb  # the residual stream
        for i, layer in enumerate(layers):
            following = layers[i + 1].norm if i + 1 < len(layers) else self.backbone.norm_f
            # h += mixer(x); x = norm(h), cast back to the model dtype for the next in_proj
            x = following.add_and_norm(layer.mixer(x, ctx, partials=True), h).to(emb.dtype)
        return x
