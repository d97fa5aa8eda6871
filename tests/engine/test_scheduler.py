"""The scheduler on its own: budgets, ordering, chunked prefill, preemption, abort, fairness, and a
randomized simulation against a fake model whose state and KV contents are checked every step."""

import random

import pytest

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.state_pool import StateSlotPool
from mambaserve.engine.scheduler import Scheduler, SchedulerOutput
from mambaserve.engine.sequence import Sequence, SequenceStatus
from mambaserve.sampling_params import SamplingParams
from tests.engine.scheduling import STOP_TOKEN, VOCAB, engine_update, expected_outputs


def make_seq(rid, prompt_len, max_tokens=4, first_token=1):
    prompt = [(first_token + i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    return Sequence(str(rid), prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens))


def make_scheduler(*, budget=64, max_num_seqs=8, num_slots=8, num_blocks=64, block_size=4,
                   chunked=True):
    block_pool = BlockPool(num_blocks, block_size) if num_blocks else None
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     slot_pool=StateSlotPool(num_slots), block_pool=block_pool,
                     enable_chunked_prefill=chunked)


def check_invariants(sched: Scheduler, out: SchedulerOutput):
    """Everything that must hold right after schedule(), before the engine updates anything."""
    items = out.scheduled
    seqs = [item.seq for item in items]
    assert len({id(s) for s in seqs}) == len(seqs), "a sequence scheduled twice"
    assert out.num_batched_tokens == sum(i.num_new_tokens for i in items)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert out.is_empty == (not items)
    assert len(sched.running) <= sched.max_num_seqs
    for item in items:
        s = item.seq
        assert s.status == SequenceStatus.RUNNING and s in sched.running
        assert 1 <= item.num_new_tokens <= s.num_uncomputed_tokens
    # Decodes (one token continuing from a state) first, in running order.
    is_decode = [i.seq.num_uncomputed_tokens == 1 and i.seq.num_computed_tokens > 0 for i in items]
    num_decodes = sum(is_decode)
    assert is_decode == [True] * num_decodes + [False] * (len(items) - num_decodes)
    positions = [sched.running.index(i.seq) for i in items[:num_decodes]]
    assert positions == sorted(positions)
    # Resources: running sequences own distinct slots and disjoint blocks; waiting ones none.
    slots = [s.state_slot for s in sched.running]
    assert None not in slots and len(set(slots)) == len(slots)
    assert sched.slot_pool.num_used == len(sched.running)
    all_blocks = [b for s in sched.running for b in s.block_table]
    assert len(set(all_blocks)) == len(all_blocks)
    scheduled_new = {id(i.seq): i.num_new_tokens for i in items}
    if sched.block_pool is None:
        assert not all_blocks
    else:
        assert sched.block_pool.num_used == len(all_blocks)
        for s in sched.running:
            covered = s.num_computed_tokens + scheduled_new.get(id(s), 0)
            assert len(s.block_table) == sched.block_pool.blocks_needed(covered), s
    for s in sched.waiting:
        assert s.status == SequenceStatus.WAITING and s.state_slot is None and not s.block_table
        assert s.num_computed_tokens == 0
    for s in out.preempted:
        assert s in sched.waiting and id(s) not in scheduled_new
    assert sched.num_running == len(sched.running) and sched.num_waiting == len(sched.waiting)
    # Progress: with each sequence fitting alone, a step is never empty while work remains.
    assert items or not sched.has_unfinished()


def drain(sched, max_steps=10_000, stop_token=None, on_step=None):
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        check_invariants(sched, out)
        if on_step:
            on_step(out)
        engine_update(sched, out, stop_token)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def assert_pools_full(sched):
    assert sched.slot_pool.num_used == 0 and sched.slot_pool.num_free == sched.slot_pool.num_slots
    if sched.block_pool is not None:
        assert sched.block_pool.num_used == 0
        assert sched.block_pool.num_free == sched.block_pool.num_blocks


def test_decodes_first_and_budget_respected():
    sched = make_scheduler(budget=10)
    a, b = make_seq("a", 3, max_tokens=8), make_seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 3), (b, 4)]
    engine_update(sched, out)
    c = make_seq("c", 30)
    sched.add(c)
    out = sched.schedule()  # two decodes, then the first 8 tokens of c
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 1), (c, 8)]
    assert out.num_batched_tokens == 10
    engine_update(sched, out)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 1), (c, 8)]
    drain(sched)
    assert_pools_full(sched)


@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("num_blocks", [64, 0])
def test_chunked_prefill_covers_prompts_exactly(budget, num_blocks):
    lens = [1, 6, 7, 8, 50, 64, 65, 130]
    sched = make_scheduler(budget=budget, num_slots=4, max_num_seqs=4, num_blocks=num_blocks,
                           block_size=16)
    seqs = [make_seq(i, n, max_tokens=3, first_token=i) for i, n in enumerate(lens)]
    for s in seqs:
        sched.add(s)
    chunks = {s.request_id: [] for s in seqs}

    def record(out):
        for item in out.scheduled:
            chunks[item.seq.request_id].append((item.seq.num_computed_tokens, item.num_new_tokens))

    drain(sched, on_step=record)
    for s, n in zip(seqs, lens):
        starts = [c for c, _ in chunks[s.request_id]]
        ends = [c + k for c, k in chunks[s.request_id]]
        assert starts == [0] + ends[:-1], "chunks are contiguous from 0"
        assert ends[-1] == n + 2  # prompt, then two decodes (the third token is never fed back)
        assert n in ends, "a chunk ends exactly where the prompt does (the first sample)"
        assert all(k <= budget for _, k in chunks[s.request_id])
        assert s.output_token_ids == expected_outputs(s.prompt_token_ids, 3)
        assert s.status == SequenceStatus.FINISHED_LENGTH and s.finish_reason == "length"
    assert_pools_full(sched)


def test_max_num_seqs_respected_and_fifo():
    sched = make_scheduler(budget=1000, max_num_seqs=3, num_slots=8)
    seqs = [make_seq(i, 5, max_tokens=1 + i % 4) for i in range(10)]
    for s in seqs:
        sched.add(s)
    admitted = []

    def record(out):
        assert sched.num_running <= 3
        admitted.extend(i.seq for i in out.scheduled if i.seq.num_computed_tokens == 0)

    drain(sched, on_step=record)
    assert admitted == seqs
    assert_pools_full(sched)


def test_slot_pool_limits_admission():
    sched = make_scheduler(budget=1000, max_num_seqs=8, num_slots=2)
    for i in range(5):
        sched.add(make_seq(i, 3))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 3 and sched.slot_pool.num_free == 0
    engine_update(sched, out)
    drain(sched)
    assert_pools_full(sched)


def test_block_pool_limits_admission_without_preempting():
    sched = make_scheduler(budget=1000, num_blocks=5, block_size=4)
    a, b = make_seq("a", 12), make_seq("b", 12)  # 3 blocks each
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a] and not out.preempted
    assert list(sched.waiting) == [b]


def test_without_chunked_prefill_prompts_go_whole_or_wait():
    sched = make_scheduler(budget=10, chunked=False)
    a, b, c = make_seq("a", 6), make_seq("b", 6), make_seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # b does not fit the 4 tokens left, and c waits behind it (FIFO).
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 6)]
    engine_update(sched, out)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 6), (c, 2)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(make_seq("d", 11))
    drain(sched)
    assert_pools_full(sched)


def test_preemption_by_recompute():
    # 6 blocks of 4 tokens; a and b need 2 blocks each for their prompts and 4 at the end.
    sched = make_scheduler(budget=100, num_blocks=6, block_size=4)
    a, b = make_seq("a", 8, max_tokens=9, first_token=1), make_seq("b", 8, max_tokens=9, first_token=7)
    sched.add(a)
    sched.add(b)
    engine_update(sched, sched.schedule())  # both prefilled: 8 computed, 9 tokens each
    saw_preemption = False
    while not saw_preemption:
        out = sched.schedule()
        check_invariants(sched, out)
        if out.preempted:
            saw_preemption = True
            # a, the oldest, keeps going; b, the most recently admitted, is the victim.
            assert out.preempted == [b] and [i.seq for i in out.scheduled] == [a]
            assert b.status == SequenceStatus.WAITING and sched.waiting[0] is b
            assert b.num_computed_tokens == 0 and b.state_slot is None and b.block_table == []
            assert b.num_preemptions == 1 and b.num_output_tokens > 0
            assert sched.slot_pool.num_used == 1
            assert sched.block_pool.num_used == len(a.block_table)
        engine_update(sched, out)
    recomputed = []
    drain(sched, on_step=lambda o: recomputed.extend(
        i.num_new_tokens for i in o.scheduled if i.seq is b and i.seq.num_computed_tokens == 0))
    assert recomputed and recomputed[0] > b.num_prompt_tokens  # prompt + outputs so far
    for s in (a, b):
        assert s.output_token_ids == expected_outputs(s.prompt_token_ids, 9)
        assert s.status == SequenceStatus.FINISHED_LENGTH
    assert_pools_full(sched)


def test_victim_is_the_newest_unscheduled_sequence_possibly_itself():
    # 3 blocks of 4. a (3-token prompt) decodes within 1 block for a step; b (4-token prompt)
    # needs its second block first and takes the last free one.
    sched = make_scheduler(budget=100, num_blocks=3, block_size=4)
    a, b = make_seq("a", 3, max_tokens=5), make_seq("b", 4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    engine_update(sched, sched.schedule())
    out = sched.schedule()
    check_invariants(sched, out)
    assert not out.preempted and sched.block_pool.num_free == 0
    engine_update(sched, out)
    out = sched.schedule()  # a needs a second block: b, newer and unscheduled, is the victim
    check_invariants(sched, out)
    assert out.preempted == [b] and [i.seq for i in out.scheduled] == [a]
    engine_update(sched, out)
    drain(sched)
    assert_pools_full(sched)

    # 2 blocks: a fits its block, b needs a second one and is itself the newest unscheduled.
    sched = make_scheduler(budget=100, num_blocks=2, block_size=4)
    a, b = make_seq("a", 3, max_tokens=3), make_seq("b", 4, max_tokens=3)
    sched.add(a)
    sched.add(b)
    engine_update(sched, sched.schedule())
    out = sched.schedule()
    check_invariants(sched, out)
    assert out.preempted == [b] and [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1)]
    assert b.num_preemptions == 1 and sched.waiting[0] is b
    engine_update(sched, out)
    drain(sched)
    for s in (a, b):
        assert s.output_token_ids == expected_outputs(s.prompt_token_ids, 3)
    assert_pools_full(sched)


def test_abort_from_waiting_and_running():
    sched = make_scheduler(budget=100, max_num_seqs=1)
    a, b = make_seq("a", 5, max_tokens=50), make_seq("b", 5)
    sched.add(a)
    sched.add(b)
    engine_update(sched, sched.schedule())
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    assert sched.abort("b") is b
    assert b.status == SequenceStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    assert sched.num_waiting == 0 and b.state_slot is None
    assert sched.abort("a") is a
    assert a.status == SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.state_slot is None and a.block_table == [] and sched.num_running == 0
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert not sched.has_unfinished() and sched.schedule().is_empty
    assert_pools_full(sched)
    sched.add(make_seq("a", 3))  # the id is free again


def test_abort_a_preempted_sequence():
    sched = make_scheduler(budget=100, num_blocks=6, block_size=4)
    a, b = make_seq("a", 8, max_tokens=9), make_seq("b", 8, max_tokens=9, first_token=5)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        engine_update(sched, sched.schedule())
    assert sched.abort("b") is b and b.status == SequenceStatus.FINISHED_ABORTED
    drain(sched)
    assert_pools_full(sched)


def test_duplicate_request_id_and_bad_config():
    sched = make_scheduler()
    sched.add(make_seq("x", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq("x", 3))
    for kwargs in (dict(max_num_seqs=0), dict(max_num_batched_tokens=0)):
        args = dict(max_num_seqs=1, max_num_batched_tokens=1, slot_pool=StateSlotPool(1),
                    block_pool=None) | kwargs
        with pytest.raises(ValueError):
            Scheduler(**args)


def test_finish_sets_reason_and_keeps_stop_reason():
    sched = make_scheduler()
    s = make_seq("s", 3)
    sched.add(s)
    engine_update(sched, sched.schedule())
    s.stop_reason = 7
    s.finish_reason = None
    sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    assert s.finish_reason == "stop" and s.stop_reason == 7 and s.is_finished
    assert_pools_full(sched)


CONFIGS = [
    # budget, max_num_seqs, num_slots, num_blocks, block_size, chunked
    (1, 4, 4, 40, 4, True),
    (7, 4, 3, 24, 4, True),
    (16, 8, 8, 20, 2, True),
    (64, 6, 6, 12, 16, True),
    (64, 5, 8, 0, 4, True),
    (40, 6, 6, 24, 4, False),
    (40, 4, 4, 0, 4, False),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", CONFIGS)
def test_randomized_simulation(config, seed):
    budget, max_num_seqs, num_slots, num_blocks, block_size, chunked = config
    rng = random.Random(seed * 100 + CONFIGS.index(config))
    sched = make_scheduler(budget=budget, max_num_seqs=max_num_seqs, num_slots=num_slots,
                           num_blocks=num_blocks, block_size=block_size, chunked=chunked)
    capacity = num_blocks * block_size if num_blocks else 10**9
    max_prompt = min(40, budget) if not chunked else 40
    slot_state: dict[int, list[int]] = {}  # the fake model's recurrent state: tokens folded in
    kv: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
    arrivals, first_admissions, all_seqs, aborted = [], [], [], set()
    step = 0
    while step < 80 or sched.has_unfinished():
        step += 1
        assert step < 5000, "no progress"
        if step < 80 and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                prompt_len = rng.randint(1, max_prompt)
                max_tokens = rng.randint(1, max(1, min(20, capacity - prompt_len)))
                seq = make_seq(f"r{len(all_seqs)}", prompt_len, max_tokens, rng.randint(0, 99))
                sched.add(seq)
                arrivals.append(seq)
                all_seqs.append(seq)
        if rng.random() < 0.05 and sched.has_unfinished():
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            assert sched.abort(victim.request_id) is victim
            assert victim.state_slot is None and victim.block_table == []
            aborted.add(victim.request_id)

        out = sched.schedule()
        check_invariants(sched, out)
        for item in out.scheduled:
            seq, c, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            tokens = seq.all_token_ids
            if not chunked and c == 0 and seq.num_tokens <= budget:
                assert n == seq.num_tokens, "without chunked prefill a prefill goes whole"
            if c == 0:
                if seq.num_preemptions == 0:
                    first_admissions.append(seq)
                slot_state[seq.state_slot] = []  # no initial state
            assert slot_state[seq.state_slot] == tokens[:c], "state slot corrupted"
            slot_state[seq.state_slot] += tokens[c : c + n]
            if num_blocks:
                for pos in range(c):
                    block = seq.block_table[pos // block_size]
                    assert kv[block][pos % block_size] == tokens[pos], "KV block corrupted"
                for pos in range(c, c + n):
                    kv.setdefault(seq.block_table[pos // block_size], {})[pos % block_size] = tokens[pos]
        engine_update(sched, out, stop_token=STOP_TOKEN)

    # FIFO: sequences are first admitted in arrival order (skipping those aborted while waiting).
    assert first_admissions == [s for s in arrivals if s in first_admissions]
    for s in all_seqs:
        assert s.is_finished and s.state_slot is None and s.block_table == []
        if s.request_id in aborted:
            assert s.finish_reason == "abort"
        else:
            assert s.output_token_ids == expected_outputs(s.prompt_token_ids,
                                                          s.sampling_params.max_tokens, STOP_TOKEN)
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == STOP_TOKEN else "length")
    assert_pools_full(sched)


def test_sequence_token_views():
    s = make_seq("s", 4, max_tokens=10)
    assert s.is_prefill and s.num_uncomputed_tokens == 4 and s.last_token_id == s.prompt_token_ids[-1]
    s.num_computed_tokens = 4
    s.append_token(7)
    s.num_computed_tokens = 5
    s.append_token(8, {8: None})
    assert s.all_token_ids == s.prompt_token_ids + [7, 8] and s.output_logprobs == [{8: None}]
    assert (s.num_tokens, s.num_prompt_tokens, s.num_output_tokens) == (6, 4, 2)
    assert not s.is_prefill and s.last_token_id == 8
    for start in range(7):
        for end in range(start, 8):
            assert s.get_token_ids(start, end) == s.all_token_ids[start:end]
    with pytest.raises(AssertionError):
        s.append_token(9)  # token 8 is not computed yet
    s.num_computed_tokens = 0  # preempted: everything is recomputed
    assert s.is_prefill and s.num_uncomputed_tokens == 6
    with pytest.raises(ValueError, match="empty"):
        make_seq("e", 0)
    assert SequenceStatus.FINISHED_LENGTH.is_finished and not SequenceStatus.RUNNING.is_finished
    assert SequenceStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert SequenceStatus.WAITING.finish_reason is None
