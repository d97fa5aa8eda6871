"""Paged attention: ops `reshape_and_cache` (write K/V into the paged cache) and
`paged_attention` (attend over it), their Triton kernels, launchers and the work-list plan.

`reshape_and_cache` copies this step's keys and values into their cache slots.
`paged_attention` runs one kernel over a packed batch that mixes prefill chunks (causal over
the cached prefix plus the new tokens) and decodes, reading K/V through block tables.

How the work is split (FlashAttention-2, Dao 2023, for the tiling and the online softmax;
flash-decoding for the split over the context):
- A program owns one work item (a sequence and a block of its new tokens) and one kv head. Its
  tile rows are (token, query head) pairs: the G = num_heads / num_kv_heads query heads that
  share the kv head are stacked, so each K/V tile is loaded once for all of them, and a decode
  token (one token, G rows) still fills a 16-row matrix product.
- When items x kv heads would not fill the GPU (small decode batches), every item's context is
  cut into num_splits ranges, each program writes an unnormalised partial result with its
  running max and sum, and a second small kernel combines them.
- The list of work items (`AttentionPlan`) is built on the host from the step's host copies
  of query_start_loc and seq_lens by `plan_paged_attention`, once per step (the forward
  context does it) and passed by every attention layer of the step. Items are ordered
  longest context first so that the causal tail of a long prefill does not run alone at the
  end.

An FP8 KV cache (float8_e4m3fn caches, vLLM's kv_cache_dtype="fp8") holds k / k_scale and
v / v_scale with one float32 scale per tensor (host floats: constant once loaded, so they
are kernel arguments and CUDA graphs may keep them): `reshape_and_cache` divides, clamps to
+-448 and rounds; `paged_attention` widens each K/V tile to q's dtype (exact), folds k_scale
into the softmax scale and multiplies the output by v_scale.

This module knows nothing about models or the engine; the math is `reference.paged_attention`
and `reference.reshape_and_cache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.ops import reference
from mambaserve.ops.common import check, next_power_of_2, to_device
from mambaserve.ops.dispatch import tl, triton, use_triton
from mambaserve.ops.varlen import check_offsets

# Below this many programs in the main grid, the context is split (flash-decoding).
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: small, so that small test batches exercise the split path


# --------------------------------------------------------------------------------------------
# reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, k_scale, v_scale,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: the cache stays bit-identical
        return
    page = slot // PAGE
    in_page = slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src_k = t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = page * stride_kcb + in_page * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = page * stride_vcb + in_page * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(k_cache_ptr + dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write this step's keys and values into the paged KV cache by slot (the attention layers
    of every hybrid family); slot -1 (padding) is skipped, leaving the cache bit-identical.
    float8_e4m3fn caches store k / k_scale and v / v_scale clamped to +-448 (module docstring);
    other caches ignore the scales.

    k, v: (num_tokens, num_kv_heads, head_dim), any float dtype (a slice of a fused qkv
    projection is fine); k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim),
    written in place (cast to the cache dtype), head_dim stride 1 on the Triton path;
    slot_mapping: (num_tokens,) int32/int64, slot = block * block_size + offset.
    Math: `reference.reshape_and_cache`. Raises ValueError on bad shapes or strides.
    """
    check(k.dim() == 3 and v.shape == k.shape,
          lambda: f"k and v must be (num_tokens, num_kv_heads, head_dim), got {tuple(k.shape)}, {tuple(v.shape)}")
    check(k_cache.dim() == 4 and k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape,
          lambda: f"caches must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}), got {tuple(k_cache.shape)}")
    check(slot_mapping.shape == (k.shape[0],),
          lambda: f"slot_mapping must be ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
    check(k_scale > 0 and v_scale > 0, lambda: f"k_scale and v_scale must be > 0, got {k_scale}, {v_scale}")
    if not use_triton(k):
        if k_cache.dtype == torch.float8_e4m3fn:  # the reference then only rounds and stores
            k = (k.float() / k_scale).clamp(-448.0, 448.0)
            v = (v.float() / v_scale).clamp(-448.0, 448.0)
        return reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    check(k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "k_cache and v_cache must have stride 1 along head_dim")
    if k.shape[0] == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(k_scale), float(v_scale),
        PAGE=k_cache.shape[1],
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


# --------------------------------------------------------------------------------------------
# paged attention


@triton.jit
def _attend_kv_tile(
    q, acc, m_i, l_i, q_pos, start, hi,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, k_head_off, v_head_off,
    stride_kb, stride_ks, stride_vb, stride_vs,
    offs_d, d_mask, qk_scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, P_DTYPE: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N (scores in log2 units). K/V
    tiles are widened to q's dtype (FP8 caches: exact; a no-op otherwise)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    if MASKED:
        page = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE).to(tl.int64)
    in_page = offs_n % PAGE
    k_ptrs = k_cache_ptr + (page * stride_kb + in_page * stride_ks + k_head_off)[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + (page * stride_vb + in_page * stride_vs + v_head_off)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
    k = k.to(q.dtype)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (BLOCK_R, BLOCK_N) fp32
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    v = v.to(q.dtype)
    p = p.to(P_DTYPE)  # q's own dtype, as the GPU's matrix product takes it
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p, v, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


# num_splits, the split buffers' strides over splits (num_tokens x heads) and the block table's
# width (stride_bt) change every step: specialized (a constexpr, or Triton's divisibility by 16 of
# an int) each value class would compile a kernel in the middle of serving (1.1-1.3 s on an H200).
@triton.jit(do_not_specialize=["num_splits", "stride_pa_s", "stride_pm_s", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, work_ptr,
    qk_scale, head_dim, num_splits, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    stride_pa_s, stride_pa_t, stride_pa_h, stride_pm_s, stride_pm_t,
    G: tl.constexpr, TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work_ptr + 2 * item)
    t0 = tl.load(work_ptr + 2 * item + 1)  # first new token of the block, within the sequence
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # Rows are (token, head) pairs: row r is token t0 + r // G, query head kv_head * G + r % G.
    offs_r = tl.arange(0, BLOCK_R)
    tok = t0 + offs_r // G
    head = kv_head * G + offs_r % G
    row_valid = (offs_r < TOKENS * G) & (tok < q_len)
    q_pos = prefix + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    n_tok = tl.minimum(q_len - t0, TOKENS)
    kv_end = prefix + t0 + n_tok  # keys seen by the block's last query
    kv_all = prefix + t0 + 1  # keys seen by every query of the block: no causal mask needed
    if not SPLIT:
        lo = 0
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    mid = tl.maximum(tl.minimum((kv_all // BLOCK_N) * BLOCK_N, hi), lo)

    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head_off = kv_head.to(tl.int64) * stride_kh
    v_head_off = kv_head.to(tl.int64) * stride_vh
    # A finite start keeps exp2(m_old - m_new) defined for rows that see no key in a tile.
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, q_pos, start, hi, k_cache_ptr, v_cache_ptr, bt_row_ptr,
            k_head_off, v_head_off, stride_kb, stride_ks, stride_vb, stride_vs,
            offs_d, d_mask, qk_scale, PAGE, BLOCK_N, False, EVEN_D, DOT_PREC, DOT_F32, q_ptr.dtype.element_ty)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, q_pos, start, hi, k_cache_ptr, v_cache_ptr, bt_row_ptr,
            k_head_off, v_head_off, stride_kb, stride_ks, stride_vb, stride_vs,
            offs_d, d_mask, qk_scale, PAGE, BLOCK_N, True, EVEN_D, DOT_PREC, DOT_F32, q_ptr.dtype.element_ty)

    tok64 = (q_start + tok).to(tl.int64)
    mask = row_valid[:, None] & d_mask[None, :]
    acc = acc * v_scale
    if not SPLIT:
        out = acc / l_i[:, None]
        o_rows = tok64 * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        split64 = split.to(tl.int64)
        pa_rows = split64 * stride_pa_s + tok64 * stride_pa_t + head * stride_pa_h
        tl.store(part_acc_ptr + pa_rows[:, None] + offs_d[None, :], acc, mask=mask)
        pm_rows = split64 * stride_pm_s + tok64 * stride_pm_t + head
        tl.store(part_m_ptr + pm_rows, m_i, mask=row_valid)
        tl.store(part_l_ptr + pm_rows, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits", "stride_pa_s", "stride_pm_s"])  # per-step values, as above
def _combine_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, head_dim, num_splits,
    stride_pa_s, stride_pa_t, stride_pa_h, stride_pm_s, stride_pm_t, stride_ot, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    pm = offs_s * stride_pm_s + t * stride_pm_t + h
    m = tl.load(part_m_ptr + pm, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + pm, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l, 0)
    pa = offs_s[:, None] * stride_pa_s + t * stride_pa_t + h * stride_pa_h + offs_d[None, :]
    acc = tl.load(part_acc_ptr + pa, mask=s_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def _launch_config(block_r: int, block_d: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the main kernel for a tile of block_r rows."""
    if not on_gpu:
        return 16, 4, 1  # interpreter: more loop trips on small test contexts
    block_n = 64 if block_d <= 128 else 32
    return block_n, 8 if block_r >= 128 else 4, 3


@dataclass(frozen=True)
class AttentionPlan:
    """The work list of one step's paged attention, shared by every attention layer of that
    step with the same head grouping and cache layout.

    work: (num_items, 2) int32 on the device, rows (sequence, first new token of the block),
    longest context first; block_r: tile rows; tokens: new tokens per block (block_r //
    group_size); num_splits: context ranges per item (1 = no split); num_tokens:
    query_start_loc[-1]; max_q_len: the longest query. batch, group_size, num_kv_heads,
    block_size, max_blocks (the block-table columns the longest context needs): what the plan
    was built for, checked by the launcher.
    """

    work: torch.Tensor
    block_r: int
    tokens: int
    num_splits: int
    num_tokens: int
    max_q_len: int
    batch: int
    group_size: int
    num_kv_heads: int
    block_size: int
    max_blocks: int


def _block_r(max_q: int, group_size: int) -> int:
    """Rows per tile: enough for the longest query block, at least 16 (matrix-unit minimum)
    and G (one token), at most 128 (register budget of the fp32 accumulator)."""
    return max(min(max(next_power_of_2(max_q * group_size), 16), 128), next_power_of_2(group_size))


def variant_batches(group_size: int, max_query_len: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) of one-sequence batches whose plans reach every kernel variant
    (BLOCK_R, SPLIT) that `plan_paged_attention` can choose for batches of at most
    max_query_len new tokens a sequence and max_seq_len context. Each variant is a separate
    Triton compile (about 1 s on an H200); attention runs outside the piecewise CUDA graphs,
    so a variant first met by a request (a few tokens resumed after a long cached prefix:
    short tiles, split context) compiled in the middle of that request. The engine runs these
    batches once at start-up instead."""
    out, seen = [], set()
    for q in range(1, max(1, max_query_len) + 1):
        block_r = _block_r(q, group_size)
        if block_r in seen:
            continue
        seen.add(block_r)
        out.append((q, q))  # no prefix: the context fits one split
        long = min(max_seq_len, q + 2 * _MIN_TOKENS_PER_SPLIT)
        if long > q:
            out.append((q, long))  # one tile of new tokens after a long prefix: the context is split
        if block_r == max(128, next_power_of_2(group_size)):  # the widest tile: no more variants
            break
    return out


def plan_paged_attention(query_start_loc_host: np.ndarray, seq_lens_host: np.ndarray, *, group_size: int,
                         num_kv_heads: int, block_size: int, table_width: int, device,
                         num_splits: int | None = None) -> AttentionPlan:
    """The work list of `paged_attention` for a batch, from host arrays.

    query_start_loc_host: checked offsets (batch + 1,) int64 (`varlen.check_offsets`);
    seq_lens_host: (batch,) int, context length of each sequence after this step; group_size:
    query heads per kv head; table_width: the block table's columns; device: where the work
    list goes (one copy). num_splits forces the number of context splits (tests, benchmarks);
    None chooses from the batch: when items x kv heads would not fill the GPU, each item's
    context is split. Raises ValueError when a sequence's seq_len is shorter than its new
    tokens or needs more blocks than table_width.
    """
    qsl, lens = query_start_loc_host.tolist(), np.asarray(seq_lens_host).tolist()  # lists: fast loops
    batch = len(lens)
    if len(qsl) != batch + 1:
        raise ValueError(f"{len(qsl)} offsets for {batch} sequence lengths")
    if num_splits is not None and not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in [1, 256], got {num_splits}")
    q_lens = [qsl[i + 1] - qsl[i] for i in range(batch)]
    if any(n > s for n, s in zip(q_lens, lens)):
        raise ValueError("seq_lens must be at least each sequence's number of new tokens")
    max_blocks = max([-(-s // block_size) for n, s in zip(q_lens, lens) if n > 0], default=0)
    if max_blocks > table_width:
        raise ValueError(f"block_table has {table_width} columns, a sequence needs {max_blocks}")
    G = group_size
    max_q = max(q_lens, default=0)
    block_r = _block_r(max_q, G)
    tokens = block_r // G
    items = []
    for i, n in enumerate(q_lens):
        prefix = lens[i] - n
        for t0 in range(0, n, tokens):
            items.append((prefix + min(t0 + tokens, n), i, t0))
    items.sort(key=lambda it: -it[0])
    if num_splits is None:
        programs = len(items) * num_kv_heads
        n_sm = _num_sms(torch.device(device))
        num_splits = 1
        if 0 < programs < n_sm:
            max_kv = items[0][0]
            num_splits = max(1, min(-(-2 * n_sm // programs), -(-max_kv // _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS))
    flat = [x for _, i, t0 in items for x in (i, t0)]
    work = to_device(torch.tensor(flat, dtype=torch.int32).reshape(-1, 2), device)
    return AttentionPlan(work, block_r, tokens, int(num_splits), qsl[-1], max_q, batch, G, num_kv_heads,
                         block_size, max_blocks)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a packed prefill/decode batch over the paged KV cache, one kernel
    (the attention layers of every hybrid family; GQA: query head h reads kv head
    h // (num_heads // num_kv_heads)).

    q: (num_tokens, num_heads, head_dim); k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim) already holding this step's keys, any block_size >= 1 (keys are
    gathered one by one); block_table: (batch, max_blocks_per_seq) int32; seq_lens: (batch,)
    int32, context length after this step (cached prefix + new tokens); query_start_loc:
    (batch + 1,) int32; scale: the softmax scale (the model's, e.g. Granite's
    attention_multiplier). All on q's device.
    plan: the step's work list (`ForwardContext.attention_plan`, or `plan_paged_attention`),
    used by the kernel; None builds it from a device read of query_start_loc and seq_lens (one
    host sync, never inside a CUDA-graph capture). num_splits: force the number of context
    splits when the plan is built here (tests); None chooses from the batch. The reference
    needs no plan. out: optional preallocated (num_tokens, num_heads, head_dim) result in
    q.dtype, head_dim stride 1. k_scale, v_scale: the per-tensor scales of float8_e4m3fn caches
    (keys are k_cache * k_scale, values v_cache * v_scale; ignored for other caches).
    The Triton path takes q and caches of one float16/bfloat16/float32 dtype (or float8_e4m3fn
    caches), caches with head_dim stride 1. Returns (num_tokens, num_heads, head_dim) in q.dtype; rows past
    query_start_loc[-1] are left unwritten.
    Math: softmax(scale * q k^T) v with the causal mask, in float32 (Attention Is All You Need,
    section 3.2.1), online softmax as in FlashAttention-2; `reference.paged_attention`.
    Raises ValueError on bad shapes, devices, dtypes or strides, on query_start_loc that starts
    below 0, decreases or ends past q's rows, on seq_lens shorter than a sequence's new tokens
    or longer than its block table row covers, and on a plan of another batch or layout.
    """
    check(q.dim() == 3, lambda: f"q must be (num_tokens, num_heads, head_dim), got {tuple(q.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == q.shape[2],
          lambda: f"caches must be (num_blocks, block_size, num_kv_heads, {q.shape[2]}), got {tuple(k_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check(num_heads % num_kv_heads == 0,
          lambda: f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check(block_size >= 1, lambda: f"block_size must be >= 1, got {block_size}")
    check(query_start_loc.dim() == 1 and query_start_loc.numel() >= 1,
          lambda: f"query_start_loc must be (batch + 1,), got {tuple(query_start_loc.shape)}")
    batch = query_start_loc.numel() - 1
    check(seq_lens.shape == (batch,) and block_table.dim() == 2 and block_table.shape[0] == batch,
          lambda: f"seq_lens must be ({batch},) and block_table ({batch}, max_blocks)")
    check(all(t.device == q.device for t in (k_cache, v_cache, block_table, seq_lens, query_start_loc)),
          lambda: f"all tensors must be on q's device {q.device}")
    check(num_splits is None or 1 <= num_splits <= 256, lambda: f"num_splits must be in [1, 256], got {num_splits}")
    check(out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
                          and out.device == q.device),
          lambda: f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with stride 1 along head_dim")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    check(fp8 == (v_cache.dtype == torch.float8_e4m3fn), "k_cache and v_cache must both be FP8 or neither")
    if not fp8:
        k_scale = v_scale = 1.0
    if not use_triton(q):
        result = reference.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                                           k_scale, v_scale)
        if out is None:
            return result
        n = int(query_start_loc[-1])  # rows past it stay unwritten, as on the kernel path
        out[:n].copy_(result[:n])
        return out
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32) and (fp8 or (k_cache.dtype == q.dtype
                                                                          and v_cache.dtype == q.dtype)),
          lambda: f"q and caches must share a float16/bfloat16/float32 dtype, got {q.dtype}, {k_cache.dtype}, "
                  f"{v_cache.dtype}")
    check(k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "k_cache and v_cache must have stride 1 along head_dim")
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    G = num_heads // num_kv_heads
    if plan is None:
        host = torch.cat([query_start_loc.reshape(-1).to(torch.int64), seq_lens.to(torch.int64)]).tolist()  # host sync
        plan = plan_paged_attention(check_offsets(host[: batch + 1]), np.asarray(host[batch + 1:], dtype=np.int64),
                                    group_size=G, num_kv_heads=num_kv_heads, block_size=block_size,
                                    table_width=block_table.shape[1], device=q.device, num_splits=num_splits)
    else:
        check(num_splits is None, "num_splits is set when the plan is built (plan_paged_attention), not with a plan")
    check((plan.batch, plan.group_size, plan.num_kv_heads, plan.block_size) == (batch, G, num_kv_heads, block_size),
          lambda: f"the plan is for {plan.batch} sequences, {plan.group_size} query heads per kv head, "
                  f"{plan.num_kv_heads} kv heads, pages of {plan.block_size}; the call has {batch}, {G}, "
                  f"{num_kv_heads}, {block_size}")
    check(plan.max_blocks <= block_table.shape[1],
          lambda: f"block_table has {block_table.shape[1]} columns, a sequence needs {plan.max_blocks}")
    check(plan.num_tokens <= num_tokens,
          lambda: f"query_start_loc ends at {plan.num_tokens}, past the {num_tokens} rows of q")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_items = plan.work.shape[0]
    if num_items == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    on_gpu = q.is_cuda
    block_n, num_warps, num_stages = _launch_config(plan.block_r, block_d, on_gpu)
    splits = plan.num_splits
    if splits > 1:
        part_acc = torch.empty(splits, plan.num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(splits, plan.num_tokens, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    pa_strides = part_acc.stride()[:3] if splits > 1 else (0, 0, 0)
    pm_strides = part_m.stride()[:2] if splits > 1 else (0, 0)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # Triton's interpreter multiplies bfloat16 tiles as raw uint16 (triton 3.9): on the CPU the
    # dot operands are widened to float32 after the same roundings as on the GPU.
    _paged_attention_kernel[(num_items, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        block_table, seq_lens, query_start_loc, plan.work,
        float(scale) * float(k_scale) * math.log2(math.e), head_dim, splits, float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0),
        *pa_strides, *pm_strides,
        G=G, TOKENS=plan.tokens, BLOCK_R=plan.block_r, BLOCK_N=block_n, BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        PAGE=block_size, SPLIT=splits > 1, DOT_PREC=dot_prec, DOT_F32=not on_gpu,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(plan.num_tokens, num_heads)](
            part_acc, part_m, part_l, out, head_dim, splits,
            *pa_strides, *pm_strides, out.stride(0), out.stride(1),
            BLOCK_S=64 if splits <= 64 else 256, BLOCK_D=block_d,
        )
    return out
