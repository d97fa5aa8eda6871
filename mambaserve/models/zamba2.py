"""Zamba2ForCausalLM (Zyphra Zamba2-1.2B / 2.7B / 7B): Mamba2 layers, plus a few shared
transformer blocks reused at several depths (Glorioso et al. 2024, "Zamba", arXiv 2405.16712,
fig. 2 and eq. 6; "The Zamba2 suite", arXiv 2411.15242).

Every layer has a pre-norm Mamba2 mixer with a residual. At the "hybrid" depths (the layer
pattern's "hybrid" entries, in order d = 0, 1, ...) shared block b = d % num_mem_blocks first
reads concat(h, e), e the token embeddings, (T, 2 * hidden):
    a = attn_d(input_layernorm(concat(h, e)))          # (T, hidden), no residual
    t = linear_d(mlp_d(pre_ff_layernorm(a)))            # (T, hidden), no residual
    h = h + mamba(mamba_norm(h + t))                    # the residual skips t
attn_d and mlp_d are the block's shared weights plus depth d's own LoRA adapters: the MLP always
has one on gate_up_proj (transformers builds it whatever `use_shared_mlp_adapter` says);
q/k/v have one each when `use_shared_attention_adapter`. The attention has head_dim =
2 * hidden / num_heads, softmax scale (head_dim / 2)^-1/2, RoPE over the whole head only when
`use_mem_rope`, and no biases. The MLP is act(gate) * up with act = `hidden_act` (GELU).
Each depth keeps its own KV cache (attention cache index d) although the weights are shared.

The math follows transformers' `models/zamba2/modeling_zamba2.py` (v5), including its Mamba
details: the conv always has a bias, the gated norm's eps is 1e-5, and the time step is
clamped below at `time_step_min` (its prefill's dt_limit; its one-token decode step skips the
clamp, we apply it in both so that decoding equals a full forward).
HF names: model.embed_tokens, model.final_layernorm, lm_head (tied by default);
model.layers.{i}.{input_layernorm, mamba.*} for Mamba layers and
model.layers.{i}.{linear, mamba_decoder.input_layernorm, mamba_decoder.mamba.*} for hybrid
ones. A checkpoint stores each shared block once, under the first hybrid layer that uses it:
model.layers.{i}.shared_transformer.{input_layernorm, pre_ff_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.linear_{q,k,v}_adapter_list.{d}.{0,1}, feed_forward.{gate_up_proj, down_proj},
feed_forward.gate_up_proj_adapter_list.{d}.{0,1}}, holding the adapters of every depth d that
uses the block; our modules are laid out the same way, so the names map one to one.
Under tensor parallelism the shared blocks split as every attention layer and MLP does (each
adapter's B holds the rows of the projection it adds to); each depth's `linear` is whole on
every rank.
(transformers 5 ties the shared blocks only when it also ties the embeddings: an untied model
saved by it holds a separate copy per depth, which this model rejects as unexpected tensors.
Zyphra's checkpoints tie both.)
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.distributed import current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.activation import get_activation
from mambaserve.layers.attention import Attention
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, packed_ranges
from mambaserve.layers.lora import lora_adapters
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.norm import RMSNorm
from mambaserve.models.base import HybridForCausalLM
from mambaserve.models.config_checks import require_value
from mambaserve.models.config_utils import attention_from_config, layer_kinds, rotary_from_config


def _shared_attention(config, depths: list[int]) -> Attention:
    """The shared block's attention, run at hybrid depths `depths` (KV cache index = depth): input
    concat(h, e) of 2 * hidden, head_dim = 2 * hidden / num_heads, scale (head_dim / 2)^-1/2,
    no biases, per-depth LoRA on q/k/v when use_shared_attention_adapter, whole-head RoPE when
    use_mem_rope. Raises ValueError for head counts that do not divide."""
    H2 = 2 * config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if H2 % heads or heads % kv_heads:
        raise ValueError(f"Zamba2 attention: 2 * hidden_size ({H2}) must split into {heads} heads, "
                         f"a multiple of num_key_value_heads ({kv_heads})")
    lora_rank = None
    if config.use_shared_attention_adapter:
        if kv_heads != heads:
            # the adapters' outputs are 2 * hidden wide, also for k and v
            raise ValueError("Zamba2 attention adapters need num_key_value_heads == num_attention_heads")
        lora_rank = config.adapter_rank
    head_dim = H2 // heads
    rotary = rotary_from_config(config, head_dim, whole_head=True) if config.use_mem_rope else None
    return attention_from_config(config, tuple(depths), head_dim=head_dim, scale=(head_dim / 2) ** -0.5, bias=False,
                                 input_size=H2, lora_rank=lora_rank, rotary=rotary)


class _SharedMLP(nn.Module):
    """down(act(g) * u), [g; u] = gate_up_proj(x) + adapter_d(x). x: (T, hidden) -> (T, hidden)."""

    def __init__(self, config, depths: list[int]):
        super().__init__()
        H, inter, bias = config.hidden_size, config.intermediate_size, config.add_bias_linear
        self.act = get_activation(config.hidden_act)
        rows = packed_ranges([inter] * 2, current_group(), "the shared MLP's intermediate size")  # [gate; up]
        self.gate_up_proj = ColumnParallelLinear(H, 2 * inter, bias=bias, ranges=rows)
        self.down_proj = RowParallelLinear(inter, H, bias=bias)
        self.gate_up_proj_adapter_list = lora_adapters(depths, H, config.adapter_rank, 2 * inter, rows)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[str(depth)](x)  # (T, 2 * inter)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class _SharedTransformer(nn.Module):
    """One shared block: (h, e) (T, hidden) each -> (T, hidden), before the depth's `linear`."""

    def __init__(self, config, depths: list[int]):
        super().__init__()
        self.input_layernorm = RMSNorm(2 * config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _shared_attention(config, depths)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feed_forward = _SharedMLP(config, depths)

    def forward(self, positions, h, e, ctx: ForwardContext, depth: int) -> torch.Tensor:
        x = self.input_layernorm(torch.cat((h, e), dim=-1))  # (T, 2 * hidden)
        x = self.self_attn(positions, x, ctx, cache_index=depth)
        return self.feed_forward(self.pre_ff_layernorm(x), depth)


class _MambaLayer(nn.Module):
    def __init__(self, config, cache_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mamba = Mamba2Mixer(
            hidden_size=config.hidden_size,
            num_heads=config.n_mamba_heads,
            head_dim=int(config.mamba_expand * config.hidden_size) // config.n_mamba_heads,
            d_state=config.mamba_d_state,
            n_groups=config.mamba_ngroups,
            conv_kernel=config.mamba_d_conv,
            chunk_size=config.chunk_size,
            intermediate_size=int(config.mamba_expand * config.hidden_size),
            use_conv_bias=True,
            use_bias=config.add_bias_linear,
            eps=1e-5,
            dt_limit=(float(config.time_step_min), float("inf")),
            cache_index=cache_index,
        )


class _HybridLayer(nn.Module):
    """A hybrid depth: the depth's `linear` and Mamba layer; owns the shared block it uses only
    if it is the block's first depth (where the checkpoint stores it)."""

    def __init__(self, config, cache_index: int, depth: int, block_id: int, shared: _SharedTransformer | None):
        super().__init__()
        self.depth, self.block_id = depth, block_id
        if shared is not None:
            self.shared_transformer = shared
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.mamba_decoder = _MambaLayer(config, cache_index)


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        kinds = layer_kinds(config, allowed=("mamba", "hybrid"))
        n_blocks = config.num_mem_blocks
        n_depths = kinds.count("hybrid")
        if n_blocks < 1:
            raise ValueError(f"Zamba2 num_mem_blocks must be >= 1, got {n_blocks}")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks: list[_SharedTransformer] = []  # by block id; registered under their first layer
        layers, depth = [], 0
        for i, kind in enumerate(kinds):
            if kind == "mamba":
                layers.append(_MambaLayer(config, i))
                continue
            b = depth % n_blocks
            owned = None
            if depth < n_blocks:
                owned = _SharedTransformer(config, [d for d in range(n_depths) if d % n_blocks == b])
                self.blocks.append(owned)
            layers.append(_HybridLayer(config, i, depth, b, owned))
            depth += 1
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Zamba2ForCausalLM(HybridForCausalLM):
    """forward(input_ids (T,), positions (T,), ctx) -> hidden (T, hidden).

    Mamba cache index = layer index (every layer has a Mamba mixer); attention cache index =
    hybrid depth. Raises ValueError for `use_long_context` (see __init__) or a scaled RoPE type.
    """

    def __init__(self, config):
        super().__init__(config)
        # transformers 4 rescaled rope_theta for it, transformers 5 only raises max_position_embeddings
        require_value(config, "Zamba2", "use_long_context", False,
                      "its RoPE rescaling differs between transformers versions")
        self.model = _Model(config)
        self.make_lm_head(self.model.embed_tokens)

    def unexpected_tensor_reason(self, name: str) -> str | None:
        """Why the loader finds `name` unexpected, when it is a shared block's copy at a later depth."""
        if ".shared_transformer." not in name:
            return None
        return ("the checkpoint holds a copy of a shared transformer block at a later depth; transformers 5 saves "
                "one per depth when tie_word_embeddings is false, this model keeps each block once (under its "
                "first hybrid layer), as Zyphra's checkpoints store it")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        e = self.model.embed_tokens(input_ids)  # (T, hidden)
        h = None  # the residual stream, once it is no longer e itself (then added into in place)
        pending = None  # the last Mamba mixer's output, not yet added to the stream
        for layer in self.model.layers:
            if isinstance(layer, _HybridLayer):
                if pending is not None:  # the shared block reads the stream itself
                    h, pending = (e if h is None else h) + pending, None
                stream = e if h is None else h
                t = self.model.blocks[layer.block_id](positions, stream, e, ctx, layer.depth)
                t = layer.linear(t)
                mamba = layer.mamba_decoder
                pending = mamba.mamba(mamba.input_layernorm(stream + t), ctx)
            else:
                x, h = _add_and_norm(layer.input_layernorm, pending, h, e)
                pending = layer.mamba(x, ctx)
        return _add_and_norm(self.model.final_layernorm, pending, h, e)[0]


def _add_and_norm(norm: RMSNorm, pending: torch.Tensor | None, h: torch.Tensor | None, e: torch.Tensor):
    """(norm(stream + pending), the stream with pending added): h += pending and its norm in one
    kernel, except while the stream is still the embeddings e (h None), which the shared blocks
    read unchanged: then the first add makes the stream a new tensor."""
    if pending is None:
        return norm(e if h is None else h), h
    if h is None:
        h = e + pending
        return norm(h), h
    return norm.add_and_norm(pending, h), h
