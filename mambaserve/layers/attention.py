"""Multi-head attention with grouped KV heads over the paged KV cache, for packed batches.

q/k/v projections, optional RoPE, the new keys and values written into the paged cache by slot
mapping, then causal attention over each sequence's cached prefix plus its new tokens
(`mambaserve.ops.paged_attention`), then o_proj. Prefill chunks and decodes share one call.
The layer reads its (k_cache, v_cache) pair from `ctx.kv_caches[cache_index]`.

One layer serves every family, Zamba2's shared blocks included: their input is wider than the
output (`input_size`), one module runs at several depths, each with its own KV cache
(`cache_index` as a tuple, the depth's index given per call) and its own LoRA adapters on q, k
and v (`lora_rank`).

Tensor parallelism (built inside `distributed.building_with`) splits the query heads, and the
KV heads with them (`kv_head_range`: replicated when the ranks outnumber them); q/k/v are
column-parallel, o_proj row-parallel (one all-reduce). num_heads and num_kv_heads are the
rank's, and so is its KV cache spec.

An FP8 KV cache (float8_e4m3fn cache tensors) stores keys and values divided by per-tensor
scales: the layer's `k_scale` / `v_scale` parameters (the checkpoint's, compressed-tensors'
kv_cache_scheme) when the loader gave it them (`add_kv_scales`), else 1.0.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mambaserve import ops
from mambaserve.cache.spec import AttentionSpec, CacheDtypes
from mambaserve.distributed import TensorParallelGroup, current_group
from mambaserve.forward_context import ForwardContext
from mambaserve.layers.graph_split import split_op
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, even_range
from mambaserve.layers.lora import lora_adapters
from mambaserve.layers.rotary import RotaryEmbedding


def kv_head_range(num_kv_heads: int, group: TensorParallelGroup) -> tuple[int, int]:
    """The rank's KV heads (start, end): its even share when the world size divides them, else
    (a world size that is a multiple of num_kv_heads) the one head its query heads read,
    replicated on world_size / num_kv_heads ranks. Raises ValueError for any other size."""
    R = group.world_size
    if num_kv_heads >= R:
        return even_range(num_kv_heads, group, "the KV heads (num_key_value_heads)")
    if R % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={R} exceeds num_key_value_heads={num_kv_heads} without being a "
                         "multiple of it: each KV head would be replicated on a whole number of ranks")
    head = group.rank // (R // num_kv_heads)
    return head, head + 1


class Attention(nn.Module):
    """hidden_states: (num_tokens, input_size), positions: (num_tokens,) -> (num_tokens, hidden_size)."""

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
        cache_index: int | tuple[int, ...] = 0,
        input_size: int | None = None,
        lora_rank: int | None = None,
        reduce_results: bool = True,
    ):
        """cache_index: the layer's KV cache index, or for a layer shared by several depths one
        index per depth (forward then takes the calling depth's). input_size: the input's width
        when it is not hidden_size (Zamba2: concat(h, embeddings), 2 * hidden_size); o_proj maps
        to hidden_size. lora_rank: per-depth adapters q += B_i(A_i(x)) (and k, v likewise) for
        the call's cache index i, in `linear_{q,k,v}_adapter_list.{i}` (Zamba2's names).
        reduce_results=False: under tensor parallelism the output is the rank's partial sum
        (o_proj not all-reduced), for a caller that adds another one first (Falcon-H1)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        tp = current_group()
        q0, q1 = even_range(num_heads, tp, "the attention heads (num_attention_heads)")
        kv0, kv1 = kv_head_range(num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, kv1 - kv0, head_dim  # the rank's
        self.scale = scale
        self.cache_indices = (cache_index,) if isinstance(cache_index, int) else tuple(cache_index)
        assert self.cache_indices, "an attention layer needs at least one KV cache index"
        d_in = input_size or hidden_size
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        q_rows, kv_rows = [(q0 * head_dim, q1 * head_dim)], [(kv0 * head_dim, kv1 * head_dim)]
        self.q_proj = ColumnParallelLinear(d_in, q_out, bias=bias, ranges=q_rows)
        self.k_proj = ColumnParallelLinear(d_in, kv_out, bias=bias, ranges=kv_rows)
        self.v_proj = ColumnParallelLinear(d_in, kv_out, bias=bias, ranges=kv_rows)
        self.o_proj = RowParallelLinear(q_out, hidden_size, bias=bias, ranges=q_rows, reduce_results=reduce_results)
        self.rotary = rotary
        self.lora = lora_rank is not None
        if self.lora:
            self.linear_q_adapter_list = lora_adapters(self.cache_indices, d_in, lora_rank, q_out, q_rows)
            self.linear_k_adapter_list = lora_adapters(self.cache_indices, d_in, lora_rank, kv_out, kv_rows)
            self.linear_v_adapter_list = lora_adapters(self.cache_indices, d_in, lora_rank, kv_out, kv_rows)

    def add_kv_scales(self) -> None:
        """Give the layer k_scale and v_scale parameters (1,) float32, 1.0 until loaded."""
        self.k_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def init_buffers(self) -> None:
        if hasattr(self, "k_scale"):
            self.k_scale.data.fill_(1.0)
            self.v_scale.data.fill_(1.0)

    def kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) as host floats, read once (constant after loading; the first
        forward is an eager one, never inside a CUDA graph capture)."""
        if not hasattr(self, "k_scale"):
            return 1.0, 1.0
        version = (self.k_scale._version, self.v_scale._version)
        if getattr(self, "_kv_scale_cache", (None,))[0] != version:
            self._kv_scale_cache = (version, (float(self.k_scale), float(self.v_scale)))
        return self._kv_scale_cache[1]

    @property
    def cache_index(self) -> int:
        """The KV cache index of a layer that has one."""
        assert len(self.cache_indices) == 1, "a shared attention layer is called with its depth's cache_index"
        return self.cache_indices[0]

    def cache_spec(self, dtypes: CacheDtypes) -> AttentionSpec:
        """Per token: K and V of (num_kv_heads, head_dim), for each of the layer's cache indices."""
        return AttentionSpec(self.num_kv_heads, self.head_dim, dtypes.kv)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext,
                cache_index: int | None = None) -> torch.Tensor:
        """cache_index: which of a shared layer's KV caches (and adapters) this call uses."""
        index = self.cache_index if cache_index is None else cache_index
        assert index in self.cache_indices, (index, self.cache_indices)
        T = hidden_states.shape[0]
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.lora:
            key = str(index)
            q = q + self.linear_q_adapter_list[key](hidden_states)
            k = k + self.linear_k_adapter_list[key](hidden_states)
            v = v + self.linear_v_adapter_list[key](hidden_states)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        attend = self.attend if cache_index is None else functools.partial(self.attend, cache_index=index)
        out = split_op(attend, (q, k, v), ctx)  # (T, num_heads, head_dim)
        return self.o_proj(out.view(T, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
               cache_index: int | None = None) -> torch.Tensor:
        """Write this step's K/V into the paged cache, then attend. q: (T, num_heads, head_dim),
        k, v: (T, num_kv_heads, head_dim). Returns (T, num_heads, head_dim)."""
        k_cache, v_cache = ctx.kv_caches[self.cache_index if cache_index is None else cache_index]
        k_scale, v_scale = self.kv_scales() if k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        ops.reshape_and_cache(k, v, k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale)
        plan = ctx.attention_plan(self.num_heads // self.num_kv_heads, self.num_kv_heads, k_cache.shape[1])
        return ops.paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.query_start_loc,
                                   self.scale, plan=plan, k_scale=k_scale, v_scale=v_scale)
