"""Fixtures of the engine tests (plain helpers are in engines.py)."""

import pytest

from tests.engine.engines import make, prompts_for, run


@pytest.fixture(scope="module")
def alone():
    """Each prompt generated alone, per family: the reference every batching test compares with."""
    cache = {}

    def get(name):
        if name not in cache:
            llm = make(name, max_num_seqs=1)
            cache[name] = [run(llm, [p])[0] for p in prompts_for(name)]
        return cache[name]

    return get
