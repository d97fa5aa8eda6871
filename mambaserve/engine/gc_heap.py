"""Keeping Python's cyclic garbage collector off the engine's long-lived objects.

After start-up an engine holds hundreds of thousands of Python objects that live as long as it
does (the model's modules and parameters, compiled Triton kernels, captured graphs and their
launch plans: about 420,000 for the tiny CPU test model). A full (generation 2) collection walks
all of them: 215 ms on one CPU core for that model (`benchmarks/gc_pauses.py`), a stall of the
step it falls in (vLLM freezes its engine-core heap after start-up for the same reason).
`gc_heap_frozen` moves the objects alive at its start into the permanent generation
(`gc.freeze`) for the duration of a block and gives them back at its end, so that an engine
that ends inside the process (a benchmark of several engines, tests) is still collected.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """Within the block, the objects alive at its start are never scanned by the cyclic
    collector (and never collected); at its end they are given back (`gc.unfreeze`). Enter it
    once the engine is built. Nested blocks: the innermost end gives back everything."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
