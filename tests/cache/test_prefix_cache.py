"""Prefix-cache bookkeeping without a model: the hash chain, block reference counts and LRU
eviction, the checkpoint pool's commit and eviction order, matching and checkpoint placement."""

import random

import pytest

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.checkpoint_pool import StateCheckpointPool
from mambaserve.cache.prefix_cache import PrefixCache, hash_block


def chain(tokens, h):
    hashes = []
    PrefixCache(block_pool=None, checkpoints=StateCheckpointPool(0, 0), mamba_block_size=h).extend_hashes(
        hashes, lambda a, b: tokens[a:b], len(tokens))
    return hashes


def test_hash_chain_names_the_whole_prefix():
    rng = random.Random(0)
    a = [rng.randrange(50_000) for _ in range(12)]
    ha = chain(a, 4)
    assert len(ha) == 3 and len(set(ha)) == 3 and chain(a[:11], 4) == ha[:2]  # only full blocks
    assert ha == chain(list(a), 4) and all(len(x) == 32 for x in ha)
    # a change in block 0 changes every later key; one in block 2 only block 2's
    b = [a[0] + 1] + a[1:]
    assert all(x != y for x, y in zip(chain(b, 4), ha))
    c = a[:8] + [a[8] + 1] + a[9:]
    assert chain(c, 4)[:2] == ha[:2] and chain(c, 4)[2] != ha[2]
    # the same block after another parent is another key; ids past 2**32 are not truncated
    assert hash_block(ha[0], a[4:8]) == ha[1] != hash_block(None, a[4:8])
    assert hash_block(None, [1, 2**40]) != hash_block(None, [1, 0])
    # the chain extends in place from where it stopped
    part = chain(a[:4], 4)
    PrefixCache(block_pool=None, checkpoints=StateCheckpointPool(0, 0), mamba_block_size=4).extend_hashes(
        part, lambda s, e: a[s:e], 12)
    assert part == ha


def test_block_refcounts_lru_and_eviction_order():
    pool = BlockPool(6, block_size=2, enable_caching=True)
    a = pool.allocate(3)
    keys = [bytes([i]) * 32 for i in range(6)]
    for b, k in zip(a, keys):
        pool.register(b, k)
    assert pool.num_cached == 3 and pool.lookup(keys[1]) == a[1]
    pool.touch(a[:2])  # a second holder of the first two
    pool.free(a)
    assert pool.num_used == 2 and pool.num_free == 4  # a[2] cached, reusable and allocatable
    pool.free(a[:2])
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_free == 6
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0]])
    # fresh blocks go first, then cached ones, the tail of the freed prefix first
    fresh = pool.allocate(3)
    assert set(fresh).isdisjoint(a) and pool.num_cached == 3
    assert pool.allocate(1) == [a[2]] and pool.lookup(keys[2]) is None and pool.lookup(keys[0]) == a[0]
    # a hit takes the block out of the LRU queue: it is never evicted while held
    assert pool.can_allocate(2) and not pool.can_allocate(2, reusing=[a[0]])
    pool.touch([a[0]])
    assert pool.allocate(1) == [a[1]] and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.lookup(keys[0]) == a[0] and not pool.reset()  # held blocks: reset refused, nothing dropped
    pool.free(fresh + [a[0], a[1], a[2]])
    assert pool.reset() and pool.num_cached == 0 and pool.num_free == 6 and pool.lookup(keys[0]) is None


def test_register_keeps_the_first_copy_and_does_nothing_without_caching():
    pool = BlockPool(4, block_size=2, enable_caching=True)
    x, y = pool.allocate(2)
    pool.register(x, b"k" * 32)
    pool.register(y, b"k" * 32)  # the same content computed side by side
    assert pool.lookup(b"k" * 32) == x and pool.num_cached == 1
    pool.free([x, y])
    assert pool.num_cached == 1 and pool.allocate(3)[:2] != [x, x]  # y went back as a plain free block
    plain = BlockPool(2, block_size=2)
    b = plain.allocate(1)
    plain.register(b[0], b"k" * 32)
    assert plain.lookup(b"k" * 32) is None and plain.num_cached == 0


def test_random_block_traffic_never_hands_out_a_held_block():
    rng = random.Random(3)
    pool = BlockPool(16, block_size=1, enable_caching=True)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            b = rng.choice(list(held))
            pool.free([b])
            held[b] -= 1
            if not held[b]:
                del held[b]
        elif rng.random() < 0.3 and pool.num_cached:
            k = bytes([rng.randrange(40)]) * 32
            b = pool.lookup(k)
            if b is not None and pool.can_allocate(0, reusing=[b]):
                pool.touch([b])
                held[b] = held.get(b, 0) + 1
        elif pool.num_free:
            (b,) = pool.allocate(1)
            assert b not in held
            held[b] = 1
            pool.register(b, bytes([rng.randrange(40)]) * 32)
        assert pool.num_used == len(held) and pool.num_free == 16 - len(held)


def test_checkpoints_visible_after_commit_evicted_least_recently_used():
    pool = StateCheckpointPool(2, first_row=5)
    r1 = pool.reserve(b"a")
    assert r1 in (5, 6) and pool.lookup(b"a") is None and pool.contains(b"a")  # pending: not matchable
    pool.commit()
    assert pool.lookup(b"a") == r1
    r2 = pool.reserve(b"b")
    assert pool.reserve(b"c") == r1  # no free row: the least recently used committed one
    pool.commit()
    # "a" was evicted by "c" (both rows were taken, "a" least recently used); "b" stays
    assert pool.lookup(b"a") is None and pool.lookup(b"b") == r2 and pool.lookup(b"c") == r1
    pool.lookup(b"c")
    pool.lookup(b"b")  # b most recent now: d evicts c
    pool.reserve(b"d")
    pool.commit()
    assert pool.lookup(b"c") is None and pool.lookup(b"b") == r2
    assert {pool.reserve(b"e"), pool.reserve(b"f")} == {r1, r2}  # both committed ones evicted
    assert pool.reserve(b"g") is None  # every row pending: no checkpoint
    pool.reset()
    assert pool.num_cached == pool.num_pending == 0
    assert StateCheckpointPool(0, 3).reserve(b"x") is None


def make_cache(num_blocks=64, block_size=4, m=8, rows=4, attention=True):
    pool = BlockPool(num_blocks, block_size, enable_caching=True) if attention else None
    return PrefixCache(block_pool=pool, checkpoints=StateCheckpointPool(rows, 100), mamba_block_size=m)


def prefill(cache, tokens, hashes=None):
    """Play a request that prefills `tokens` whole, with its planned checkpoints: returns its keys."""
    hashes = [] if hashes is None else hashes
    cache.extend_hashes(hashes, lambda a, b: tokens[a:b], len(tokens))
    plan = cache.plan_checkpoints(hashes, 0, len(tokens))
    assert cache.plan_checkpoints(hashes, 0, len(tokens)) == plan  # planning changes nothing
    cache.remember_boundaries(hashes, len(tokens))
    for c in plan:
        assert cache.reserve_checkpoint(hashes, c) is not None
    if cache.block_pool is not None:
        table = cache.block_pool.allocate(cache.block_pool.blocks_needed(len(tokens)))
        cache.register_blocks(hashes, table, 0, len(tokens) // cache.hash_block_size)
        cache.block_pool.free(table)
    cache.checkpoints.commit()
    return hashes, plan


@pytest.mark.parametrize("attention", [True, False])
def test_match_needs_kv_and_a_checkpoint_at_one_boundary(attention):
    cache = make_cache(attention=attention)
    rng = random.Random(1)
    x = [rng.randrange(1000) for _ in range(26)]
    keys, plan = prefill(cache, x)
    assert plan == [24]  # the last boundary floor(25 / 8) * 8; no branch point on a first sight
    # a repeat: all but the tail; one token more or less moves the match by a boundary or not at all
    assert cache.match(chain(x, cache.hash_block_size), 26).num_tokens == 24
    assert cache.match(chain(x[:25], cache.hash_block_size), 25).num_tokens == 24  # c <= P - 1
    assert cache.match(chain(x[:24], cache.hash_block_size), 24).num_tokens == 0  # 16 has no checkpoint
    m = cache.match(keys, 26)
    if attention:
        assert m.blocks == [cache.block_pool.lookup(k) for k in keys[:6]] and m.checkpoint_row is not None
    # a second prompt sharing 19 tokens: branch point at 16 (seen before), then its last boundary
    y = x[:19] + [rng.randrange(1000) + 1000 for _ in range(14)]
    assert cache.match(chain(y, cache.hash_block_size), 33).num_tokens == 0
    _, plan = prefill(cache, y)
    assert plan == [16, 32]
    z = x[:19] + [5000] * 3
    assert cache.match(chain(z, cache.hash_block_size), 22).num_tokens == 16  # the third one hits
    if attention:  # without the KV blocks of [0, 16) no layer can resume there
        held = cache.block_pool.allocate(cache.block_pool.num_free)  # evicts every cached block
        assert cache.match(chain(z, 4), 22).num_tokens == 0
        assert not cache.reset() and cache.checkpoints.num_cached == 3  # refused while blocks are held
        cache.block_pool.free(held)
    assert cache.reset() and cache.checkpoints.num_cached == 0
    assert cache.match(chain(x, cache.hash_block_size), 26).num_tokens == 0


def test_checkpoint_eviction_under_a_small_pool_and_reset():
    cache = make_cache(rows=2, attention=False)
    rng = random.Random(2)
    prompts = [[rng.randrange(1000) for _ in range(17)] for _ in range(3)]
    for p in prompts:
        prefill(cache, p)
    hits = [cache.match(chain(p, 8), 17).num_tokens for p in prompts]
    assert hits == [0, 16, 16]  # two rows: the oldest checkpoint was evicted
    assert cache.reset() and [cache.match(chain(p, 8), 17).num_tokens for p in prompts] == [0, 0, 0]


def test_mamba_block_size_must_be_a_multiple_of_the_kv_block():
    with pytest.raises(ValueError, match="multiple"):
        PrefixCache(block_pool=BlockPool(4, 16, True), checkpoints=StateCheckpointPool(1, 0), mamba_block_size=24)


def test_extend_hashes_equals_hash_block_folded_over_the_blocks():
    """The one-conversion chain of `extend_hashes` names blocks exactly as `hash_block` does,
    extended in pieces that end inside a block, on one and at the prompt's end."""
    rng = random.Random(1)
    tokens = [rng.randrange(2**40) for _ in range(16 * 37 + 5)]
    expected, parent = [], None
    for j in range(len(tokens) // 16):
        parent = hash_block(parent, tokens[16 * j:16 * (j + 1)])
        expected.append(parent)
    cache = PrefixCache(block_pool=None, checkpoints=StateCheckpointPool(0, 0), mamba_block_size=16)
    hashes = []
    for n in (7, 16, 16, 200, 513, len(tokens)):
        cache.extend_hashes(hashes, lambda a, b: tokens[a:b], n)
        assert hashes == expected[: n // 16]
