"""Allocation of the cache tensors a model declares in its `CacheSpec`.

conv_states: (num_slots, width - 1, conv_dim) in the model dtype, contiguous along conv_dim;
ssm_states: (num_slots, nheads, headdim, dstate) (Mamba-1: (num_slots, d_inner, dstate)) in
`ssm_dtype`;
k_cache / v_cache: (num_blocks, block_size, num_kv_heads, head_dim) in the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mambaserve.models.base import CacheSpec


@dataclass
class CacheTensors:
    mamba: list[tuple[torch.Tensor, torch.Tensor]]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def bytes_per_slot(spec: CacheSpec, dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """Bytes of conv + SSM state one request holds across all Mamba layers."""
    total = 0
    for s in spec.mamba:
        total += s.conv_shape[0] * s.conv_shape[1] * dtype.itemsize
        total += math.prod(s.ssm_shape) * ssm_dtype.itemsize
    return total


def bytes_per_block(spec: CacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one KV block holds across all attention layers."""
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * dtype.itemsize for a in spec.attention)


def allocate_caches(
    spec: CacheSpec,
    *,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    device: torch.device | str,
) -> CacheTensors:
    """Zero-filled cache tensors for every layer of `spec`."""
    mamba = [
        (torch.zeros(num_slots, *s.conv_shape, dtype=dtype, device=device),
         torch.zeros(num_slots, *s.ssm_shape, dtype=ssm_dtype, device=device))
        for s in spec.mamba
    ]
    kv = [
        (torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype, device=device),
         torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype, device=device))
        for a in spec.attention
    ]
    return CacheTensors(mamba, kv)
