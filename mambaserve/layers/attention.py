"""Multi-head attention with grouped KV heads over the paged KV cache, for packed batches.

q/k/v projections, optional RoPE, the new keys and values written into the paged cache by slot
mapping, then causal attention over each sequence's cached prefix plus its new tokens
(`mambaserve.ops.paged_attention`), then o_proj. Prefill chunks and decodes share one call.
The layer reads its (k_cache, v_cache) pair from `ctx.kv_caches[cache_index]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mambaserve import ops
from mambaserve.engine.forward_context import ForwardContext
from mambaserve.layers.graph_split import split_op
from mambaserve.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionCacheShape:
    """Per-token KV cache entry of one attention layer: num_kv_heads x head_dim, for K and for V."""

    num_kv_heads: int
    head_dim: int


class Attention(nn.Module):
    """hidden_states: (num_tokens, hidden_size), positions: (num_tokens,) -> (num_tokens, hidden_size)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        bias: bool = False,
        rotary: RotaryEmbedding | None = None,
        cache_index: int = 0,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.cache_index = cache_index
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = rotary

    def cache_shape(self) -> AttentionCacheShape:
        return AttentionCacheShape(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = hidden_states.shape[0]
        q = self.q_proj(hidden_states).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(T, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = split_op(self.attend, (q, k, v), ctx)  # (T, num_heads, head_dim)
        return self.o_proj(out.view(T, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Write this step's K/V into the paged cache, then attend. q: (T, num_heads, head_dim),
        k, v: (T, num_kv_heads, head_dim). Returns (T, num_heads, head_dim)."""
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        ops.reshape_and_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        return ops.paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.query_start_loc,
                                   self.scale, metadata=ctx.metadata)
