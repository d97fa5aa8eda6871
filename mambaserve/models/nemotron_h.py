"""NemotronHForCausalLM (NVIDIA Nemotron-H, Nemotron-Nano-2, Nemotron-3): a stack of
single-purpose pre-norm residual layers, one kind per layer.

The layer pattern is `hybrid_override_pattern` ("M" Mamba2, "*" attention, "-" MLP, "E" MoE),
which transformers turns into `layers_block_type` ("linear_attention", "full_attention", "mlp",
"moe"). Every layer is h = h + mixer(norm(h)); there is no separate MLP after a mixer.
- attention: GQA with no positional embedding at all (the Mamba layers carry position),
  softmax scale 1/sqrt(head_dim), no biases (transformers ignores `attention_bias`);
- MLP: down(relu2(up(x))) (squared ReLU, no gate);
- MoE: sigmoid group-limited routing over ungated relu2 experts plus a shared expert, with an
  optional latent projection around the routed experts (`mambaserve.layers.moe`; the experts
  are plain PyTorch for now, as `ops.fused_moe` is SiLU-gated only);
- RMSNorm multiplies by its weight in float32 before casting (the reference's order).
The SSM state defaults to float32 (`default_mamba_ssm_cache_dtype`, from the config's
`mamba_ssm_cache_dtype`), as in the reference.

The math follows transformers' `models/nemotron_h/modeling_nemotron_h.py` (v5), including two
of its choices: the Mamba time step is clamped below at `time_step_min` (its prefill applies
`dt_limit=(time_step_min, inf)` and ignores `time_step_limit`; its one-token decode step skips
the clamp, we apply it in both so that decoding equals a full forward); in_proj/out_proj biases
follow `use_bias` (not `mamba_proj_bias`).
HF names (as the published checkpoints and transformers' save_pretrained write them):
backbone.embeddings, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.{Mamba2 names |
q_proj, k_proj, v_proj, o_proj | up_proj, down_proj | gate.weight, gate.e_score_correction_bias,
experts.{e}.up_proj, experts.{e}.down_proj, shared_experts.{up,down}_proj,
fc1_latent_proj, fc2_latent_proj}, backbone.norm_f, lm_head (never tied, as in transformers).
Multi-token-prediction weights (`mtp.*`) are not used and are skipped when loading.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.distributed import all_reduce, current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.linear import ParallelLMHead, VocabParallelEmbedding, linear_of_partial, replicated_linear
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.mlp import MLP
from mambaserve.layers.moe import SigmoidGroupRouter, UngatedExperts
from mambaserve.layers.norm import RMSNorm
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_checks import require_value
from mambaserve.models.config_utils import attention_from_config, cache_indices, layer_kinds

_KINDS = ("mamba", "attention", "mlp", "moe")


class NemotronHMoE(nn.Module):
    """Routed ungated experts (optionally in a latent space) plus one shared expert.

    x: (num_tokens, hidden) -> (num_tokens, hidden). The router and the shared expert read x;
    the routed experts read fc1_latent_proj(x) when moe_latent_size is set, and their weighted
    sum goes back through fc2_latent_proj. Under tensor parallelism the router and the latent
    projections are whole on every rank, the experts and the shared expert split; the rank's
    routed sum (through fc2, which is linear) and shared sum are partial: one all-reduce.
    """

    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        latent = getattr(config, "moe_latent_size", None)
        act = config.mlp_hidden_act
        self.gate = SigmoidGroupRouter(H, config.n_routed_experts, config.num_experts_per_tok,
                                       n_group=config.n_group, topk_group=config.topk_group,
                                       norm_topk_prob=config.norm_topk_prob,
                                       routed_scaling_factor=config.routed_scaling_factor)
        self.experts = UngatedExperts(latent or H, config.moe_intermediate_size, config.n_routed_experts, act)
        self.shared_experts = MLP(H, config.moe_shared_expert_intermediate_size, act, bias=config.mlp_bias,
                                  reduce_results=False)
        self.fc1_latent_proj = replicated_linear(H, latent, bias=config.mlp_bias) if latent else None
        self.fc2_latent_proj = replicated_linear(latent, H, bias=config.mlp_bias) if latent else None
        self.tp_group = current_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # (T, k) float32, (T, k)
        routed_in = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        routed = self.experts(routed_in, weights, ids)  # the rank's partial sum
        if self.fc2_latent_proj is not None:
            routed = linear_of_partial(self.fc2_latent_proj, routed)
        return all_reduce(routed + self.shared_experts(x), self.tp_group)


class _Block(nn.Module):
    def __init__(self, config, kind: str, cache_index: int):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, scale_in_float32=True)
        if kind == "mamba":
            if getattr(config, "mamba_hidden_act", "silu") != "silu":
                raise ValueError(f"Nemotron-H mamba_hidden_act {config.mamba_hidden_act!r}: only 'silu' is supported")
            self.mixer = Mamba2Mixer(
                hidden_size=config.hidden_size,
                num_heads=config.mamba_num_heads,
                head_dim=config.mamba_head_dim,
                d_state=config.ssm_state_size,
                n_groups=config.n_groups,
                conv_kernel=config.conv_kernel,
                chunk_size=config.chunk_size,
                use_conv_bias=config.use_conv_bias,
                use_bias=config.use_bias,
                eps=config.layer_norm_epsilon,
                dt_limit=(float(config.time_step_min), float("inf")),
                cache_index=cache_index,
            )
        elif kind == "attention":
            self.mixer = attention_from_config(config, cache_index, bias=False)  # transformers ignores attention_bias
        elif kind == "mlp":
            self.mixer = MLP(config.hidden_size, config.intermediate_size, config.mlp_hidden_act, bias=config.mlp_bias)
        else:
            self.mixer = NemotronHMoE(config)


class _Backbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        kinds = layer_kinds(config, allowed=_KINDS)
        self.layers = nn.ModuleList(_Block(config, kind, i) for kind, i in zip(kinds, cache_indices(kinds)))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, scale_in_float32=True)


class NemotronHForCausalLM(HybridForCausalLM):
    """forward(input_ids (T,), positions (T,), ctx) -> hidden (T, hidden). Positions are unused:
    no layer has a positional embedding. Raises ValueError for config fields transformers' Nemotron-H
    carries but never applies (`residual_in_fp32`, `sliding_window`) set to take effect."""

    checkpoint_ignore_prefixes = ("mtp.",)
    default_mamba_ssm_cache_dtype = "float32"

    def __init__(self, config):
        super().__init__(config)
        # Both are config fields that transformers' model never reads: the residual stream stays
        # in the model dtype and attention is global. A checkpoint that sets them was trained
        # with something neither implementation computes.
        require_value(config, "Nemotron-H", "residual_in_fp32", False, "the residual stream is kept in the model dtype")
        require_value(config, "Nemotron-H", "sliding_window", None, "attention is global, no sliding window")
        self.backbone = _Backbone(config)
        if any(layer.kind == "moe" for layer in self.backbone.layers):
            # while a CUDA graph is captured its experts run on every token (UngatedExperts): keep
            # the piecewise graphs to small steps, where that costs less than launching eagerly
            self.max_piecewise_tokens = 512
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # transformers never ties Nemotron-H's lm_head to the embeddings (its tied-weights map is
        # empty) and saves lm_head.weight whatever tie_word_embeddings says; the loader reads the
        # flag from this config, so it is cleared here.
        config.tie_word_embeddings = False
        ssm_dtype = getattr(config, "mamba_ssm_cache_dtype", None)
        if ssm_dtype is not None:
            ssm_dtype = str(ssm_dtype).replace("torch.", "")
            if ssm_dtype not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError(f"config mamba_ssm_cache_dtype {ssm_dtype!r}: expected auto, float32, bfloat16 or "
                                 "float16")
            self.default_mamba_ssm_cache_dtype = None if ssm_dtype == "auto" else ssm_dtype  # None: model dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.backbone.embeddings(input_ids)  # (T, hidden), the residual stream
        layers = self.backbone.layers
        x = layers[0].norm(h)
        for i, layer in enumerate(layers):
            if layer.kind == "mamba":
                x = layer.mixer(x, ctx)
            elif layer.kind == "attention":
                x = layer.mixer(positions, x, ctx)
            else:
                x = layer.mixer(x)
            following = layers[i + 1].norm if i + 1 < len(layers) else self.backbone.norm_f
            x = following.add_and_norm(x, h)  # h += x; x = norm(h): one kernel
        return x
