"""Shared test helpers: seeded randomness, NaN poisoning, dtype-scaled tolerances."""

import os
import zlib

import torch

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tiny test models gain nothing from intra-op threads, and lose much when cores are shared.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()

# The costliest engine and server cases, by measurement (`pytest -m "not slow" --durations=80` on
# the 2 shared CPU cores of the development machine; each took over ~2 s there), are `slow` too,
# so that the fast loop stays short while README's test command still runs them. Regenerate the
# list the same way when the suite changes.
MEASURED_SLOW = frozenset(
    line.strip() for line in open(os.path.join(os.path.dirname(__file__), "measured_slow.txt")) if line.strip())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)


def tolerance(dtype: torch.dtype) -> float:
    """Relative error a kernel may have against a float64 reference, by its input dtype."""
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (an element was not written)"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _seed(request):
    # crc32, not hash(): str hashes change from process to process, and a failure must reproduce
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


def nan_empty(*shape, dtype=torch.float32, device="cpu"):
    """torch.empty filled with NaN, so that any element a kernel forgets to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_greedy_close(a: list[tuple[list[int], list[dict[int, float]]]],
                        b: list[tuple[list[int], list[dict[int, float]]]], *, max_gap: float = 0.25,
                        logprob_tol: float = 0.25) -> list[int | None]:
    """Two greedy runs of the same sequences in reduced precision (bfloat16): per sequence,
    (generated token ids, one {token: logprob} dict of the top candidates per step).

    Tokens must be equal until the first step where they differ; at that step each run's token
    must be among the other's candidates, less than `max_gap` nats below the other's choice in
    both runs: a near tie that rounding (another kernel, another padded shape) may flip, after
    which the two continuations are unrelated and are not compared. Where both runs list a
    token, their logprobs differ by less than `logprob_tol`. Returns the first differing step
    per sequence (None where all are equal). A real bug moves logprobs by far more.
    """
    assert len(a) == len(b)
    first = []
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        assert len(ta) == len(tb), f"sequence {i}: {len(ta)} vs {len(tb)} tokens"
        diverged = None
        for t, (x, y) in enumerate(zip(ta, tb)):
            for tok in set(la[t]) & set(lb[t]):
                assert abs(la[t][tok] - lb[t][tok]) < logprob_tol, (
                    f"sequence {i} step {t}: logprob of token {tok} {la[t][tok]:.4f} vs {lb[t][tok]:.4f}")
            if x != y:
                assert y in la[t] and x in lb[t], f"sequence {i} step {t}: {x} vs {y}, not in each other's candidates"
                gaps = (la[t][x] - la[t][y], lb[t][y] - lb[t][x])
                assert max(gaps) < max_gap, f"sequence {i} step {t}: {x} vs {y} is no near tie (gaps {gaps})"
                diverged = t
                break
        first.append(diverged)
    return first


@pytest.fixture
def fusions_on():
    """The decode-step fusions on for a test (they are opt-in in the engine:
    ops.dispatch.DECODE_FUSIONS); the fused-vs-unfused tests compare them with `ops.unfused()`."""
    from mambaserve import ops

    with ops.fused():
        yield
