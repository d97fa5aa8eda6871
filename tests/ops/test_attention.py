"""Triton paged attention and reshape_and_cache against the PyTorch reference.

CPU runs go through Triton's interpreter (kept small); the GPU cases skip without CUDA.
Every batch mixes decodes and prefill chunks, prefixes of 0, 1, block_size - 1, block_size
and several blocks, with permuted block tables and random (never zero) cache contents.
"""

import math

import numpy as np
import pytest
import torch

from mambaserve import ops
from mambaserve.ops import reference
from mambaserve.ops.attention import plan_paged_attention, variant_batches
from mambaserve.ops.varlen import check_offsets
from tests.conftest import HAS_CUDA, nan_empty, rel_err, tolerance

# Triton runs on CUDA tensors when there is a GPU, else on CPU tensors through the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def paged_attention_triton(*args, **kwargs):
    """`ops.paged_attention` on its Triton path (the interpreter on CPU tensors)."""
    with ops.backend("triton"):
        return ops.paged_attention(*args, **kwargs)


def reshape_and_cache_triton(*args):
    with ops.backend("triton"):
        return ops.reshape_and_cache(*args)


def _mixed_specs(block_size):
    """(new tokens, cached prefix) per sequence: decodes and prefill chunks, awkward prefixes."""
    bs = block_size
    return [(1, 0), (5, 1), (1, bs - 1), (9, bs), (1, 3 * bs + 5), (bs + 3, 2 * bs - 1),
            (1, int(torch.randint(1, 4 * bs, ()))), (int(torch.randint(2, 2 * bs, ())), 0)]


def _make_batch(specs, block_size, num_kv_heads, G, head_dim, dtype, device, spare_blocks=7):
    """Random q, a cache whose used blocks are scattered by a permuted block table, and the
    step's batch tensors. The new tokens' K/V are already in the cache (the caller's order)."""
    q_lens = [n for n, _ in specs]
    seq_lens = [n + p for n, p in specs]
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # a spare column, unused
    num_blocks = len(specs) * max_blocks + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device=device)[: len(specs) * max_blocks]
    block_table = block_table.reshape(len(specs), max_blocks).to(torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), G * num_kv_heads, head_dim, device=device).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_table, sl, qsl


def _ref(q, k_cache, v_cache, block_table, sl, qsl, scale):
    up = torch.float64 if q.device.type == "cpu" else torch.float32
    return reference.paged_attention(q.to(up), k_cache.to(up), v_cache.to(up), block_table, sl, qsl, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.slow
def test_paged_attention_mixed_batch(dtype, G, block_size):
    specs = _mixed_specs(block_size)
    q, kc, vc, bt, sl, qsl = _make_batch(specs, block_size, 2, G, 32, dtype, DEVICE)
    scale = 0.7 / math.sqrt(32)
    with ops.backend("triton"):
        out = ops.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, scale)) < tolerance(dtype)


@pytest.mark.parametrize("block_size", [1, 4])
def test_paged_attention_small_blocks(block_size):
    """Pages smaller than a key tile (the parity harness uses 4): keys are gathered one by one."""
    specs = _mixed_specs(max(block_size, 2))
    q, kc, vc, bt, sl, qsl = _make_batch(specs, block_size, 2, 2, 32, torch.bfloat16, DEVICE)
    out = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.3, num_splits=2)
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, 0.3)) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_paged_attention_splits_and_nan_poisoned_out(num_splits):
    """Every split count gives the same function; every output element is written."""
    specs = _mixed_specs(8)
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 8, 2, 3, 16, torch.float32, DEVICE)
    out = nan_empty(*q.shape, device=DEVICE)
    paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.25, None, num_splits=num_splits, out=out)
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, 0.25)) < tolerance(torch.float32)


@pytest.mark.parametrize("head_dim", [24, 64])
def test_paged_attention_head_dims(head_dim):
    """A non-power-of-two head_dim is masked; 64 is a common size. Odd GQA ratio (3)."""
    specs = [(1, 17), (12, 5), (1, 0)]
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 8, 1, 3, head_dim, torch.float32, DEVICE)
    out = nan_empty(*q.shape, device=DEVICE)
    paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.1, None, out=out)
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, 0.1)) < tolerance(torch.float32)


def _plan(q, kc, bt, sl, qsl, **kw):
    """The step's plan from host copies of the batch bounds, as the forward context builds it."""
    return plan_paged_attention(check_offsets(qsl.tolist()), sl.cpu().numpy(), group_size=q.shape[1] // kc.shape[2],
                                num_kv_heads=kc.shape[2], block_size=kc.shape[1], table_width=bt.shape[1],
                                device=q.device, **kw)


@pytest.mark.slow
def test_paged_attention_takes_the_step_plan():
    """One plan from host copies serves every layer of a step; it gives what a plan built from
    a device read gives; a plan of another batch or head grouping is refused."""
    specs = _mixed_specs(16)
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 16, 2, 2, 32, torch.float32, DEVICE)
    plan = _plan(q, kc, bt, sl, qsl)
    with ops.backend("triton"):
        a = ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.2, plan)
        # a second "layer" of the same step: other q and cache contents, the same plan
        q2, kc2, vc2 = torch.randn_like(q), torch.randn_like(kc), torch.randn_like(vc)
        b = ops.paged_attention(q2, kc2, vc2, bt, sl, qsl, 0.2, plan)
        c = ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.2)  # no plan: built from a device read
    assert rel_err(a, _ref(q, kc, vc, bt, sl, qsl, 0.2)) < tolerance(torch.float32)
    assert rel_err(b, _ref(q2, kc2, vc2, bt, sl, qsl, 0.2)) < tolerance(torch.float32)
    assert torch.equal(a, c)
    fewer = _plan(q, kc, bt[:-1], sl[:-1], qsl[:-1])
    with ops.backend("triton"), pytest.raises(ValueError, match="plan is for"):
        ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.2, fewer)
    with ops.backend("triton"), pytest.raises(ValueError, match="plan is for"):  # G = 1, not 2
        ops.paged_attention(q[:, :2], kc, vc, bt, sl, qsl, 0.2, plan)


def test_paged_attention_empty_sequences_and_padding_rows():
    """Sequences with no new tokens are skipped; rows past query_start_loc[-1] stay untouched."""
    specs = [(3, 4), (0, 9), (1, 8)]
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 8, 1, 2, 16, torch.float32, DEVICE)
    q_pad = torch.cat([q, torch.randn(2, *q.shape[1:], device=DEVICE)])  # two padding tokens
    out = nan_empty(*q_pad.shape, device=DEVICE)
    paged_attention_triton(q_pad, kc, vc, bt, sl, qsl, 0.3, None, out=out)
    assert rel_err(out[: q.shape[0]], _ref(q, kc, vc, bt, sl, qsl, 0.3)) < tolerance(torch.float32)
    assert torch.isnan(out[q.shape[0]:]).all()


def test_paged_attention_rejects_bad_input():
    q, kc, vc, bt, sl, qsl = _make_batch([(2, 3)], 8, 1, 1, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        kc0 = torch.randn(4, 0, 1, 16, device=DEVICE)
        paged_attention_triton(q, kc0, kc0, bt, sl, qsl, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):  # fewer context tokens than new tokens
        paged_attention_triton(q, kc, vc, bt, torch.tensor([1], dtype=torch.int32, device=DEVICE), qsl, 1.0)
    with pytest.raises(ValueError, match="device"):
        paged_attention_triton(q, kc, vc, bt, sl.to("meta"), qsl, 1.0)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_triton(q, kc, vc, bt[:, :0], sl, qsl, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_reshape_and_cache_skips_padding_slots(dtype):
    num_blocks, block_size, kvh, D = 6, 8, 2, 24
    qkv = torch.randn(11, (2 + 2 * kvh) * D, device=DEVICE).to(dtype)
    # k, v as column slices of a fused projection: token stride != kvh * D
    k = qkv[:, 2 * D : (2 + kvh) * D].view(11, kvh, D)
    v = qkv[:, (2 + kvh) * D :].view(11, kvh, D)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:11]
    slots[[0, 4, 10]] = -1
    k_cache = torch.randn(num_blocks, block_size, kvh, D, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(k, v, k_ref, v_ref, slots)
    with ops.backend("triton"):
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reshape_then_attend_matches_reference_end_to_end():
    """One attention layer's step: write this step's K/V, then attend (prefix already cached)."""
    specs = [(6, 0), (1, 13), (4, 8)]
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 8, 2, 2, 16, torch.float32, DEVICE)
    new_k = torch.randn(q.shape[0], 2, 16, device=DEVICE)
    new_v = torch.randn(q.shape[0], 2, 16, device=DEVICE)
    slots = []
    for i, (n, p) in enumerate(specs):
        slots += [int(bt[i, pos // 8]) * 8 + pos % 8 for pos in range(p, p + n)]
    slots = torch.tensor(slots, device=DEVICE)
    kr, vr = kc.clone(), vc.clone()
    reference.reshape_and_cache(new_k, new_v, kr, vr, slots)
    reshape_and_cache_triton(new_k, new_v, kc, vc, slots)
    out = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.4)
    assert rel_err(out, _ref(q, kr, vr, bt, sl, qsl, 0.4)) < tolerance(torch.float32)


# ---- GPU only: model-sized shapes ---------------------------------------------------------


@gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_attention_granite_shapes_gpu(block_size):
    """granite-4.0-tiny-preview: 12 heads, 4 kv heads, head_dim 128, bf16; a long prefill
    chunk over a cached prefix mixed with decodes at a few thousand tokens of context."""
    specs = [(1, 4095), (1000, 700), (1, 1), (1, 2047), (300, 0)] + [(1, int(torch.randint(1, 3000, ())))] * 4
    q, kc, vc, bt, sl, qsl = _make_batch(specs, block_size, 4, 3, 128, torch.bfloat16, "cuda")
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.0078125, out=out)
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, 0.0078125)) < tolerance(torch.bfloat16)


@gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_paged_attention_decode_split_gpu(batch):
    """Decode-only batches at context 4096: the flash-decoding split path."""
    specs = [(1, 4095)] * batch
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 16, 4, 3, 128, torch.bfloat16, "cuda")
    plan = _plan(q, kc, bt, sl, qsl)
    assert plan.num_splits > 1
    out = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.0078125, plan)
    assert rel_err(out, _ref(q, kc, vc, bt, sl, qsl, 0.0078125)) < tolerance(torch.bfloat16)


@gpu
def test_paged_attention_float32_gpu_is_not_tf32():
    specs = _mixed_specs(16) + [(200, 300)]
    q, kc, vc, bt, sl, qsl = _make_batch(specs, 16, 2, 4, 64, torch.float32, "cuda")
    out = paged_attention_triton(q, kc, vc, bt, sl, qsl, 0.125)
    ref = reference.paged_attention(q.double(), kc.double(), vc.double(), bt, sl, qsl, 0.125)
    assert rel_err(out, ref) < tolerance(torch.float32)


def _variant(q, seq_len, G, kv_heads):
    """(BLOCK_R, SPLIT) of the plan of one sequence of q new tokens at context seq_len."""
    plan = plan_paged_attention(check_offsets([0, q]), np.array([seq_len]), group_size=G, num_kv_heads=kv_heads,
                                block_size=16, table_width=-(-seq_len // 16), device="cpu")
    return plan.block_r, plan.num_splits > 1


@pytest.mark.parametrize("G", [1, 2, 3, 4, 6, 8, 16, 48, 200])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_variant_batches_reach_every_kernel_variant(G, kv_heads):
    """The warm-up batches reach every (BLOCK_R, SPLIT) a batch within the limits can: found by
    brute force over one-sequence batches (a batch of several has the same tile height as its
    longest member alone and more programs, so no variant of its own)."""
    max_q, max_len = 150, 700
    reachable = {_variant(q, n, G, kv_heads) for q in range(1, max_q + 1) for n in range(q, max_len + 1, 11)}
    batches = variant_batches(G, max_q, max_len)
    assert all(1 <= q <= max_q and q <= n <= max_len for q, n in batches)
    assert {_variant(q, n, G, kv_heads) for q, n in batches} == reachable
    assert len(batches) == len(set(batches))
    short = variant_batches(G, 3, 100)  # short limits: fewer variants, never past them
    assert {_variant(q, n, G, kv_heads) for q, n in short} == {
        _variant(q, n, G, kv_heads) for q in range(1, 4) for n in range(q, 101)}
