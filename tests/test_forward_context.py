"""ForwardContext: host lists -> device tensors and checked host copies, the prefill part of a
mixed step, and the launch plans built once per step."""

import numpy as np
import pytest
import torch

from mambaserve.forward_context import ForwardContext


def _mixed():
    # two decodes (one token, with a state), then a prefill chunk with a state and a new prompt
    return ForwardContext.build(
        query_lens=[1, 1, 4, 3], seq_lens=[9, 5, 12, 3], state_indices=[7, 2, 5, 0],
        has_initial_state=[True, True, True, False], block_tables=[[1, 2, 3], [4, 5], [6, 7, 8], [9]],
        block_size=4, device="cpu", pad_to=12)


def test_build_counts_leading_decodes_and_pads_slot_mapping():
    ctx = _mixed()
    assert ctx.num_decodes == 2 and not ctx.decode_only and ctx.num_tokens == 9
    assert ctx.query_start_loc.tolist() == [0, 1, 2, 6, 9]
    # token at position p of sequence i goes to block_tables[i][p // 4] * 4 + p % 4; padding -1
    # (positions 8; 4; 8..11; 0..2)
    assert ctx.slot_mapping.tolist() == [3 * 4 + 0, 5 * 4 + 0, 8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3,
                                         9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2, -1, -1, -1]


def test_prefill_part_renumbers_rows_and_is_built_once():
    ctx = _mixed()
    part = ctx.prefill_part()
    assert part is ctx.prefill_part()  # shared by every layer of the step
    assert part.query_start_loc.tolist() == [0, 4, 7]
    assert part.state_indices.tolist() == [5, 0] and part.has_initial_state.tolist() == [True, False]
    assert part.seq_lens.tolist() == [12, 3] and part.block_table.shape[0] == 2
    assert part.slot_mapping.tolist() == ctx.slot_mapping.tolist()[2:]
    assert part.num_decodes == 0 and part.num_tokens == 7
    assert part.query_start_loc_host.tolist() == [0, 4, 7] and part.seq_lens_host.tolist() == [12, 3]
    assert part.mamba_caches is ctx.mamba_caches


def test_build_rejects_inconsistent_lists():
    with pytest.raises(ValueError, match="one entry per sequence"):
        ForwardContext.build(query_lens=[1, 2], seq_lens=[3], state_indices=[0, 1], has_initial_state=[True, False],
                             block_tables=None, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardContext.build(query_lens=[0], seq_lens=[3], state_indices=[0], has_initial_state=[True],
                             block_tables=None, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="block table"):
        ForwardContext.build(query_lens=[2], seq_lens=[9], state_indices=[0], has_initial_state=[True],
                             block_tables=[[1, 2]], block_size=4, device="cpu")
    assert torch.is_tensor(_mixed().has_initial_state)


def test_plans_are_built_once_from_the_host_copies():
    """Every layer of a step gets the same plan objects, equal to what the builders make from
    the host offsets; a plan of another chunk size or head grouping is a plan of its own."""
    from mambaserve.ops import conv1d, varlen
    from mambaserve.ops.attention import plan_paged_attention

    ctx = _mixed()
    part = ctx.prefill_part()
    assert part.conv_blocks() is part.conv_blocks() and part.ssd_chunks(4) is part.ssd_chunks(4)
    assert part.ssd_chunks(8) is not part.ssd_chunks(4)
    expected = varlen.ssd_chunks(np.array([0, 4, 7]), 4, "cpu")
    got = part.ssd_chunks(4)
    assert (got.num_chunks, got.batch, got.num_tokens) == (expected.num_chunks, 2, 7)
    assert got.chunk_start.tolist() == expected.chunk_start.tolist() == [0, 4]
    assert got.chunk_end.tolist() == [4, 7] and got.seq_chunk.tolist() == [0, 1, 2]
    blocks = ctx.conv_blocks()
    assert blocks.block_t == conv1d.varlen_block_t(conv1d.table_for("cpu"), 9)
    assert blocks.batch == 4 and blocks.num_tokens == 9
    plan = ctx.attention_plan(2, 1, 4)
    assert plan is ctx.attention_plan(2, 1, 4) and plan is not ctx.attention_plan(1, 2, 4)
    direct = plan_paged_attention(np.array([0, 1, 2, 6, 9]), np.array([9, 5, 12, 3]), group_size=2, num_kv_heads=1,
                                  block_size=4, table_width=3, device="cpu")
    assert torch.equal(plan.work, direct.work) and plan.num_splits == direct.num_splits


def test_host_copies_are_checked_on_creation():
    ctx = _mixed()
    fields = dict(query_start_loc=ctx.query_start_loc, seq_lens=ctx.seq_lens, state_indices=ctx.state_indices,
                  has_initial_state=ctx.has_initial_state, block_table=None, slot_mapping=None, num_decodes=2,
                  num_tokens=9, max_query_len=4, max_seq_len=12, seq_lens_host=np.array([9, 5, 12, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        ForwardContext(**fields, query_start_loc_host=np.array([0, 1, 2, 1, 9]))
    with pytest.raises(ValueError, match="non-negative"):
        ForwardContext(**fields, query_start_loc_host=np.array([-1, 1, 2, 6, 9]))
    with pytest.raises(ValueError, match="for a batch of 4"):
        ForwardContext(**fields, query_start_loc_host=np.array([0, 1, 2, 6]))
    with pytest.raises(ValueError, match="no block table"):
        ForwardContext(**fields, query_start_loc_host=np.array([0, 1, 2, 6, 9])).attention_plan(1, 1, 4)


def test_packed_metadata_views_are_16_byte_aligned():
    """Triton specializes pointers on 16-byte alignment: the step's packed views must not change
    alignment with the batch (each change compiled a kernel variant mid-serving)."""
    from mambaserve.ops.common import pack_to_device

    rng = np.random.default_rng(0)
    for n in range(1, 9):
        arrays = [rng.integers(-5, 100, size=int(k)) for k in rng.integers(0, 11, size=5)]
        for dtype in (torch.int32, torch.int64):
            views = pack_to_device(arrays, "cpu", dtype)
            base = views[0].untyped_storage().data_ptr()
            for a, v in zip(arrays, views):
                assert v.dtype == dtype and v.tolist() == a.tolist()
                assert (v.data_ptr() - base) % 16 == 0
        ctx = ForwardContext.build(query_lens=[1] * n + [3], seq_lens=[5] * n + [3], state_indices=list(range(n + 1)),
                                   has_initial_state=[True] * n + [False], block_tables=[[0]] * (n + 1), block_size=16,
                                   device="cpu")
        base = ctx.query_start_loc.untyped_storage().data_ptr()
        for t in (ctx.query_start_loc, ctx.seq_lens, ctx.state_indices, ctx.block_table):
            assert (t.data_ptr() - base) % 16 == 0


@pytest.mark.parametrize("nd", [1, 2, 3, 5])
def test_prefill_part_fields_are_aligned_copies_of_the_slices(nd):
    qlens = [1] * nd + [4, 7]
    ctx = ForwardContext.build(query_lens=qlens, seq_lens=[9] * nd + [4, 12], state_indices=list(range(10, 12 + nd)),
                               has_initial_state=[True] * nd + [False, True], block_tables=[[3, 4]] * (nd + 2),
                               block_size=8, device="cpu", pad_to=sum(qlens) + 3)
    part = ctx.prefill_part()
    base = ctx.query_start_loc.untyped_storage().data_ptr()
    assert part.query_start_loc.tolist() == (ctx.query_start_loc[nd:] - nd).tolist() == [0, 4, 11]
    for got, want in ((part.seq_lens, ctx.seq_lens[nd:]), (part.state_indices, ctx.state_indices[nd:]),
                      (part.has_initial_state, ctx.has_initial_state[nd:]), (part.block_table, ctx.block_table[nd:]),
                      (part.slot_mapping, ctx.slot_mapping[nd:])):
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    for t in (part.query_start_loc, part.seq_lens, part.state_indices, part.block_table):
        assert (t.data_ptr() - base) % 16 == 0
    assert part.slot_mapping.data_ptr() % 16 == 0
