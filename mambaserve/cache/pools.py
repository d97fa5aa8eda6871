"""The host-side cache bookkeeping of one engine, built in one place from the runner's sizes.

Pure Python: it only decides which pools exist (KV blocks only for models with attention layers,
the prefix cache only when enabled) and how their ids are laid out in the state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.checkpoint_pool import StateCheckpointPool
from mambaserve.cache.prefix_cache import PrefixCache
from mambaserve.cache.state_pool import StateSlotPool


@dataclass
class CachePools:
    """slots: running state slots; blocks: KV blocks (None without attention layers);
    prefix_cache: None when prefix caching is off."""

    slots: StateSlotPool
    blocks: BlockPool | None
    prefix_cache: PrefixCache | None


def make_cache_pools(*, num_slots: int, num_blocks: int | None, block_size: int, num_checkpoints: int,
                     enable_prefix_caching: bool, mamba_block_size: int, has_state: bool) -> CachePools:
    """The pools over state tensors of `num_slots` rows (the last one the scratch slot that CUDA-graph
    padding writes, never handed out) followed by `num_checkpoints` checkpoint rows, and
    `num_blocks` KV blocks of `block_size` tokens (None: no attention layers). Raises ValueError
    for sizes the pools refuse (see each pool)."""
    slots = StateSlotPool(num_slots - 1)
    blocks = BlockPool(num_blocks, block_size, enable_prefix_caching) if num_blocks is not None else None
    prefix_cache = PrefixCache(
        block_pool=blocks, checkpoints=StateCheckpointPool(num_checkpoints, num_slots),
        mamba_block_size=mamba_block_size, has_state=has_state,
    ) if enable_prefix_caching else None
    return CachePools(slots, blocks, prefix_cache)
