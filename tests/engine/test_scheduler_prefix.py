"""The scheduler with prefix caching, without a model: where chunks end for checkpoints, what a
match takes, and a randomized simulation over shared prefixes against a fake model whose state
slots, checkpoint rows and KV blocks are checked every step (copies in the order the runner
makes them: loads, the forward, saves)."""

import random

import pytest

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.checkpoint_pool import StateCheckpointPool
from mambaserve.cache.prefix_cache import PrefixCache
from mambaserve.cache.state_pool import StateSlotPool
from mambaserve.engine.scheduler import Scheduler
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import SamplingParams
from tests.engine.scheduling import STOP_TOKEN, engine_update, expected_outputs


def make(*, budget=64, num_slots=8, num_blocks=64, block_size=4, m=8, rows=8, chunked=True, max_num_seqs=8,
         inner=None):
    pool = BlockPool(num_blocks, block_size, enable_caching=True) if num_blocks else None
    cache = PrefixCache(block_pool=pool, checkpoints=StateCheckpointPool(rows, num_slots), mamba_block_size=m)
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, slot_pool=StateSlotPool(num_slots),
                     block_pool=pool, enable_chunked_prefill=chunked, prefix_cache=cache, min_inner_save_offset=inner)


def seq(rid, prompt, max_tokens=3, **kw):
    return Sequence(str(rid), prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens, **kw))


def run_one(sched, s):
    """Add a sequence and run the scheduler until it finishes; returns each step's (tokens, load, save)."""
    sched.add(s)
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps += [(i.num_new_tokens, i.load_checkpoint, i.save_checkpoint) for i in out.scheduled]
        engine_update(sched, out)
    return steps


def test_chunks_end_at_the_last_boundary_and_a_repeat_resumes_there():
    sched = make()
    prompt = list(range(1, 27))  # 26 tokens: last boundary 24
    steps = run_one(sched, seq("a", prompt))
    assert [n for n, _, _ in steps[:2]] == [24, 2] and steps[0][2] is not None and steps[0][1] is None
    b = seq("b", prompt)
    steps = run_one(sched, b)
    assert b.num_cached_tokens == 24 and steps[0][:2] == (2, sched.prefix_cache.checkpoints.lookup(b.block_hashes[5]))
    assert sched.prefix_cache_stats.queries == 52 and sched.prefix_cache_stats.hits == 24
    # a prompt of 25 tokens resumes at 24 too: only its last token is computed
    c = seq("c", prompt[:25])
    assert run_one(sched, c)[0][0] == 1 and c.num_cached_tokens == 24
    # 24 tokens: the match stops at 16 at most (its last token must be computed), and 16 has none
    d = seq("d", prompt[:24])
    run_one(sched, d)
    assert d.num_cached_tokens == 0


def test_checkpoints_saved_inside_a_chunk_where_the_layers_can():
    """With layers that save inside a chunk, a prompt runs in one chunk, its checkpoint at the
    last boundary written at that offset; a position too close to the chunk's start still ends it."""
    sched = make(inner=3)
    prompt = list(range(1, 27))  # last boundary 24
    sched.add(seq("a", prompt))
    (item,) = sched.schedule().scheduled
    assert item.num_new_tokens == 26 and item.save_checkpoint is None and len(item.inner_saves) == 1
    assert item.inner_saves[0][0] == 24
    sched = make(inner=3, budget=22)  # first chunk [0, 22), the next starts 2 before the boundary at 24
    sched.add(seq("b", prompt))
    out = sched.schedule()
    assert [i.num_new_tokens for i in out.scheduled] == [22]
    engine_update(sched, out)
    (item,) = sched.schedule().scheduled
    assert item.num_new_tokens == 2 and item.inner_saves == () and item.save_checkpoint is not None


def test_shared_system_prompt_hits_from_the_third_request():
    sched = make(budget=256)
    system = list(range(100, 121))  # 21 tokens
    a, b, c = (seq(x, system + [200 + 10 * i + j for j in range(6)]) for i, x in enumerate("abc"))
    assert [n for n, _, _ in run_one(sched, a)] == [24, 3, 1, 1]
    steps = run_one(sched, b)  # the branch point 16 is seen: the chunk ends there, then at 24
    assert [n for n, _, _ in steps[:3]] == [16, 8, 3] and all(s[2] is not None for s in steps[:2])
    run_one(sched, c)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 16)


def test_same_prompt_twice_in_one_step_the_second_waits_for_the_first_ones_checkpoint():
    sched = make(budget=256)
    p = list(range(1, 20))
    a, b = seq("a", p), seq("b", p)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # b would recompute what a's chunk saves at 16: it waits a step
    assert [(i.seq, i.num_new_tokens, i.load_checkpoint) for i in out.scheduled] == [(a, 16, None)]
    row = out.scheduled[0].save_checkpoint
    assert row is not None and list(sched.waiting) == [b]
    engine_update(sched, out)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens, i.load_checkpoint) for i in out.scheduled] == [(a, 3, None), (b, 3, row)]
    while sched.has_unfinished():
        engine_update(sched, out)
        out = sched.schedule()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)


def test_a_shared_system_prompt_sent_three_times_at_once_hits_on_the_third():
    """a and b are admitted together (b checkpoints their branch point 16, a its last boundary
    24); c waits for b's checkpoint instead of computing the system prompt a third time."""
    sched = make(budget=256)
    system = list(range(100, 121))  # 21 tokens
    a, b, c = (seq(x, system + [200 + 10 * i + j for j in range(6)]) for i, x in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 24), (b, 16)] and list(sched.waiting) == [c]
    while sched.has_unfinished():
        engine_update(sched, out)
        out = sched.schedule()
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 16)


def test_a_waiting_prompt_passed_over_keeps_its_place_and_others_go_ahead():
    """d shares nothing and is admitted in the step b waits in; b is admitted before e, which
    came after it, once a's checkpoint exists; prompt logprobs never wait (they match nothing)."""
    sched = make(budget=256)
    p = list(range(1, 20))
    a, b, lp, d = seq("a", p), seq("b", p), seq("lp", p, prompt_logprobs=1), seq("d", list(range(50, 60)))
    for s in (a, b, lp, d):
        sched.add(s)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a, lp, d] and list(sched.waiting) == [b]
    e = seq("e", list(range(70, 75)))
    sched.add(e)
    engine_update(sched, out)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled][-2:] == [b, e] and out.scheduled[-2].load_checkpoint is not None


def test_a_waiting_prompt_is_admitted_when_the_prefill_it_waits_for_is_preempted():
    sched = make(budget=8, num_blocks=0)  # chunks of 8: a plans its checkpoint at 16 over two steps
    p = list(range(1, 20))
    a, b = seq("a", p), seq("b", p)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a] and list(sched.waiting) == [b]
    engine_update(sched, out)
    sched._preempt(a)  # as the pools would, were they short: a's plan goes with it
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a] and list(sched.waiting) == [b]  # a again, ahead of b, b waits
    while sched.has_unfinished():
        engine_update(sched, out)
        out = sched.schedule()
    assert b.num_cached_tokens == 16


def test_prompt_logprobs_never_match_and_blocks_stay_cached_after_abort():
    sched = make()
    p = list(range(1, 30))
    run_one(sched, seq("a", p))
    lp = seq("lp", p, prompt_logprobs=1)
    assert run_one(sched, lp)[0][:2] == (29, None) and lp.num_cached_tokens == 0
    x = seq("x", p + [7] * 9, max_tokens=50)
    sched.add(x)
    engine_update(sched, sched.schedule())
    assert x.num_cached_tokens == 24 and x.block_table[:6] == [sched.block_pool.lookup(h) for h in x.block_hashes[:6]]
    assert not sched.reset_prefix_cache()  # a request runs
    sched.abort("x")
    # its first chunk [24, 32) ran: its block 7 joins a's 7 blocks in the cache, and its checkpoint at 32
    assert sched.block_pool.num_used == 0 and sched.block_pool.num_cached == 8
    y = seq("y", p + [7] * 9)
    run_one(sched, y)
    assert y.num_cached_tokens == 32
    assert sched.reset_prefix_cache() and sched.block_pool.num_cached == 0
    z = seq("z", p)
    run_one(sched, z)
    assert z.num_cached_tokens == 0


# budget, max_num_seqs, num_slots, num_blocks, block_size, mamba_block_size, checkpoint rows, chunked
CONFIGS = [
    (64, 4, 5, 40, 4, 8, 6, True),
    (7, 4, 5, 30, 4, 8, 3, True),
    (16, 6, 7, 40, 2, 4, 3, True),
    (64, 6, 6, 0, 4, 8, 4, True),
    (48, 4, 4, 30, 4, 16, 5, False),
    (32, 8, 9, 64, 8, 8, 1, True),
]


@pytest.mark.parametrize("inner", [None, 3])  # chunks end at checkpoints / the layers save inside chunks
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", CONFIGS)
def test_randomized_prefix_caching_simulation(config, seed, inner):
    budget, max_num_seqs, num_slots, num_blocks, bs, m, rows, chunked = config
    rng = random.Random(seed * 100 + CONFIGS.index(config))
    sched = make(budget=budget, max_num_seqs=max_num_seqs, num_slots=num_slots, num_blocks=num_blocks, block_size=bs,
                 m=m, rows=rows, chunked=chunked, inner=inner)
    prefixes = [[rng.randint(1, 49) for _ in range(40)] for _ in range(3)]
    slot_state: dict[int, list[int]] = {}  # the fake model's recurrent state: tokens folded in
    ckpt: dict[int, list[int]] = {}  # checkpoint row -> the state copied into it
    kv: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
    all_seqs, aborted, prompts, admitted = [], set(), [], set()
    step = 0
    while step < 120 or sched.has_unfinished():
        step += 1
        assert step < 5000, "no progress"
        if step < 120 and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                if prompts and rng.random() < 0.3:
                    prompt = list(rng.choice(prompts))  # an exact repeat
                else:
                    tail = [rng.randint(1, 49) for _ in range(rng.randint(1, 9))]
                    prompt = rng.choice(prefixes)[: rng.randint(0, 40)] + tail
                capacity = num_blocks * bs if num_blocks else 10**9  # each sequence fits the pool alone
                prompt = prompt[: min(40, budget) if not chunked else min(48, capacity - 1)]
                prompts.append(prompt)
                s = seq(f"r{len(all_seqs)}", prompt, rng.randint(1, min(12, capacity - len(prompt))))
                sched.add(s)
                all_seqs.append(s)
        if rng.random() < 0.05 and sched.has_unfinished():
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            assert sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        if rng.random() < 0.03:
            assert sched.reset_prefix_cache() == (not sched.running)

        out = sched.schedule()
        holders: dict[int, int] = {}
        for s in sched.running:
            assert len(set(s.block_table)) == len(s.block_table)
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
        if sched.block_pool is not None:
            assert sched.block_pool.num_used == len(holders)
            new = {id(i.seq): i.num_new_tokens for i in out.scheduled}
            for s in sched.running:  # the tables cover what is computed and scheduled, no more
                assert len(s.block_table) == sched.block_pool.blocks_needed(s.num_computed_tokens + new.get(id(s), 0))
        # before the forward: loads, and every state and KV entry read must already be there
        for item in out.scheduled:
            s, c = item.seq, item.seq.num_computed_tokens
            tokens = s.all_token_ids
            admitted.add(s.request_id)
            if item.load_checkpoint is not None:
                assert c > 0 and c % m == 0 and ckpt[item.load_checkpoint] == tokens[:c], "wrong checkpoint"
                slot_state[s.state_slot] = list(ckpt[item.load_checkpoint])
            elif c == 0:
                slot_state[s.state_slot] = []
            assert slot_state[s.state_slot] == tokens[:c], "state slot corrupted"
            for pos in range(c):
                if num_blocks:
                    assert kv[s.block_table[pos // bs]][pos % bs] == tokens[pos], "KV block corrupted"
        # the forward: states advance, KV written only into blocks no one else holds
        for item in out.scheduled:
            s, c, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            tokens = s.all_token_ids
            for offset, row in item.inner_saves:  # written by the forward, at that offset
                assert inner is not None and inner <= offset < n and (c + offset) % m == 0
                ckpt[row] = slot_state[s.state_slot] + tokens[c : c + offset]
            slot_state[s.state_slot] += tokens[c : c + n]
            for pos in range(c, c + n) if num_blocks else ():
                block = s.block_table[pos // bs]
                assert holders[block] == 1, "a shared block written"
                kv.setdefault(block, {})[pos % bs] = tokens[pos]
        for item in out.scheduled:  # after the forward: saves
            if item.save_checkpoint is not None:
                s = item.seq
                assert (s.num_computed_tokens + item.num_new_tokens) % m == 0
                ckpt[item.save_checkpoint] = list(slot_state[s.state_slot])
        engine_update(sched, out, stop_token=STOP_TOKEN)

    stats = sched.prefix_cache_stats
    assert stats.queries == sum(s.num_prompt_tokens for s in all_seqs if s.request_id in admitted)
    assert stats.hits == sum(s.num_cached_tokens for s in all_seqs)
    assert stats.hits > 0, "the workload shares prefixes: some must hit"
    for s in all_seqs:
        assert s.is_finished and s.state_slot is None and s.block_table == []
        assert s.num_cached_tokens % m == 0 and s.num_cached_tokens <= s.num_prompt_tokens - 1
        if s.request_id not in aborted:
            assert s.output_token_ids == expected_outputs(s.prompt_token_ids, s.sampling_params.max_tokens, STOP_TOKEN)
    assert sched.slot_pool.num_used == 0
    if sched.block_pool is not None:
        assert sched.block_pool.num_used == 0 and sched.block_pool.num_free == num_blocks


def test_admission_passes_over_a_bounded_number_of_waiting_prompts():
    from mambaserve.engine.scheduler import MAX_PASSED_OVER

    sched = make(budget=256, num_slots=64, num_blocks=256, max_num_seqs=64)
    p = list(range(1, 20))
    same = [seq(f"s{i}", p) for i in range(MAX_PASSED_OVER + 2)]
    other = seq("o", list(range(50, 60)))
    for s in same + [other]:
        sched.add(s)
    out = sched.schedule()  # the first computes; the next 32 wait; the rest wait with them
    assert [i.seq for i in out.scheduled] == [same[0]] and len(sched.waiting) == MAX_PASSED_OVER + 2
    engine_update(sched, out)
    out = sched.schedule()
    assert {i.seq.request_id for i in out.scheduled} >= {"s1", f"s{MAX_PASSED_OVER + 1}", "o"}
