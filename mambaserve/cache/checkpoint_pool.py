"""Bookkeeping for the Mamba state checkpoints of prefix caching.

A checkpoint is a copy of one request's running state (the conv and SSM state of every Mamba
layer) after the first c tokens of its prompt, kept in extra rows of the same state tensors as
the running slots (rows first_row .. first_row + num_checkpoints - 1), under the hash of the
token chain [0, c). A later request whose prompt starts with those c tokens copies the row into
its own slot and computes from c on: it never writes into the checkpoint.

A row is written by the step that computes its request's chunk ending at c (the copy runs after
that step's forward) and becomes visible to lookups only at `commit`, which the scheduler calls
when it plans the next step: a request planned in the same step as the save must not read it.
No row needs a reference count: copies into slots run before their step's forward and copies
out of slots after it, in stream order, so a row evicted and written again in a step was read
by every earlier load already. Committed rows are evicted least recently used first.

Pure Python: row ids and hashes only.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpointPool:
    """`num_checkpoints` checkpoint rows, the first at state row `first_row` (0 rows: caching
    of Mamba states off)."""

    def __init__(self, num_checkpoints: int, first_row: int) -> None:
        if not isinstance(num_checkpoints, int) or num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be an integer >= 0, got {num_checkpoints!r}")
        self.num_checkpoints = num_checkpoints
        self.first_row = first_row
        self._free: list[int] = list(range(first_row + num_checkpoints - 1, first_row - 1, -1))
        self._row_of: dict[bytes, int] = {}  # committed
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # committed rows, least recently used first
        self._pending: dict[bytes, int] = {}  # written by the step in flight, visible at commit

    @property
    def num_cached(self) -> int:
        """Committed checkpoints (lookups can find them)."""
        return len(self._lru)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def lookup(self, key: bytes) -> int | None:
        """The committed row of `key`, marked most recently used; None if there is none."""
        row = self._row_of.get(key)
        if row is not None:
            self._lru.move_to_end(row)
        return row

    def contains(self, key: bytes) -> bool:
        """Whether `key` has a row, committed or pending (then a second save is not needed)."""
        return key in self._row_of or key in self._pending

    def is_pending(self, key: bytes) -> bool:
        """Whether `key` is being written by the step being planned (visible after `commit`)."""
        return key in self._pending

    def reserve(self, key: bytes) -> int | None:
        """A row for the checkpoint `key`, written by the step being planned: a free row, else
        the least recently used committed one (evicted). None when there is no row at all or
        every row is pending; the caller then takes no checkpoint. Pending until `commit`."""
        assert not self.contains(key), "checkpoint already kept"
        if self._free:
            row = self._free.pop()
        elif self._lru:
            row, old = self._lru.popitem(last=False)
            del self._row_of[old]
        else:
            return None
        self._pending[key] = row
        return row

    def commit(self) -> None:
        """Make the pending checkpoints visible (their step has been launched)."""
        for key, row in self._pending.items():
            self._row_of[key] = row
            self._lru[row] = key
        self._pending.clear()

    def discard_pending(self) -> None:
        """Free the pending rows unwritten (the step that was to write them failed): a commit
        would let later prompts resume from whatever the rows held."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def reset(self) -> None:
        """Drop every checkpoint, pending ones too."""
        self.__init__(self.num_checkpoints, self.first_row)

    def __repr__(self) -> str:
        return (f"StateCheckpointPool(cached={self.num_cached}, pending={self.num_pending}, "
                f"rows={self.num_checkpoints} from {self.first_row})")
