"""Cache sizing without a model: every clamp and every error of `size_pools`, with numbers
worked out by hand from its rules (slots of 1,000 bytes, KV blocks of 100 bytes and 16 tokens
unless a case says otherwise)."""

import logging

import pytest

from mambaserve.cache.budget import PoolSizes, resolve_max_num_batched_tokens, size_pools

SLOT, BLOCK, BS = 1000, 100, 16
INFO, WARNING = logging.INFO, logging.WARNING


def sizes(budget, *, block_bytes=BLOCK, **kw) -> PoolSizes:
    args = dict(budget_bytes=budget, slot_bytes=SLOT, block_bytes=block_bytes, block_size=BS, model_max_len=None,
                max_num_batched_tokens=2048, default_max_num_seqs=256)
    return size_pools(**(args | kw))


def pools(s: PoolSizes) -> tuple[int, int, int, int, int]:
    return s.num_slots, s.num_blocks, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len


def test_step_budget_defaults_by_device():
    assert resolve_max_num_batched_tokens(None, on_gpu=True) == 8192
    assert resolve_max_num_batched_tokens(None, on_gpu=False) == 2048
    assert resolve_max_num_batched_tokens(100, on_gpu=True) == 100


def test_slots_and_blocks_share_the_budget():
    # one sequence needs 64 / 16 = 4 blocks; slots beside them: min(257, (10000 - 400) // 1000) = 9;
    # blocks in what 9 slots leave: (10000 - 9000) // 100 = 10; slots beside 10 blocks: 9000 // 1000 = 9
    s = sizes(10_000, max_model_len=64)
    assert pools(s) == (9, 10, 8, 2048, 64) and s.scratch_slot == 8
    # the default max_num_seqs (256) not met is only worth an info line
    assert s.notes == ((INFO, "max_num_seqs clamped from 256 to 8: only 9 state slots fit in the budget"),)


def test_blocks_capped_at_what_the_running_sequences_fill():
    # 3 sequences of at most 4 blocks each: 12 blocks, although (100000 - 4000) // 100 = 960 fit
    s = sizes(100_000, max_model_len=64, max_num_seqs=3)
    assert pools(s) == (4, 12, 3, 2048, 64) and s.notes == ()


def test_max_num_seqs_clamped_to_the_step_budget_before_sizing():
    # 100 sequences cannot all decode in a step of 16 tokens: sized as for 16 (17 slots, 16 * 4
    # blocks), the same pools as asking for 16, not slots nobody holds taking the blocks' bytes
    s = sizes(100_000, max_model_len=64, max_num_seqs=100, max_num_batched_tokens=16)
    assert pools(s) == (17, 64, 16, 16, 64)
    assert s.notes == ((WARNING, "max_num_seqs clamped from 100 to max_num_batched_tokens=16"),)
    asked = sizes(100_000, max_model_len=64, max_num_seqs=16, max_num_batched_tokens=16)
    assert pools(asked) == pools(s) and asked.notes == ()


def test_max_num_seqs_asked_for_and_not_met_warns():
    # no attention: 9500 // 1000 = 9 slots, one of them the scratch slot
    s = sizes(9_500, block_bytes=0, max_num_seqs=50)
    assert pools(s) == (9, 0, 8, 2048, 1 << 20)
    assert s.notes == ((WARNING, "max_num_seqs clamped from 50 to 8: only 9 state slots fit in the budget"),)


def test_model_limit_clamped_to_half_of_what_two_slots_leave():
    # 131072 tokens need 8192 blocks (819200 bytes); room: (10000 - 2000) // 2 = 4000 bytes = 40
    # blocks = 640 tokens; slots beside 40 blocks: (10000 - 4000) // 1000 = 6
    s = sizes(10_000, model_max_len=131072)
    assert pools(s) == (6, 40, 5, 2048, 640)
    assert s.notes == ((WARNING, "max_model_len clamped to 640 tokens to fit the cache budget"),
                       (INFO, "max_num_seqs clamped from 256 to 5: only 6 state slots fit in the budget"))


def test_model_limit_clamp_keeps_at_least_one_block():
    # room (2150 - 2000) // 2 = 75 bytes holds no block: one block of 16 tokens still fits the budget
    s = sizes(2_150, model_max_len=4096)
    assert pools(s) == (2, 1, 1, 2048, 16)


def test_length_asked_for_is_not_clamped():
    # 4096 tokens need 256 blocks; slots beside them: min(257, (1000000 - 25600) // 1000) = 257;
    # blocks in what they leave: (1000000 - 257000) // 100 = 7430 (under the cap of 256 * 256)
    s = sizes(1_000_000, model_max_len=131072, max_model_len=4096)
    assert pools(s) == (257, 7430, 256, 2048, 4096) and s.notes == ()


def test_forced_blocks_keep_the_model_limit():
    # with num_kv_blocks the model's limit is not clamped: 300 blocks hold no 131072-token sequence
    with pytest.raises(ValueError, match=r"^the KV cache holds 300 blocks of 16 tokens, fewer than one "
                                         r"max_model_len=131072 sequence needs \(8192\)"):
        sizes(1_000_000, model_max_len=131072, num_kv_blocks=300)
    # slots beside 300 blocks: min(257, (1000000 - 30000) // 1000) = 257
    assert pools(sizes(1_000_000, model_max_len=4096, num_kv_blocks=300)) == (257, 300, 256, 2048, 4096)


def test_model_without_limit_or_attention():
    s = sizes(5_000, block_bytes=0)
    assert pools(s) == (5, 0, 4, 2048, 1 << 20)


def test_forced_pool_sizes():
    s = sizes(0, block_bytes=0, num_state_slots=4)  # forced slots need no budget
    assert pools(s) == (4, 0, 3, 2048, 1 << 20)
    s = sizes(1_000_000, max_model_len=64, num_state_slots=3, num_kv_blocks=5)
    assert pools(s) == (3, 5, 2, 2048, 64)


@pytest.mark.parametrize("budget, on_gpu, shown, knob", [(1_999, False, 1999, "cpu_cache_bytes"),
                                                          (-5, True, 0, "gpu_memory_utilization")])
def test_fewer_than_two_slots(budget, on_gpu, shown, knob):
    message = (f"the cache budget of {shown} bytes holds fewer than two state slots of 1000 bytes "
               f"(one request's and the scratch slot); raise {knob}")
    for block_bytes in (0, BLOCK):
        with pytest.raises(ValueError) as e:
            sizes(budget, block_bytes=block_bytes, on_gpu=on_gpu)
        assert str(e.value) == message


@pytest.mark.parametrize("on_gpu, knob", [(False, "cpu_cache_bytes"), (True, "gpu_memory_utilization")])
def test_kv_blocks_short_of_one_sequence(on_gpu, knob):
    # 64 tokens need 4 blocks; two slots leave (2300 - 2000) // 100 = 3
    with pytest.raises(ValueError) as e:
        sizes(2_300, max_model_len=64, on_gpu=on_gpu)
    assert str(e.value) == ("the KV cache holds 3 blocks of 16 tokens, fewer than one max_model_len=64 sequence "
                            f"needs (4); lower max_model_len or max_num_seqs, or raise {knob}")
    with pytest.raises(ValueError, match=r"holds 3 blocks of 16 tokens, fewer than one max_model_len=64 "):
        sizes(1_000_000, max_model_len=64, num_kv_blocks=3, on_gpu=on_gpu)


def test_step_budget_below_max_model_len_without_chunked_prefill():
    with pytest.raises(ValueError) as e:
        sizes(100_000, max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    assert str(e.value) == ("without chunked prefill, max_num_batched_tokens (32) must be at least "
                            "max_model_len (64)")
    s = sizes(100_000, max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert s.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(1048576\)"):  # no limit at all
        sizes(100_000, block_bytes=0, enable_chunked_prefill=False)


def test_no_usable_slot():
    # one forced slot is the scratch slot: nothing left for a request
    with pytest.raises(ValueError, match="^not even one request's state fits in the cache budget$"):
        sizes(1_000_000, block_bytes=0, num_state_slots=1)


def test_checkpoints_come_after_slots_and_blocks():
    # plenty: slots 257 and blocks 1,024 (capped) as without caching; the rest, 640 rows, capped at 256
    off = sizes(1_000_000, max_model_len=64)
    on = sizes(1_000_000, max_model_len=64, enable_prefix_caching=True)
    assert pools(on) == pools(off) == (257, 1024, 256, 2048, 64) and off.num_checkpoints == 0
    assert on.num_checkpoints == 256
    # KV-bound: the blocks (2,350 without caching) give up a tenth of the budget: (270,000 - 65,000) // 100
    # = 2,050 blocks; the checkpoints take the 30,000 bytes left
    kw = {"max_model_len": 640, "max_num_seqs": 64}
    assert pools(sizes(300_000, **kw))[:2] == (65, 2350)
    on = sizes(300_000, enable_prefix_caching=True, **kw)
    assert pools(on)[:3] == (65, 2050, 64) and on.num_checkpoints == 30
    # a forced number takes its bytes from the blocks: (293,000 - 65,000) // 100
    forced = sizes(300_000, enable_prefix_caching=True, num_state_checkpoints=7, **kw)
    assert pools(forced)[:2] == (65, 2280) and forced.num_checkpoints == 7
    with pytest.raises(ValueError, match="KV cache holds"):
        sizes(300_000, enable_prefix_caching=True, num_state_checkpoints=290, **kw)
    # slots bound by the budget (99 without caching): they give up the tenth too, 10 slots' bytes,
    # so that a model with large states still keeps checkpoints
    assert pools(sizes(100_000, max_model_len=64))[:2] == (99, 10)
    tight = sizes(100_000, max_model_len=64, enable_prefix_caching=True)
    assert pools(tight)[:2] == (89, 10) and tight.num_checkpoints == 10
    # a budget with no room beside the forced slots: the checkpoints yield (and a warning says so)
    full = sizes(100_000, max_model_len=64, num_state_slots=99, enable_prefix_caching=True)
    assert pools(full)[:2] == (99, 10) and full.num_checkpoints == 0
    assert full.notes[-1][0] == WARNING and "no room for state checkpoints" in full.notes[-1][1]
    # no attention: slots as without caching, the checkpoints from what they leave
    mamba = sizes(1_000_000, block_bytes=0, max_num_seqs=100, enable_prefix_caching=True)
    assert (mamba.num_slots, mamba.num_blocks, mamba.num_checkpoints) == (101, 0, 256)


@pytest.mark.parametrize("mamba_block_size, kept", [(63, 256), (64, 0), (4096, 0)])
def test_no_checkpoints_when_no_prompt_reaches_one(mamba_block_size, kept):
    """A checkpoint position must lie before a prompt's last token: at mamba_block_size >=
    max_model_len none can, so no row is kept (and the running pools are those of caching off)."""
    off = sizes(1_000_000, max_model_len=64)
    on = sizes(1_000_000, max_model_len=64, enable_prefix_caching=True, mamba_block_size=mamba_block_size)
    assert on.num_checkpoints == kept and pools(on) == pools(off)
    if not kept:
        assert on.notes[-1][0] == WARNING and f"mamba_block_size ({mamba_block_size}) is not below max_model_len (64)" \
            in on.notes[-1][1]
