"""The fused router (`ops.router_topk` at decode sizes: the split logits product and the top-k in
one launch, its last program per token taking the top-k) against the two-launch path of
`ops.unfused()` (bit for bit: the same partial sums in the same order) and against float64
logits; outputs NaN-poisoned, awkward sizes (1 token, odd hidden sizes, expert counts that are
no power of two, rows wider than 64 experts), counters left at zero for the next call."""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import moe as moe_mod
from tests.conftest import rel_err, tolerance
from tests.ops.kernel_helpers import DEVICES

pytestmark = pytest.mark.usefixtures("fusions_on")  # the fused decode paths are opt-in in the engine



DEVICE = DEVICES[0]


def _router_case(num_tokens, hidden, E, dtype):
    """x, w whose float64 logits are about scale_e * |x_0|^2 / hidden, the scales 1/8 apart (a
    choice that rounding to bfloat16 cannot change), plus noise."""
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    x[1:] = x[:1] + 0.01 * torch.randn(num_tokens - 1, hidden, device=DEVICE)
    scale = torch.randperm(E, device=DEVICE).float() / 8
    w = x[:1].expand(E, hidden) * scale[:, None] / hidden + 0.001 * torch.randn(E, hidden, device=DEVICE)
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("num_tokens,hidden,E,top_k,num_shared,renormalize", [
    (1, 70, 11, 4, 1, True),
    (3, 37, 62, 6, 0, True),
    (16, 33, 5, 1, 2, False),
    (2, 64, 100, 3, 0, False),  # past 64 experts: the top-k by rounds of arg-max
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_router_equals_two_launches_and_float64(poison_empty, num_tokens, hidden, E, top_k, num_shared,
                                                      renormalize, dtype):
    x, w = _router_case(num_tokens, hidden, E, dtype)
    with ops.backend("triton"):
        fused = ops.router_topk(x, w, top_k, torch.float32, num_shared, renormalize)
        again = ops.router_topk(x, w, top_k, torch.float32, num_shared, renormalize)  # counters reused
        with ops.unfused():
            split = ops.router_topk(x, w, top_k, torch.float32, num_shared, renormalize)
    counts = moe_mod._COUNTERS[x.device]
    assert int(counts.abs().sum()) == 0, "every launch leaves its counters at zero"
    for a, b in ((fused, split), (again, split)):
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    logits = x.double() @ w.double().t()
    vals, ref_ids = logits.topk(top_k, dim=-1)
    p = torch.softmax(vals, -1) if renormalize else torch.softmax(logits, -1).gather(1, ref_ids)
    ids, wts = fused[1].long(), fused[0]
    if dtype == torch.float32:
        assert torch.equal(ids[:, :top_k].cpu(), ref_ids.cpu())
    else:  # logits that round to the same bf16 value may swap places: the same experts, largest first
        assert torch.equal(ids[:, :top_k].sort(-1).values.cpu(), ref_ids.sort(-1).values.cpu())
        assert bool((wts[:, :top_k].diff(dim=-1) <= 0).all())
    assert torch.equal(ids[:, top_k:].cpu(), torch.arange(E, E + num_shared).expand(num_tokens, num_shared))
    assert rel_err(wts[:, :top_k], p) < 4 * tolerance(dtype)  # bf16: the logits are rounded (as a Linear's)
    assert torch.equal(wts[:, top_k:].cpu(), torch.ones(num_tokens, num_shared))


def test_fused_router_reads_strided_rows():
    """x a column slice of a wider tensor (its rows strided), as the layers may pass it."""
    wide = torch.randn(4, 90, device=DEVICE)
    x = wide[:, 10:80]
    w = torch.randn(9, 70, device=DEVICE)
    with ops.backend("triton"):
        fused = ops.router_topk(x, w, 2, torch.float32)
        with ops.unfused():
            split = ops.router_topk(x.contiguous(), w, 2, torch.float32)
    assert torch.equal(fused[1], split[1])
    # on a GPU the split path's product over the contiguous copy sums in another order: rounding only
    tol = dict(rtol=1e-5, atol=1e-6) if x.is_cuda else dict(rtol=0, atol=0)
    assert torch.allclose(fused[0], split[0], **tol), (fused[0] - split[0]).abs().max()
