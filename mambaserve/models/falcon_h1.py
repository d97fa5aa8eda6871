"""FalconH1ForCausalLM (TII Falcon-H1): every layer runs a Mamba2 mixer and a RoPE attention
block side by side on the same normed input, then a SwiGLU MLP.

Per layer, with h the residual stream (math of transformers' `models/falcon_h1/
modeling_falcon_h1.py`, v5, its PyTorch path):
    x = input_layernorm(h)
    h = h + ssm_out_multiplier * mamba(x) + attention_out_multiplier * attn(attention_in_multiplier * x)
    h = h + mlp(pre_ff_layernorm(h))
- mamba: a Mamba2 mixer whose input is times ssm_in_multiplier and whose in_proj output is
  times a per-segment vector `ssm_multipliers` over [z | x | B | C | dt]; its width is
  `mamba_d_ssm` (else mamba_expand * hidden), heads * head_dim; with `mamba_rms_norm` a gated
  RMSNorm per group (`mamba_norm_before_gate` picks norm(y) * silu(z) or norm(y * silu(z))),
  else no norm and y * silu(z). in_proj's bias is `mamba_proj_bias`, out_proj's
  `projectors_bias`; the conv activation is `hidden_act` (SiLU only).
- attn: GQA with RoPE over the whole head, softmax scale 1/sqrt(head_dim), biases
  `attention_bias`; the keys are times key_multiplier (before RoPE, which is linear).
- mlp: down(up(x) * silu(gate_multiplier * gate(x))) * down_multiplier (`mlp_multipliers`).
- embeddings times embedding_multiplier; logits times lm_head_multiplier.
The time step is clamped to `time_step_limit` in prefill and decode alike (transformers
applies it in its prefill only; the default (0, inf) makes no difference).

Multipliers folded into weights: every multiplier that scales a linear map's input or output
is multiplied into that map's weight (and bias, when it scales the output) once the weights
are loaded (`finalize_weights`), so a step runs no extra elementwise ops: in_proj rows times
ssm_in_multiplier * ssm_multipliers[segment] (bias times the segment multiplier only), mamba
out_proj times ssm_out_multiplier, q/k/v_proj times attention_in_multiplier, k_proj also
times key_multiplier (bias too), o_proj times attention_out_multiplier, gate_proj times
gate_multiplier, down_proj times down_multiplier. The loaded tensors keep their HF names;
the model's parameters hold the folded values afterwards. The embedding and logits multipliers
stay at run time (the embeddings may be tied to lm_head).

Caches: each layer holds both a Mamba state (cache index = layer) and a KV cache (cache index
= layer).
Under tensor parallelism the Mamba2 mixer and the attention leave their out_proj / o_proj
partial sums un-reduced: the layer adds them and all-reduces once.
HF names: model.embed_tokens, model.layers.{i}.{input_layernorm, pre_ff_layernorm,
mamba.{in_proj, conv1d, dt_bias, A_log, D, norm (only with mamba_rms_norm), out_proj},
self_attn.{q,k,v,o}_proj, feed_forward.{gate,up,down}_proj}, model.final_layernorm, lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.distributed import all_reduce, current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.linear import VocabParallelEmbedding
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.mlp import GatedMLP
from mambaserve.layers.norm import RMSNorm
from mambaserve.layers.rotary import RotaryEmbedding
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_checks import require_value
from mambaserve.models.config_utils import (
    attention_from_config,
    attention_head_dim,
    mamba_mixer_from_config,
    rotary_from_config,
)


def _mixer(config, index: int) -> Mamba2Mixer:
    d_ssm = config.mamba_d_ssm if config.mamba_d_ssm is not None else int(config.mamba_expand * config.hidden_size)
    return mamba_mixer_from_config(config, index, intermediate_size=d_ssm, out_proj_bias=config.projectors_bias,
                                   gated_norm=bool(config.mamba_rms_norm),
                                   norm_before_gate=bool(config.mamba_norm_before_gate), reduce_results=False)


class _Layer(nn.Module):
    def __init__(self, config, index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mamba = _mixer(config, index)
        self.self_attn = attention_from_config(config, index, rotary=rotary, reduce_results=False)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = rotary_from_config(config, attention_head_dim(config), whole_head=True)
        self.layers = nn.ModuleList(_Layer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def _scale_rows(linear: nn.Linear, rows: torch.Tensor | float, bias_rows: torch.Tensor | float | None = None) -> None:
    """linear.weight[r, :] *= rows[r]; linear.bias[r] *= bias_rows[r] (default: rows), in float32
    and rounded once to the parameter dtype. rows: (out_features,) or a scalar."""
    rows = torch.as_tensor(rows, dtype=torch.float32, device=linear.weight.device)
    if getattr(linear, "fp8_scheme", None) is not None:  # FP8: its per-row scales (float32) take the factor
        linear.weight_scale.mul_(rows)
    else:
        w = linear.weight
        w.copy_((w.float() * (rows[:, None] if rows.dim() else rows)).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        scale = rows if bias_rows is None else torch.as_tensor(bias_rows, dtype=torch.float32, device=b.device)
        b.copy_((b.float() * scale).to(b.dtype))


class FalconH1ForCausalLM(HybridForCausalLM):
    """TII Falcon-H1: parallel Mamba2 + attention mixers and a SwiGLU MLP per layer, muP
    multipliers folded into the weights (see the module docstring). forward(input_ids (T,),
    positions (T,), ctx) -> final-normed hidden (T, hidden); compute_logits multiplies by
    lm_head_multiplier. Raises ValueError for a hidden_act other than SiLU, multiplier lists of
    the wrong length, `mamba_use_mlp` false or `attn_layer_indices` set."""

    def __init__(self, config):
        super().__init__(config)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Falcon-H1 hidden_act {act!r}: only 'silu' is supported (the Mamba conv and the MLP "
                             "use it)")
        # fields of TII's original code that transformers never reads: it builds attention and
        # the MLP in every layer whatever they say, and so do we
        require_value(config, "Falcon-H1", "mamba_use_mlp", True, "every layer has its MLP")
        require_value(config, "Falcon-H1", "attn_layer_indices", None, "every layer has its attention")
        for name, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
            if len(getattr(config, name)) != n:
                raise ValueError(f"Falcon-H1 {name} must hold {n} values, got {getattr(config, name)!r}")
        self.model = _Model(config)
        self.make_lm_head(self.model.embed_tokens)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.lm_head_multiplier = float(config.lm_head_multiplier)
        self._folded = False
        self.tp_group = current_group()

    def mamba_in_multipliers(self) -> torch.Tensor:
        """ssm_multipliers expanded over in_proj's output rows [z | x | B | C | dt]:
        (2 * d_ssm + 2 * n_groups * d_state + n_heads,) float32 (transformers' compute_mup_vector)."""
        m = self.model.layers[0].mamba
        gn = m.n_groups * m.d_state
        sizes = [m.intermediate_size, m.intermediate_size, gn, gn, m.num_heads]
        mult = [float(v) for v in self.config.ssm_multipliers]
        return torch.cat([torch.full((n,), v) for n, v in zip(sizes, mult)])

    @torch.no_grad()
    def finalize_weights(self) -> None:
        """Fold the muP multipliers into the loaded weights (once; see the module docstring)."""
        if self._folded:
            raise RuntimeError("Falcon-H1 multipliers are already folded into these weights")
        c = self.config
        seg = self.mamba_in_multipliers()
        gate_mult, down_mult = (float(v) for v in c.mlp_multipliers)
        a_in = float(c.attention_in_multiplier)
        for layer in self.model.layers:
            _scale_rows(layer.mamba.in_proj, seg * float(c.ssm_in_multiplier), seg)
            _scale_rows(layer.mamba.out_proj, float(c.ssm_out_multiplier))
            attn = layer.self_attn
            _scale_rows(attn.q_proj, a_in, 1.0)
            _scale_rows(attn.k_proj, a_in * float(c.key_multiplier), float(c.key_multiplier))
            _scale_rows(attn.v_proj, a_in, 1.0)
            _scale_rows(attn.o_proj, float(c.attention_out_multiplier))
            _scale_rows(layer.feed_forward.gate_proj, gate_mult)
            _scale_rows(layer.feed_forward.down_proj, down_mult)
        self._folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # (T, hidden), the residual stream
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            # both read the same normed x; under tensor parallelism both are partial sums: one all-reduce
            mixed = all_reduce(layer.mamba(x, ctx) + layer.self_attn(positions, x, ctx), self.tp_group)
            x = layer.pre_ff_layernorm.add_and_norm(mixed, h)  # h += mixed; x = norm(h)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.final_layernorm
            x = following.add_and_norm(layer.feed_forward(x), h)
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (n, hidden) -> float32 logits (n, vocab_size), times lm_head_multiplier."""
        return self.lm_head(hidden_states).float() * self.lm_head_multiplier
