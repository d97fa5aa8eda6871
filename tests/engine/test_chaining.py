"""`plan_chained_decode` on its own (no model): which decode step async scheduling may launch
before the host has read the previous step's tokens, against the rule its docstring states."""

import pytest

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.state_pool import StateSlotPool
from mambaserve.engine.chaining import plan_chained_decode
from mambaserve.engine.scheduler import Scheduler
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import SamplingParams

MAX_LEN = 64


def decoding(params_list, block_size=4, num_blocks=64):
    """A scheduler whose sequences have all finished their prompts and sampled one token each,
    and the decode step it schedules next (one new token per sequence)."""
    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, slot_pool=StateSlotPool(8),
                      block_pool=BlockPool(num_blocks, block_size), enable_chunked_prefill=True)
    seqs = [Sequence(str(i), prompt_token_ids=[3, 4, 5], sampling_params=p) for i, p in enumerate(params_list)]
    for seq in seqs:
        sched.add(seq)
    for s in sched.schedule().scheduled:  # the prefills
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.append_token(7)
    return sched, seqs, sched.schedule().scheduled


def test_a_decode_step_of_every_running_sequence_chains_and_reserves_the_next_block():
    sched, seqs, step = decoding([SamplingParams(max_tokens=10), SamplingParams(max_tokens=10)])
    blocks_before = [len(s.block_table) for s in seqs]
    rows, chained = plan_chained_decode(step, "eager", sched, MAX_LEN)
    assert rows == [0, 1] and chained == [s.seq for s in step]
    # 3 prompt + 1 sampled + 1 in flight: the 5th token needs a second block of 4
    assert [len(s.block_table) for s in seqs] == [max(b, 2) for b in blocks_before]


def test_a_sequence_ending_on_this_step_is_left_out():
    sched, seqs, step = decoding([SamplingParams(max_tokens=2), SamplingParams(max_tokens=10)])
    rows, chained = plan_chained_decode(step, "decode_graph", sched, MAX_LEN)
    assert rows == [1] and chained == [step[1].seq]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, repetition_penalty=1.2),
                                    SamplingParams(max_tokens=10, logprobs=1),
                                    SamplingParams(max_tokens=10, min_tokens=3)])
def test_what_reads_the_host_token_lists_does_not_chain(params):
    sched, _, step = decoding([SamplingParams(max_tokens=10), params])
    assert plan_chained_decode(step, "eager", sched, MAX_LEN) is None


def test_a_waiting_request_or_a_piecewise_step_does_not_chain():
    sched, _, step = decoding([SamplingParams(max_tokens=10)])
    assert plan_chained_decode(step, "piecewise", sched, MAX_LEN) is None
    sched.add(Sequence("late", prompt_token_ids=[3, 4], sampling_params=SamplingParams(max_tokens=4)))
    assert plan_chained_decode(step, "eager", sched, MAX_LEN) is None
