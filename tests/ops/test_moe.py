"""Triton fused MoE against the PyTorch reference.

Routing is skewed on purpose: some experts get many rows, some one, some none. CPU runs go
through Triton's interpreter (small shapes); the GPU cases skip without CUDA and also check
the torch._grouped_mm path.
"""

import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference
from mambaserve.ops.moe import _HAS_GROUPED_MM
from tests.conftest import HAS_CUDA, nan_empty, rel_err, tolerance

# Triton runs on CUDA tensors when there is a GPU, else on CPU tensors through the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def fused_moe_triton(*args, **kwargs):
    """`ops.fused_moe` on its Triton path (the interpreter on CPU tensors)."""
    with ops.backend("triton"):
        return ops.fused_moe(*args, **kwargs)


def _make(num_tokens, hidden, inter, num_experts, top_k, dtype, device, empty_experts=2):
    """Weights, inputs and an uneven top-k routing in which `empty_experts` experts get no row."""
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w1 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    popularity = torch.rand(num_experts, device=device) ** 4 + 1e-3  # heavy-tailed loads
    popularity[torch.randperm(num_experts, device=device)[:empty_experts]] = 0.0
    topk_ids = torch.multinomial(popularity.expand(num_tokens, -1), top_k, replacement=False)
    topk_weights = torch.rand(num_tokens, top_k, device=device).softmax(-1)
    return x, w1, w2, topk_weights, topk_ids


def _ref(x, w1, w2, tw, ti):
    up = torch.float64 if x.device.type == "cpu" else torch.float32
    return reference.fused_moe(x.to(up), w1.to(up), w2.to(up), tw.to(up), ti)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 6])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.slow
def test_fused_moe_uneven_loads(dtype, top_k, num_tokens):
    x, w1, w2, tw, ti = _make(num_tokens, 48, 40, 10, top_k, dtype, DEVICE)
    with ops.backend("triton"):
        out = ops.fused_moe(x, w1, w2, tw, ti)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, _ref(x, w1, w2, tw, ti)) < tolerance(dtype)


def test_fused_moe_triton_path_nan_poisoned_out_and_odd_sizes():
    """Sizes that are not multiples of any block; one expert takes most of the rows."""
    x, w1, w2, tw, ti = _make(29, 40, 24, 7, 2, torch.float32, DEVICE, empty_experts=3)
    ti[: 20, 0] = 5
    ti[: 20, 1] = torch.where(ti[:20, 1] == 5, 6, ti[:20, 1])
    out = nan_empty(*x.shape, device=DEVICE)
    fused_moe_triton(x, w1, w2, tw, ti, impl="triton", out=out)
    assert rel_err(out, _ref(x, w1, w2, tw, ti)) < tolerance(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 6), (3, 2), (5, 6)])
@pytest.mark.slow
def test_fused_moe_direct_path_for_few_pairs(dtype, num_tokens, top_k):
    """The decode path: one matrix-vector product per routed pair, odd sizes, NaN-poisoned out."""
    x, w1, w2, tw, ti = _make(num_tokens, 40, 24, 9, top_k, dtype, DEVICE, empty_experts=2)
    out = nan_empty(*x.shape, dtype=dtype, device=DEVICE)
    fused_moe_triton(x, w1, w2, tw, ti.to(torch.int32), impl="direct", out=out)
    assert rel_err(out, _ref(x, w1, w2, tw, ti)) < tolerance(dtype)
    # chosen by default for few pairs, and the same function as the grouped path
    with ops.backend("triton"):
        default = ops.fused_moe(x, w1, w2, tw, ti)
    assert rel_err(default, out.double()) < tolerance(dtype)


def test_fused_moe_int32_ids_and_no_tokens():
    x, w1, w2, tw, ti = _make(5, 32, 16, 4, 2, torch.float32, DEVICE)
    out = fused_moe_triton(x, w1, w2, tw, ti.to(torch.int32))
    assert rel_err(out, _ref(x, w1, w2, tw, ti)) < tolerance(torch.float32)
    empty = fused_moe_triton(x[:0], w1, w2, tw[:0], ti[:0])
    assert empty.shape == (0, 32)


def test_fused_moe_rejects_bad_input():
    x, w1, w2, tw, ti = _make(3, 32, 16, 4, 2, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="w1"):
        fused_moe_triton(x, w1[:, :-1], w2, tw, ti)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe_triton(x, w1.double(), w2, tw, ti)
    with pytest.raises(ValueError, match="grouped_mm"):
        fused_moe_triton(x, w1, w2, tw, ti, impl="grouped_mm")  # float32 on CPU


@pytest.mark.parametrize("impl", ["direct", "triton"])
@pytest.mark.slow
def test_fused_moe_adds_the_shared_output_and_splits_odd_sizes(impl):
    """`add` (a shared expert's output) joins the sum before the one rounding; hidden 72 and
    inter 40 are not multiples of the direct kernels' blocks (several splits and loop trips)."""
    x, w1, w2, tw, ti = _make(3, 72, 40, 9, 4, torch.bfloat16, DEVICE, empty_experts=2)
    add = torch.randn(3, 72 + 8, device=DEVICE).to(torch.bfloat16)[:, 8:]  # a column slice
    out = nan_empty(*x.shape, dtype=torch.bfloat16, device=DEVICE)
    fused_moe_triton(x, w1, w2, tw, ti, impl=impl, out=out, add=add)
    ref = _ref(x, w1, w2, tw, ti) + add.double().to(_ref(x, w1, w2, tw, ti).dtype)
    assert rel_err(out, ref) < tolerance(torch.bfloat16)
    assert rel_err(out, reference.fused_moe(x.double(), w1.double(), w2.double(), tw.double(), ti,
                                            add)) < tolerance(torch.bfloat16)
    with ops.backend("triton"):
        assert torch.equal(ops.fused_moe(x, w1, w2, tw, ti, add) if impl == "direct" else out, out)


@pytest.mark.parametrize("impl", ["direct", "triton"])
def test_fused_moe_as_partials_sums_to_the_output(impl):
    """as_partials: the direct path leaves its weighted pairs (top_k, T, hidden) for the next
    norm to add; other paths return the output as one part."""
    x, w1, w2, tw, ti = _make(2, 40, 24, 7, 3, torch.float32, DEVICE)
    parts = fused_moe_triton(x, w1, w2, tw, ti, impl=impl, as_partials=True)
    assert parts.shape == ((3 if impl == "direct" else 1), 2, 40)
    assert rel_err(parts.sum(0), _ref(x, w1, w2, tw, ti)) < tolerance(torch.float32)


# ---- GPU only: model-sized shapes ---------------------------------------------------------


GPU_IMPLS = ["triton", "direct"] + (["grouped_mm"] if _HAS_GROUPED_MM else [])


@gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("num_tokens", [1, 256, 3000])
def test_fused_moe_granite_shapes_gpu(impl, num_tokens):
    if impl == "direct" and num_tokens > 256:
        pytest.skip("the direct path is for decode-sized batches")
    """granite-4.0-tiny-preview: hidden 1536, 62 experts, top-6, intermediate 512, bf16."""
    x, w1, w2, tw, ti = _make(num_tokens, 1536, 512, 62, 6, torch.bfloat16, "cuda", empty_experts=5)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w1, w2, tw, ti, impl=impl, out=out)
    assert rel_err(out, _ref(x, w1, w2, tw, ti)) < tolerance(torch.bfloat16)
    again = fused_moe_triton(x, w1, w2, tw, ti, impl=impl)
    assert torch.equal(out, again), "fused_moe is not deterministic"
    shared = torch.randn_like(x)
    with_add = fused_moe_triton(x, w1, w2, tw, ti, impl=impl, add=shared)
    assert rel_err(with_add, _ref(x, w1, w2, tw, ti) + shared.float()) < tolerance(torch.bfloat16)


@gpu
def test_fused_moe_float32_gpu_is_not_tf32():
    x, w1, w2, tw, ti = _make(100, 64, 48, 8, 3, torch.float32, "cuda")
    out = fused_moe_triton(x, w1, w2, tw, ti)
    ref = reference.fused_moe(x.double(), w1.double(), w2.double(), tw.double(), ti)
    assert rel_err(out, ref) < tolerance(torch.float32)


def _route_reference(ids, num_experts, block_m):
    """Plain Python: pairs stably sorted by expert, and the row tiles of block_m rows."""
    flat = ids.reshape(-1).tolist()
    k = ids.shape[1]
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    counts = [flat.count(e) for e in range(num_experts)]
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    inv = [0] * len(flat)
    for row, p in enumerate(order):
        inv[p] = row
    tile_expert, tile_first = [], []
    for e, c in enumerate(counts):
        tile_first.append(len(tile_expert))
        tile_expert += [e] * (-(-c // block_m))
    max_tiles = -(-len(flat) // block_m) + min(num_experts, len(flat))
    tile_expert += [-1] * (max_tiles - len(tile_expert))
    return [p // k for p in order], inv, offs, tile_expert, tile_first


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (1, 1, 1, 16), (3, 2, 5, 16), (37, 6, 62, 16), (200, 6, 62, 32), (90, 2, 256, 64), (700, 6, 8, 128)])
@pytest.mark.parametrize("one_program", [True, False])
def test_route_sorts_pairs_stably_and_tiles_them(num_tokens, top_k, num_experts, block_m, one_program, monkeypatch):
    """Both routing paths (the one-program `_route_kernel`; count, scan and place over blocks of
    pairs beyond ROUTE_KERNEL_MAX_PAIRS) against a plain-Python counting sort: skewed loads,
    experts with no pair, more pairs than one block (700 x 6), more blocks than one step of the
    scan (90 x 2 over 256 experts: blocks of 16 pairs, 8 blocks a step)."""
    from mambaserve.ops import moe

    monkeypatch.setattr(moe, "ROUTE_KERNEL_MAX_PAIRS", 10**9 if one_program else 0)
    popularity = torch.rand(num_experts) ** 4 + 1e-3
    popularity[torch.randperm(num_experts)[: num_experts // 3]] = 0.0
    if not popularity.count_nonzero() >= top_k:
        popularity[:top_k] = 1.0
    ids = torch.multinomial(popularity.expand(num_tokens, -1), top_k, replacement=False).to(torch.int32).to(DEVICE)
    with ops.backend("triton"):
        r = moe._route(ids, num_experts, block_m)
    token_of, inv, offs, tile_expert, tile_first = _route_reference(ids.cpu(), num_experts, block_m)
    assert r.token_of.tolist() == token_of and r.inv.tolist() == inv and r.offs.tolist() == offs
    assert r.tile_expert.tolist() == tile_expert and r.tile_first.tolist() == tile_first
    assert r.max_tiles == len(tile_expert) and r.block_m == block_m


@pytest.mark.parametrize("one_program", [True, False])
def test_route_sorts_ids_out_of_range_past_every_expert(one_program, monkeypatch):
    """A padding row's routing may hold any id: both routing paths give such pairs rows past
    every expert's (no tile reads them), so no real pair loses its row."""
    from mambaserve.ops import moe

    monkeypatch.setattr(moe, "ROUTE_KERNEL_MAX_PAIRS", 10**9 if one_program else 0)
    E, block_m = 8, 16
    ids = torch.randint(0, E, (300, 3), dtype=torch.int32)  # 900 pairs: 8 blocks of 128
    ids[5] = torch.tensor([-1, E, 2], dtype=torch.int32)
    ids[17, 1] = 1000
    ids[250, 2] = -7  # in another block
    with ops.backend("triton"):
        r = moe._route(ids.to(DEVICE), E, block_m)
    flat = ids.reshape(-1).tolist()
    bucket = [e if 0 <= e < E else E for e in flat]
    order = sorted(range(len(flat)), key=lambda p: (bucket[p], p))
    assert r.token_of.tolist() == [p // 3 for p in order]
    assert r.inv.tolist() == [order.index(p) for p in range(len(flat))]
    counts = [bucket.count(e) for e in range(E)]
    assert r.offs.tolist() == [sum(counts[:e]) for e in range(E + 1)]
    tiles = [t for e in range(E) for t in [e] * -(-counts[e] // block_m)]
    assert r.tile_expert.tolist()[: len(tiles)] == tiles and set(r.tile_expert.tolist()[len(tiles):]) <= {-1}


def test_fused_moe_other_tokens_unaffected_by_an_id_out_of_range():
    """The token whose routing is out of range gets no defined output; every other token's is
    what it would be without that token in the batch."""
    x, w1, w2, tw, ti = _make(12, 32, 24, 6, 2, torch.float32, DEVICE, empty_experts=1)
    ti = ti.to(torch.int32)
    bad = ti.clone()
    bad[11] = torch.tensor([-1, 6], dtype=torch.int32)  # the last pairs: in the interpreter their stores land last
    keep = list(range(11))
    with ops.backend("triton"):
        got = ops.fused_moe(x, w1, w2, tw, bad, impl="triton")
    want = _ref(x[keep], w1, w2, tw[keep], ti[keep])
    assert rel_err(got[keep], want.to(got.dtype)) < tolerance(torch.float32)
