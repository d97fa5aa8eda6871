"""JambaForCausalLM (AI21's Jamba, Lieber et al. 2024, arXiv 2403.19887): Mamba-1 mixers and
attention layers, each followed by a dense SiLU-gated MLP or a top-k MoE of such experts.

The layer pattern comes from two periods: layer i is attention when i % attn_layer_period ==
attn_layer_offset (else Mamba-1; `layer_kinds`), and its feed-forward is a MoE of num_experts experts when
i % expert_layer_period == expert_layer_offset and num_experts > 1 (else a dense MLP).
Every layer is h += mixer(input_layernorm(h)); h += feed_forward(pre_ff_layernorm(h)); the
stack ends with final_layernorm.
- Mamba: the Mamba-1 mixer with RMSNorms on dt, B and C after x_proj (`MambaMixer` with
  `dt_bc_norm_eps`); `use_mamba_kernels` only chooses transformers' kernels and is ignored.
- attention: GQA without any positional encoding (the Mamba layers carry position), scale
  1/sqrt(head_dim), no biases.
- MoE: softmax over all experts, the top-k probabilities unrenormalised (`SoftmaxTopKRouter`),
  SiLU-gated experts in `ops.fused_moe`.
The math follows transformers' `models/jamba/modeling_jamba.py` (v5, its PyTorch path).
HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, mamba.{in_proj, conv1d, x_proj,
dt_proj, A_log, D, out_proj, dt_layernorm, b_layernorm, c_layernorm} | self_attn.{q,k,v,o}_proj,
pre_ff_layernorm, feed_forward.{gate_proj, up_proj, down_proj | router.weight,
experts.{e}.{gate_proj, up_proj, down_proj}}}, model.final_layernorm, lm_head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.linear import VocabParallelEmbedding
from mambaserve.layers.mamba1 import MambaMixer
from mambaserve.layers.mlp import GatedMLP
from mambaserve.layers.moe import SparseMoeBlock
from mambaserve.layers.norm import RMSNorm
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_utils import attention_from_config, cache_indices, layer_kinds


def jamba_moe_layers(config) -> list[bool]:
    """Per layer: whether its feed-forward is a MoE (i % expert_layer_period ==
    expert_layer_offset, and num_experts > 1). Raises ValueError when an offset (the experts'
    or the attention layers', which transformers' `layers_block_type` reads unchecked) is not
    below its period."""
    a_period, a_offset = config.attn_layer_period, config.attn_layer_offset
    e_period, e_offset = config.expert_layer_period, config.expert_layer_offset
    if not (0 <= a_offset < a_period and 0 <= e_offset < e_period):
        raise ValueError(f"Jamba layer offsets must lie in [0, period): attention {a_offset} of {a_period}, "
                         f"experts {e_offset} of {e_period}")
    return [config.num_experts > 1 and i % e_period == e_offset for i in range(config.num_hidden_layers)]


def _dt_rank(config) -> int:
    rank = config.mamba_dt_rank
    return math.ceil(config.hidden_size / 16) if rank == "auto" else int(rank)


class _Layer(nn.Module):
    def __init__(self, config, kind: str, moe: bool, cache_index: int):
        super().__init__()
        self.kind = kind
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        if kind == "mamba":
            self.mamba = MambaMixer(
                hidden_size=H,
                intermediate_size=config.mamba_expand * H,
                d_state=config.mamba_d_state,
                conv_kernel=config.mamba_d_conv,
                time_step_rank=_dt_rank(config),
                use_conv_bias=config.mamba_conv_bias,
                use_bias=config.mamba_proj_bias,
                activation=config.hidden_act,
                dt_bc_norm_eps=config.rms_norm_eps,
                cache_index=cache_index,
            )
        else:
            self.self_attn = attention_from_config(config, cache_index, bias=False)  # transformers: no biases
        self.pre_ff_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        if moe:
            self.feed_forward = SparseMoeBlock(H, config.intermediate_size, config.num_experts,
                                               config.num_experts_per_tok)
        else:
            self.feed_forward = GatedMLP(H, config.intermediate_size)


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        moe = jamba_moe_layers(config)  # checks the periods first
        kinds = layer_kinds(config)
        self.layers = nn.ModuleList(_Layer(config, kind, m, i) for kind, m, i in zip(kinds, moe, cache_indices(kinds)))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class JambaForCausalLM(HybridForCausalLM):
    """Jamba: Mamba-1 (with dt/B/C norms) and NoPE attention layers, dense or MoE feed-forwards.
    forward(input_ids (T,), positions (T,), ctx) -> final-normed hidden (T, hidden); positions
    are unused (no layer has a positional encoding).

    Raises ValueError for a hidden_act other than SiLU (the experts, the MLPs and the Mamba conv
    all use it; our fused experts and conv are SiLU only).
    """

    def __init__(self, config):
        super().__init__(config)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Jamba hidden_act {config.hidden_act!r}: only 'silu' is supported")
        self.model = _Model(config)
        self.make_lm_head(self.model.embed_tokens)

    def finalize_weights(self) -> None:
        """After loading: each MoE's per-expert checkpoint weights are stacked for the fused MoE."""
        for layer in self.model.layers:
            if isinstance(layer.feed_forward, SparseMoeBlock):
                layer.feed_forward.stack_experts()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # (T, hidden), the residual stream
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            # partials: the mixer's / MoE's last sums are left to the next add_and_norm kernel
            x = layer.mamba(x, ctx, partials=True) if layer.kind == "mamba" else layer.self_attn(positions, x, ctx)
            x = layer.pre_ff_layernorm.add_and_norm(x, h)  # h += x; x = norm(h)
            ff = layer.feed_forward
            x = ff(x, partials=True) if isinstance(ff, SparseMoeBlock) else ff(x)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.final_layernorm
            x = following.add_and_norm(x, h)
        return x
