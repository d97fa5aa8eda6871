"""A free-list of the integer ids 0..size-1: the bookkeeping under both cache pools.

`StateSlotPool` (one state slot per request) and `BlockPool` (a request's KV blocks) differ
only in how many ids a request takes and in their messages; the free-list, its reuse order and
its double-free checks live here once. Pure Python: it holds no tensors and knows nothing of
what an id indexes.
"""

from __future__ import annotations


class IndexPool:
    """`size` ids, each held by at most one owner. Freed ids are reused last-in first-out, so a
    busy engine keeps touching the same cache rows; a fresh pool hands out 0, 1, 2, ...

    The pools above check a caller's request first (enough free ids; ids held, none twice) and
    phrase their own errors; here those conditions are internal invariants.
    """

    def __init__(self, size: int) -> None:
        assert isinstance(size, int) and size >= 1, size
        self.size = size
        # Reversed so that the first allocations return 0, 1, 2, ...
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def is_used(self, index: int) -> bool:
        return index in self._used

    def take(self, n: int) -> list[int]:
        """The `n` most recently freed ids (fresh ones in increasing order). The caller checks
        `0 <= n <= num_free` first."""
        assert 0 <= n <= len(self._free), (n, len(self._free))
        ids = [self._free.pop() for _ in range(n)]
        assert self._used.isdisjoint(ids)
        self._used.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        """Return held ids (each once); taking the same count next returns them in this order."""
        assert len(set(ids)) == len(ids) and self._used.issuperset(ids), ids
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))
