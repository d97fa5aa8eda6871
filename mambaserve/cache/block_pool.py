"""Bookkeeping for paged KV-cache blocks of the attention layers, content-addressed for prefix caching.

A block holds the keys and values of `block_size` consecutive tokens of one request; a
request's block table lists its blocks in token order. With prefix caching, a full block whose
KV is computed is registered under the hash of its content (`cache.prefix_cache.hash_block`:
the chain of every token id up to its end), so a later request with the same prefix takes the
same block instead of computing it again: blocks are reference-counted, and a block whose last
holder lets go keeps its hash in a least-recently-used queue until the pool needs it for
something else. A shared block is always full and never written again: a request writes only
the blocks after its cached prefix.

This pool only hands out and takes back block ids: it holds no tensors and knows nothing about
layers, dtypes or what the hashes cover.
"""

from __future__ import annotations

from collections import OrderedDict

from mambaserve.cache.index_pool import IndexPool


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens.

    Without caching (enable_caching False) each block has exactly one holder, as before prefix
    caching. With it, a block is in one of three states: held (ref count >= 1), cached (ref
    count 0, hash kept, in the LRU queue: reusable by `lookup` until evicted) or free (no hash).
    `allocate` takes free blocks first, then evicts cached ones, least recently freed first.
    `num_free` counts both free and cached blocks: both can be allocated.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ids = IndexPool(num_blocks)  # blocks neither held nor cached
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently freed first

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones (evicted on the way)."""
        return self._ids.num_free + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a hash (held or in the LRU queue)."""
        return len(self._hash_of)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int, reusing: list[int] = ()) -> bool:
        """Whether `n` new blocks can be allocated after `touch(reusing)` took its blocks
        (cached ones among them are no longer free then)."""
        return n + sum(1 for b in reusing if self._ref[b] == 0) <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, all or nothing: free ones first, then the least recently freed
        cached ones (their hashes dropped). Raises RuntimeError if fewer than n can be had."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise RuntimeError(f"need {n} KV blocks, only {self.num_free} of {self.num_blocks} free")
        fresh = min(n, self._ids.num_free)
        blocks = self._ids.take(fresh)
        for _ in range(n - fresh):
            block, _ = self._lru.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            blocks.append(block)
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Let go of one reference to each block, all or nothing. Raises ValueError if any is
        not held (double free, unknown id, or the same id twice in `blocks`). A block nobody
        holds keeps its hash (cached) if it has one; the blocks of one call go to the LRU queue
        last block first, so that a prefix's tail is evicted before its head."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free the same KV block twice in one call: {blocks}")
        bad = [b for b in blocks if not (isinstance(b, int) and 0 <= b < self.num_blocks and self._ref[b] > 0)]
        if bad:
            raise ValueError(f"cannot free KV blocks {bad}: not allocated (double free or unknown)")
        unhashed = []
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    unhashed.append(b)
        # freeing then allocating the same count returns the same order
        self._ids.give_back(unhashed[::-1])

    # -- prefix caching ------------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block registered under `block_hash` (held or cached), or None."""
        return self._block_of.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each of `blocks` (registered ones from `lookup`): a cached
        block leaves the LRU queue. The caller checked `can_allocate(n, reusing=blocks)`."""
        for b in blocks:
            assert b in self._hash_of, f"block {b} is not registered"
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Register a held block, now full and computed, under the hash of its content. If
        another block already holds that content (two requests computed the same prefix side by
        side) the registered one stays the cached copy and `block` stays private. Nothing
        without caching."""
        if not self.enable_caching:
            return
        assert self._ref[block] > 0, f"block {block} is not held"
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def reset(self) -> bool:
        """Drop every hash. Returns False, dropping nothing, while any block is held (a running
        request's block table could no longer be told apart from a cached one)."""
        if self.num_used:
            return False
        self._ids.give_back(list(self._lru))
        self._lru.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return True

    def __repr__(self) -> str:
        return (f"BlockPool(used={self.num_used}/{self.num_blocks}, cached={self.num_cached}, "
                f"block_size={self.block_size})")
