"""Allocation of the cache tensors a model declares in its `CacheSpec`.

Per Mamba layer: conv_states (num_slots, width - 1, conv_dim), contiguous along conv_dim, and
ssm_states (num_slots, *ssm_shape); per attention layer: k_cache and v_cache (num_blocks,
block_size, num_kv_heads, head_dim). Each in its spec's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaserve.cache.spec import CacheSpec


@dataclass
class CacheTensors:
    """mamba[i]: (conv_states, ssm_states) of Mamba cache index i; kv[j]: (k_cache, v_cache)."""

    mamba: list[tuple[torch.Tensor, torch.Tensor]]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    _row_views: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict, repr=False, compare=False)

    def state_row_views(self, row: int) -> list[list[torch.Tensor]]:
        """Row `row` of every Mamba layer's conv and SSM states, grouped by dtype (layer order
        inside a group), for multi-tensor copies of state rows; built on first use and kept (the
        views of four state tensors per layer cost a copy's host time more than its launch)."""
        views = self._row_views.get(row)
        if views is None:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in (t for layer in self.mamba for t in layer):
                by_dtype.setdefault(t.dtype, []).append(t[row])
            views = self._row_views[row] = list(by_dtype.values())
        return views


def allocate_caches(spec: CacheSpec, *, num_slots: int, num_blocks: int, block_size: int,
                    device: torch.device | str) -> CacheTensors:
    """Zero-filled cache tensors for every layer of `spec`: `num_slots` state slots per Mamba
    layer, `num_blocks` KV blocks of `block_size` tokens per attention layer."""
    mamba = [
        (torch.zeros(num_slots, *s.conv_shape, dtype=s.conv_dtype, device=device),
         torch.zeros(num_slots, *s.ssm_shape, dtype=s.ssm_dtype, device=device))
        for s in spec.mamba
    ]
    kv = [
        tuple(torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=a.dtype, device=device)
              for _ in range(2))
        for a in spec.attention
    ]
    return CacheTensors(mamba, kv)
