"""Prefix caching for hybrid models: which prefix of a prompt every layer can resume from, and
where a prompt's state checkpoints are taken.

Keys. A prompt is cut into hash blocks of `hash_block_size` tokens (the KV block size for a
model with attention layers, else mamba_block_size); block j's key is sha256 of block j-1's key
and the token ids of block j (int64, little-endian), so a key names the whole token chain up to
the end of its block and nothing else (the KV and states depend only on token ids here;
multimodal inputs or adapters would join the first block's key). A request's `cache_salt`
(vLLM's: tenants that must not learn each other's prompts through hit timing) replaces the
chain's root by sha256 of the root and the salt, so that only requests with the same salt
share anything. The same key names the KV
block (`BlockPool`) and the state checkpoint after that many tokens (`StateCheckpointPool`).
sha256 rather than Python's hash: stable across processes and runs, and a collision, which
would serve one prompt another's cache, is out of reach.

Match. A request resumes at the longest c such that c is a multiple of mamba_block_size,
c <= num_tokens - 1 (its last token is computed: its logits are sampled), every KV block of
[0, c) is cached (attention layers) and a checkpoint after c tokens exists (Mamba layers).

Checkpoints. A prompt of P tokens gets checkpoints at up to two positions beyond its match,
each a multiple M of mamba_block_size where the scheduler ends a prefill chunk (the state is
then in the request's slot, and the step copies it out: no second pass): its last boundary
floor((P - 1) / M) * M (so that a repeat of the prompt resumes there), and its branch point:
the last boundary at which an earlier prompt was still the same (so that a system prompt
shared by two requests is resumed by the third). Which boundaries were seen is kept for the
last `SEEN_BOUNDARIES` boundary keys. A waiting prompt whose prefix a running prefill is
about to checkpoint beyond its own match (`promised`) is not admitted until that checkpoint
exists, so that prompts sent together share too: an identical prompt, or the third with a
system prompt two earlier ones share, resumes there one step later instead of recomputing.

Pure Python: keys, counts and ids; the scheduler drives it and the runner copies the rows.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.checkpoint_pool import StateCheckpointPool

SEEN_BOUNDARIES = 1 << 16  # boundary keys remembered for branch points (~100 bytes each)

_ROOT = hashlib.sha256(b"mambaserve prefix cache v1").digest()


def _token_bytes(token_ids: list[int]) -> bytes:
    tokens = array("q", token_ids)  # int64
    if sys.byteorder == "big":  # the same bytes on every host
        tokens.byteswap()
    return tokens.tobytes()


def chain_root(salt: str | None) -> bytes:
    """The parent of a chain's first block: the common root, or the root salted by `salt`."""
    return _ROOT if salt is None else hashlib.sha256(_ROOT + b"cache_salt" + salt.encode()).digest()


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The key of a block of `token_ids` after the chain named `parent` (None: the first block of
    an unsalted chain)."""
    return hashlib.sha256((parent or _ROOT) + _token_bytes(token_ids)).digest()


@dataclass
class PrefixCacheStats:
    """Counters of the prefix cache since the engine started, in prompt tokens (vLLM's
    prefix_cache_queries / prefix_cache_hits): queries = prompt tokens of the requests looked
    up at their first admission; hits = the tokens of those served from the cache (the sum of
    the requests' num_cached_tokens). Re-admissions after a preemption count apart, in
    preempted_queries / preempted_hits (all tokens so far), as vLLM does. All only grow."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class PrefixMatch:
    """What a request resumes from: num_tokens (0: nothing), the cached KV blocks of them (in
    order; empty without attention) and the checkpoint row to copy into its slot (None without
    Mamba layers or without a match)."""

    num_tokens: int = 0
    blocks: list[int] | None = None
    checkpoint_row: int | None = None


class PrefixCache:
    """The prefix-cache side of the KV block pool (None: no attention layers) and of the
    checkpoint pool, at checkpoint granularity `mamba_block_size` (a multiple of the block
    pool's block size). has_state: the model has Mamba layers (a match needs a checkpoint)."""

    def __init__(self, *, block_pool: BlockPool | None, checkpoints: StateCheckpointPool,
                 mamba_block_size: int, has_state: bool = True) -> None:
        self.block_pool = block_pool
        self.checkpoints = checkpoints
        self.mamba_block_size = mamba_block_size
        self.hash_block_size = block_pool.block_size if block_pool is not None else mamba_block_size
        if mamba_block_size % self.hash_block_size:
            raise ValueError(f"mamba_block_size ({mamba_block_size}) must be a multiple of the KV block size "
                             f"({self.hash_block_size})")
        self.has_state = has_state
        self.stats = PrefixCacheStats()
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def extend_hashes(self, hashes: list[bytes], get_tokens: Callable[[int, int], list[int]], num_tokens: int,
                      salt: str | None = None) -> None:
        """Extend a sequence's key chain `hashes` in place to every full hash block of its
        first num_tokens tokens; get_tokens(start, end) returns its token ids [start, end);
        salt: the request's cache_salt (the same on every call for one sequence)."""
        h, first, end = self.hash_block_size, len(hashes), num_tokens // self.hash_block_size
        if end <= first:
            return
        # `hash_block`'s keys, from one conversion of all the new blocks' tokens (a long prompt
        # has hundreds: per-block conversions were a third of the time)
        data, size = _token_bytes(get_tokens(first * h, end * h)), 8 * h
        parent = hashes[-1] if hashes else chain_root(salt)
        for j in range(end - first):
            parent = hashlib.sha256(parent + data[j * size:(j + 1) * size]).digest()
            hashes.append(parent)

    def key_at(self, hashes: list[bytes], position: int) -> bytes:
        """The key of the prefix [0, position) (a multiple of the hash block size, > 0)."""
        assert position > 0 and position % self.hash_block_size == 0, position
        return hashes[position // self.hash_block_size - 1]

    def match(self, hashes: list[bytes], num_tokens: int) -> PrefixMatch:
        """The longest prefix of a sequence of num_tokens tokens (keys `hashes`, extended to
        them) that every layer can resume from (module docstring). Takes nothing: the caller
        `touch`es the blocks once it admits the sequence."""
        m, h = self.mamba_block_size, self.hash_block_size
        limit = (num_tokens - 1) // m * m
        blocks: list[int] = []
        if self.block_pool is not None:
            for j in range(limit // h):
                b = self.block_pool.lookup(hashes[j])
                if b is None:
                    break
                blocks.append(b)
            limit = len(blocks) * h // m * m
        for c in range(limit, 0, -m):
            row = self.checkpoints.lookup(self.key_at(hashes, c)) if self.has_state else None
            if row is not None or not self.has_state:
                return PrefixMatch(c, blocks[: c // h] if self.block_pool is not None else None, row)
        return PrefixMatch()

    def planned_keys(self, running) -> set[bytes]:
        """Keys of the checkpoints running sequences (`Sequence`s: block_hashes,
        checkpoint_positions, num_computed_tokens) will save in later steps."""
        return {self.key_at(s.block_hashes, p) for s in running for p in s.checkpoint_positions
                if p > s.num_computed_tokens}

    def promised(self, hashes: list[bytes], num_tokens: int, start: int, planned: set[bytes]) -> int:
        """The longest boundary c in (start, (num_tokens - 1) // M * M] at which a checkpoint of
        this sequence's prefix is on its way: pending in the pool (the step being planned saves
        it) or among `planned` (`planned_keys`); 0 when none is. hashes: extended to num_tokens."""
        if not self.has_state or not (planned or self.checkpoints.num_pending):
            return 0
        m, pending = self.mamba_block_size, self.checkpoints.is_pending
        for c in range((num_tokens - 1) // m * m, start, -m):
            key = self.key_at(hashes, c)
            if key in planned or pending(key):
                return c
        return 0

    def plan_checkpoints(self, hashes: list[bytes], start: int, prompt_len: int) -> list[int]:
        """Positions after `start` where the prompt's prefill should end a chunk to take a
        checkpoint (increasing): its branch point and its last boundary (module docstring),
        those not kept already. Changes nothing (`remember_boundaries` records the prompt)."""
        if not self.has_state or self.checkpoints.num_checkpoints == 0:
            return []
        m = self.mamba_block_size
        last = (prompt_len - 1) // m * m
        branch = max((c for c in range(m, last + 1, m) if self.key_at(hashes, c) in self._seen), default=0)
        kept = self.checkpoints.contains
        return [c for c in sorted({branch, last}) if c > start and not kept(self.key_at(hashes, c))]

    def remember_boundaries(self, hashes: list[bytes], prompt_len: int) -> None:
        """Record an admitted prompt's boundary keys for later prompts' branch points."""
        if not self.has_state:
            return
        m = self.mamba_block_size
        for c in range(m, (prompt_len - 1) // m * m + 1, m):
            key = self.key_at(hashes, c)
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > SEEN_BOUNDARIES:
            self._seen.popitem(last=False)

    def reserve_checkpoint(self, hashes: list[bytes], position: int) -> int | None:
        """The row the step being planned copies a slot into, for the prefix [0, position);
        None when it is kept already or no row can be had."""
        key = self.key_at(hashes, position)
        if self.checkpoints.contains(key):
            return None
        return self.checkpoints.reserve(key)

    def register_blocks(self, hashes: list[bytes], block_table: list[int], first: int, end: int) -> None:
        """Register blocks first..end-1 of a block table, full and computed, under their keys."""
        assert self.block_pool is not None and end <= len(hashes)
        for j in range(first, end):
            self.block_pool.register(block_table[j], hashes[j])

    def reset(self) -> bool:
        """Drop every cached block, checkpoint and seen boundary; False (nothing dropped) while
        a block is held."""
        if self.block_pool is not None and not self.block_pool.reset():
            return False
        self.checkpoints.reset()
        self._seen.clear()
        return True


def chunk_end(start: int, positions: list[int], num_new: int, min_inner_save_offset: int | None) -> int:
    """The tokens of a prefill chunk from `start` given its sequence's checkpoint positions
    (sorted, all after start): num_new, or fewer to end at the first position the layers cannot
    save inside the chunk (closer to start than `min_inner_save_offset`, or every position when
    it is None: they cannot save inside one)."""
    for p in positions:
        if p >= start + num_new:
            break
        if min_inner_save_offset is None or p - start < min_inner_save_offset:
            return p - start
    return num_new
