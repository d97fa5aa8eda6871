"""The decode-step fusions' switch: opt-in by default, `fused()` / `unfused()` nest and restore."""

import threading

from mambaserve import ops
from mambaserve.ops import dispatch


def test_fusions_are_opt_in_and_the_blocks_nest_per_thread():
    assert ops.fusions_enabled() is dispatch.DECODE_FUSIONS
    with ops.fused():
        assert ops.fusions_enabled()
        seen = []
        t = threading.Thread(target=lambda: seen.append(ops.fusions_enabled()))
        t.start()
        t.join()
        assert seen == [dispatch.DECODE_FUSIONS]  # another thread keeps the default
        with ops.unfused():
            assert not ops.fusions_enabled()
        assert ops.fusions_enabled()
    assert ops.fusions_enabled() is dispatch.DECODE_FUSIONS
