"""silu_and_mul and top-k softmax routing: Triton (interpreter on CPU) against the references."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve import ops
from tests.conftest import HAS_CUDA, rel_err, tolerance

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 24), (7, 100), (3, 1030)])
@pytest.mark.slow
def test_silu_and_mul(dtype, rows, inter):
    h = torch.randn(rows, 2 * inter, device=DEVICE).to(dtype)
    with ops.backend("triton"):
        out = ops.silu_and_mul(h)
    ref = F.silu(h.double()[:, :inter]) * h.double()[:, inter:]
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert rel_err(out, ref) < tolerance(dtype)
    with ops.backend("reference"):
        assert rel_err(ops.silu_and_mul(h), ref) < tolerance(dtype)


TOPK_CASES = [(1, 62, 6), (9, 8, 2), (5, 5, 1), (4, 5, 5), (2, 100, 4)]


def _expected_weights(logits, vals, renormalize):
    """float64 routing weights of the chosen logits `vals`: a softmax over them, or (renormalize
    False, Jamba's router) their entries of the softmax over the whole row of `logits`."""
    if renormalize:
        return torch.softmax(vals, -1)
    return torch.exp(vals - torch.logsumexp(logits.double(), -1, keepdim=True))


def _check_topk_softmax(dtype, num_tokens, num_experts, top_k, renormalize):
    # distinct values, exact in bfloat16 (ties may be ordered either way)
    logits = torch.stack([torch.randperm(num_experts) for _ in range(num_tokens)]).float().div(4).to(DEVICE, dtype)
    with ops.backend("triton"):
        w, ids = ops.topk_softmax(logits, top_k, torch.float32, renormalize=renormalize)
    vals, ref_ids = logits.double().topk(top_k, dim=-1)
    expected = _expected_weights(logits, vals, renormalize)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    assert rel_err(w, expected) < 1e-6
    with ops.backend("reference"):
        w2, ids2 = ops.topk_softmax(logits, top_k, dtype, renormalize=renormalize)
    assert torch.equal(ids2.cpu(), ref_ids.cpu()) and w2.dtype == dtype
    assert rel_err(w2, expected) < tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", TOPK_CASES)
def test_topk_softmax(dtype, num_tokens, num_experts, top_k):
    _check_topk_softmax(dtype, num_tokens, num_experts, top_k, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", TOPK_CASES)
def test_topk_of_softmax_over_all_experts(dtype, num_tokens, num_experts, top_k):
    """renormalize=False (Jamba): the chosen entries of the softmax over all experts."""
    _check_topk_softmax(dtype, num_tokens, num_experts, top_k, renormalize=False)


@pytest.mark.parametrize("num_shared", [1, 2])
def test_topk_softmax_with_always_on_shared_experts(num_shared):
    """An absorbed shared expert: columns num_experts + j with weight 1 after the routed ones."""
    logits = torch.stack([torch.randperm(10) for _ in range(3)]).float().div(4).to(DEVICE)
    vals, ref_ids = logits.double().topk(3, dim=-1)
    for name in ("triton", "reference"):
        with ops.backend(name):
            w, ids = ops.topk_softmax(logits, 3, torch.bfloat16, num_shared=num_shared)
        assert ids.shape == (3, 3 + num_shared) and w.dtype == torch.bfloat16
        assert torch.equal(ids[:, :3].long().cpu(), ref_ids.cpu())
        assert torch.equal(ids[:, 3:].long().cpu(), torch.arange(10, 10 + num_shared).expand(3, num_shared))
        assert torch.equal(w[:, 3:].float().cpu(), torch.ones(3, num_shared))
        assert rel_err(w[:, :3], torch.softmax(vals, -1)) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # 40: past the fused kernel's limit
def test_router_topk(dtype, num_tokens):
    """Router product and top-k (one kernel for few tokens) against the float64 logits."""
    _check_router_topk(dtype, num_tokens, renormalize=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_router_topk_of_softmax_over_all_experts(dtype, num_tokens):
    _check_router_topk(dtype, num_tokens, renormalize=False)


def _check_router_topk(dtype, num_tokens, renormalize):
    hidden, E = 70, 11
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    scale = torch.randperm(E, device=DEVICE).float() / 8
    # logits = row scale * |x|^2 / hidden + noise: far apart, so the choice is unambiguous
    w = (x[:1].expand(E, hidden) * scale[:, None] / hidden + 0.01 * torch.randn(E, hidden, device=DEVICE))
    x[1:] = x[:1] + 0.01 * torch.randn(num_tokens - 1, hidden, device=DEVICE)
    x, w = x.to(dtype), w.to(dtype)
    logits = x.double() @ w.double().t()
    vals, ref_ids = logits.topk(4, dim=-1)
    expected = _expected_weights(logits, vals, renormalize)
    with ops.backend("triton"):
        tw, ids = ops.router_topk(x, w, 4, torch.float32, num_shared=1, renormalize=renormalize)
    assert torch.equal(ids[:, :4].long().cpu(), ref_ids.cpu()) and bool((ids[:, 4] == E).all())
    assert rel_err(tw[:, :4], expected) < 4 * tolerance(dtype)
    with ops.backend("reference"):
        tw2, ids2 = ops.router_topk(x, w, 4, torch.float32, num_shared=1, renormalize=renormalize)
    assert torch.equal(ids2[:, :4].long().cpu(), ref_ids.cpu())
    assert rel_err(tw2[:, :4], expected) < 4 * tolerance(dtype)


def test_topk_softmax_checks_k():
    with pytest.raises(ValueError, match="top_k"):
        ops.topk_softmax(torch.randn(2, 4), 5)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.slow
def test_topk_softmax_keeps_ids_in_range_for_nan_rows():
    """A graphed step's padding rows may hold NaN: their expert ids must still index weights."""
    # both top-k strategies (all at once; rounds of arg-max), with and without renormalising
    for E, renormalize in ((7, True), (100, True), (7, False), (100, False)):
        logits = torch.randn(3, E, device=DEVICE)
        logits[1] = float("nan")
        logits[2, 3] = float("nan")
        with ops.backend("triton"):
            w, ids = ops.topk_softmax(logits, 4, torch.float32, renormalize=renormalize)
        assert int(ids.min()) >= 0 and int(ids.max()) < E
        assert len(set(ids[0].tolist())) == 4 and 3 not in ids[2].tolist()
        assert len(set(ids[1].tolist())) == 4  # distinct experts even for a row of NaN
        assert torch.isfinite(w).all() and float(w[1].abs().sum()) == 0.0  # and weights 0, not NaN
