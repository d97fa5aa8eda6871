"""ForwardContext: host lists -> device metadata, and the prefill part of a mixed step."""

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
    assert part.metadata == {"query_start_loc_host": [0, 4, 7], "seq_lens_host": [12, 3]}
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
