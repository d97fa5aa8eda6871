"""Allocation of the cache tensors a model declares in its `CacheSpec`.

Per Mamba layer: conv_states (num_slots, width - 1, conv_dim), contiguous along conv_dim, and
ssm_states (num_slots, *ssm_shape); per attention layer: k_cache and v_cache (num_blocks,
block_size, num_kv_heads, head_dim). Each in its spec's dtype. The Mamba layers' states are
views of one stack per (shape, dtype): a state row of every layer is then one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaserve.cache.spec import CacheSpec


@dataclass
class CacheTensors:
    """mamba[i]: (conv_states, ssm_states) of Mamba cache index i; kv[j]: (k_cache, v_cache).
    state_stacks: the tensors the Mamba states are views of, one (num_layers, num_slots, *shape)
    stack per (shape, dtype) of conv or SSM state, so that one copy moves a state row of every
    layer (`ops.copy_state_rows`)."""

    mamba: list[tuple[torch.Tensor, torch.Tensor]]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    state_stacks: list[torch.Tensor] = field(default_factory=list)


def _stacked(shapes: list[tuple[tuple[int, ...], torch.dtype]], num_slots: int, device) -> tuple[list, list]:
    """Zero-filled (num_slots, *shape) tensors of the given (shape, dtype)s, views of one stack per
    distinct (shape, dtype); returns (the views in order, the stacks)."""
    members: dict[tuple, list[int]] = {}
    for i, key in enumerate(shapes):
        members.setdefault(key, []).append(i)
    views: list = [None] * len(shapes)
    stacks = []
    for (shape, dtype), idx in members.items():
        stack = torch.zeros(len(idx), num_slots, *shape, dtype=dtype, device=device)
        stacks.append(stack)
        for j, i in enumerate(idx):
            views[i] = stack[j]
    return views, stacks


def allocate_caches(spec: CacheSpec, *, num_slots: int, num_blocks: int, block_size: int,
                    device: torch.device | str) -> CacheTensors:
    """Zero-filled cache tensors for every layer of `spec`: `num_slots` state slots per Mamba
    layer (views of the state stacks: `CacheTensors.state_stacks`), `num_blocks` KV blocks of
    `block_size` tokens per attention layer."""
    n = len(spec.mamba)
    views, stacks = _stacked([(tuple(s.conv_shape), s.conv_dtype) for s in spec.mamba]
                             + [(tuple(s.ssm_shape), s.ssm_dtype) for s in spec.mamba], num_slots, device)
    kv = [
        tuple(torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=a.dtype, device=device)
              for _ in range(2))
        for a in spec.attention
    ]
    return CacheTensors(list(zip(views[:n], views[n:])), kv, stacks)
