"""Fixtures of the op tests (plain helpers are in kernel_helpers.py)."""

import pytest
import torch


@pytest.fixture
def poison_empty(monkeypatch):
    """Every torch.empty / torch.empty_like inside the test comes back NaN-filled (floats) or
    filled with a huge negative number (integers), so an element or intermediate buffer that a
    kernel forgets to write shows up in the result."""
    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-(2**30))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(orig_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(orig_empty_like(*a, **k)))
    yield
