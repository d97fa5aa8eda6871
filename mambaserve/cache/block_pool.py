"""Bookkeeping for paged KV-cache blocks of the attention layers.

A block holds the keys and values of `block_size` consecutive tokens of one request; a
request's block table lists its blocks in token order. This pool only hands out and takes back
block ids: it holds no tensors, does no prefix sharing (each block has exactly one owner) and
knows nothing about layers or dtypes.
"""

from __future__ import annotations

from mambaserve.cache.index_pool import IndexPool


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens, each owned by at most one request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ids = IndexPool(num_blocks)

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_used(self) -> int:
        return self._ids.num_used

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self._ids.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, all or nothing. Raises RuntimeError if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._ids.num_free:
            raise RuntimeError(
                f"need {n} KV blocks, only {self._ids.num_free} of {self.num_blocks} free"
            )
        return self._ids.take(n)

    def free(self, blocks: list[int]) -> None:
        """Return blocks, all or nothing. Raises ValueError if any is not currently allocated
        (double free, unknown id, or the same id twice in `blocks`)."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free the same KV block twice in one call: {blocks}")
        bad = [b for b in blocks if not self._ids.is_used(b)]
        if bad:
            raise ValueError(f"cannot free KV blocks {bad}: not allocated (double free or unknown)")
        # freeing then allocating the same count returns the same order
        self._ids.give_back(blocks)

    def __repr__(self) -> str:
        return f"BlockPool(used={self.num_used}/{self.num_blocks}, block_size={self.block_size})"
