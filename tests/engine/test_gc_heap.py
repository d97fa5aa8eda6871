"""`gc_heap_frozen`: the objects alive when it starts are out of the cyclic collector's sight
for the block, and given back (so collected when unreachable) at its end."""

import gc

from mambaserve.engine.gc_heap import gc_heap_frozen


class _Cycle:
    def __init__(self):
        self.me = self


def test_objects_alive_at_the_start_are_frozen_for_the_block_and_given_back_after():
    assert gc.get_freeze_count() == 0
    before = _Cycle()
    ref = __import__("weakref").ref(before)
    with gc_heap_frozen():
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not look at it
        during = __import__("weakref").ref(_Cycle())
        gc.collect()
        assert during() is None  # made inside the block: collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_the_heap_is_given_back_when_the_block_raises():
    try:
        with gc_heap_frozen():
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
