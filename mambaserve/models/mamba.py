"""MambaForCausalLM (Mamba-1, e.g. state-spaces/mamba-130m-hf): pre-norm Mamba-1 mixers only.

HF names: backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*,
backbone.norm_f, lm_head (tied to the embeddings when tie_word_embeddings, the default).
Each block is h = h + mixer(rmsnorm(h)); with residual_in_fp32 (the default) the residual
stream h is kept in float32 whatever the model dtype, and the normed activations that feed the
mixers are in the model dtype. The SSM state dtype follows the engine's mamba_ssm_cache_dtype
("auto": the model dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.mamba1 import MambaMixer
from mambaserve.layers.norm import RMSNorm
from mambaserve.models.base import HybridForCausalLM, MambaBackbone


class _Block(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = MambaMixer(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            d_state=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias,
            activation=config.hidden_act,
            cache_index=index,
        )


class MambaForCausalLM(HybridForCausalLM):
    """Mamba-1: pre-norm Mamba-1 mixers. forward(input_ids (T,), positions (T,), ctx) ->
    final-normed hidden (T, hidden) in the model dtype; positions are unused.

    Raises ValueError for a config whose blocks use LayerNorm (`rms_norm: false`): transformers
    builds RMSNorm regardless, which would silently compute another model.
    """

    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "rms_norm", True) is False:
            raise ValueError("MambaForCausalLM with rms_norm=false (LayerNorm blocks) is not supported")
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
            # h += mixer(x); x = norm(h). Partial sums come back in h's dtype: float32 for a
            # float32 residual stream, while the next in_proj takes the model dtype.
            x = following.add_and_norm(layer.mixer(x, ctx, partials=True), h).to(emb.dtype)
        return x
