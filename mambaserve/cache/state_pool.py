"""Bookkeeping for the per-request recurrent state slots (conv and SSM state of every Mamba layer).

A slot is an index into the engine's state tensors, which have one row per slot. A running
request holds exactly one slot from admission until it finishes, is aborted or is preempted.
This pool only hands out and takes back indices: it holds no tensors and never zeroes
anything (the engine marks a newly admitted request as having no initial state).
"""

from __future__ import annotations

from mambaserve.cache.index_pool import IndexPool


class StateSlotPool:
    """A fixed set of `num_slots` state slots, each held by at most one request at a time.

    Freed slots are reused last-in first-out, so a busy engine keeps touching the same rows.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        self._ids = IndexPool(num_slots)

    @property
    def num_slots(self) -> int:
        return self._ids.size

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_used(self) -> int:
        return self._ids.num_used

    def allocate(self) -> int:
        """Take a free slot. Raises RuntimeError if every slot is in use."""
        if not self._ids.num_free:
            raise RuntimeError(f"no free state slot (all {self.num_slots} in use)")
        return self._ids.take(1)[0]

    def free(self, slot: int) -> None:
        """Return a slot. Raises ValueError for a slot that is not currently allocated."""
        if not self._ids.is_used(slot):
            why = "out of range" if not 0 <= slot < self.num_slots else "already free"
            raise ValueError(f"cannot free state slot {slot!r}: {why}")
        self._ids.give_back([slot])

    def __repr__(self) -> str:
        return f"StateSlotPool(used={self.num_used}/{self.num_slots})"
