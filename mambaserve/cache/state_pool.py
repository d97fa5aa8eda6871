"""Bookkeeping for the per-request recurrent state slots (conv and SSM state of every Mamba layer).

A slot is an index into the engine's state tensors, which have one row per slot. A running
request holds exactly one slot from admission until it finishes, is aborted or is preempted.
This pool only hands out and takes back indices: it holds no tensors and never zeroes
anything (the engine marks a newly admitted request as having no initial state).
"""

from __future__ import annotations


class StateSlotPool:
    """A fixed set of `num_slots` state slots, each held by at most one request at a time.

    Freed slots are reused last-in first-out, so a busy engine keeps touching the same rows.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        self._num_slots = num_slots
        # Reversed so that the first allocations return 0, 1, 2, ...
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        """Take a free slot. Raises RuntimeError if every slot is in use."""
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self._num_slots} in use)")
        slot = self._free.pop()
        assert slot not in self._used
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return a slot. Raises ValueError for a slot that is not currently allocated."""
        if slot not in self._used:
            why = "out of range" if not 0 <= slot < self._num_slots else "already free"
            raise ValueError(f"cannot free state slot {slot!r}: {why}")
        self._used.remove(slot)
        self._free.append(slot)

    def __repr__(self) -> str:
        return f"StateSlotPool(used={self.num_used}/{self._num_slots})"
