"""IndexPool, StateSlotPool and BlockPool: never hand out a slot or block twice, return to full when freed."""

import random

import pytest

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.index_pool import IndexPool
from mambaserve.cache.state_pool import StateSlotPool


def test_index_pool_hands_out_in_order_and_reuses_last_freed_first():
    pool = IndexPool(4)
    assert pool.take(3) == [0, 1, 2] and (pool.num_free, pool.num_used) == (1, 3)
    pool.give_back([2, 0])
    assert pool.take(2) == [2, 0]  # the same ids, in the order they were given back
    assert pool.take(1) == [3] and pool.num_free == 0
    assert pool.is_used(0) and not pool.is_used(4)


def test_slot_pool_exhaustion_and_reuse():
    pool = StateSlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(slots[1])
    assert pool.allocate() == slots[1]
    for s in slots:
        pool.free(s)
    assert (pool.num_free, pool.num_used, pool.num_slots) == (3, 0, 3)


def test_slot_pool_rejects_bad_frees_and_sizes():
    pool = StateSlotPool(2)
    s = pool.allocate()
    pool.free(s)
    with pytest.raises(ValueError, match="already free"):
        pool.free(s)
    with pytest.raises(ValueError, match="out of range"):
        pool.free(2)
    with pytest.raises(ValueError):
        pool.free(-1)
    assert pool.num_free == 2
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            StateSlotPool(bad)


def test_block_pool_all_or_nothing():
    pool = BlockPool(5, block_size=4)
    a = pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free == 2  # the failed allocation took nothing
    b = pool.allocate(2)
    assert sorted(a + b) == list(range(5)) and pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        pool.free([a[0], a[0]])
    with pytest.raises(ValueError):
        pool.free([a[0], 99])
    assert pool.num_used == 5  # the failed frees returned nothing
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a[:1])
    pool.free(b)
    assert (pool.num_free, pool.num_used) == (5, 0)


def test_blocks_needed_is_ceil():
    pool = BlockPool(4, block_size=16)
    assert [pool.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert BlockPool(1, block_size=1).blocks_needed(7) == 7
    with pytest.raises(ValueError):
        pool.blocks_needed(-1)
    for nb, bs in ((0, 16), (4, 0)):
        with pytest.raises(ValueError):
            BlockPool(nb, bs)


def test_random_churn_never_double_allocates():
    rng = random.Random(0)
    slots, blocks = StateSlotPool(7), BlockPool(23, block_size=3)
    held_slots: set[int] = set()
    held_blocks: list[list[int]] = []
    for _ in range(2000):
        if rng.random() < 0.5 and slots.num_free:
            s = slots.allocate()
            assert s not in held_slots and 0 <= s < 7
            held_slots.add(s)
        elif held_slots:
            s = rng.choice(sorted(held_slots))
            held_slots.remove(s)
            slots.free(s)
        n = rng.randint(0, 6)
        if rng.random() < 0.5 and blocks.can_allocate(n):
            got = blocks.allocate(n)
            flat = {b for group in held_blocks for b in group}
            assert len(set(got)) == n and flat.isdisjoint(got) and all(0 <= b < 23 for b in got)
            held_blocks.append(got)
        elif held_blocks:
            blocks.free(held_blocks.pop(rng.randrange(len(held_blocks))))
        assert slots.num_used == len(held_slots) == 7 - slots.num_free
        assert blocks.num_used == sum(map(len, held_blocks)) == 23 - blocks.num_free
    for s in held_slots:
        slots.free(s)
    for group in held_blocks:
        blocks.free(group)
    assert slots.num_free == 7 and blocks.num_free == 23
