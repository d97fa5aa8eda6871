"""The engine's read API (limits, pool sizes, memory, usage counters) and QueueFullError: what
the server, its metrics and the benchmarks read instead of the engine's internals. Checked
against the cache tensors themselves and against counts taken from the outputs."""

import pytest

from mambaserve import SamplingParams
from mambaserve.engine.llm_engine import QueueFullError
from tests.engine.engines import assert_pools_empty, make, prompts_for
from tests.models.tiny import hf_model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied"])
def test_limits_pool_sizes_and_memory(name):
    kw = dict(block_size=4, num_kv_blocks=12, max_model_len=48) if name == "granite-moe" else dict(num_state_slots=5)
    e = make(name, max_num_seqs=3, **kw).llm_engine
    sizes = e.pool_sizes
    assert e.vocab_size == hf_model(name).config.vocab_size
    assert e.max_model_len == sizes.max_model_len
    assert sizes.max_num_seqs == 3 and sizes.max_num_batched_tokens == 2048  # the CPU default
    if name == "granite-moe":
        assert (sizes.num_blocks, sizes.max_model_len) == (12, 48)
    else:
        assert (sizes.num_slots, sizes.num_blocks) == (5, 0)
    # what the engine says it holds is what its cache tensors and parameters take
    caches = e.runner.caches
    unique = {p.data_ptr(): p for p in e.runner.model.parameters()}.values()  # tied weights once
    mem = e.memory
    n = sizes.num_slots  # rows 0 .. n - 1 run requests, the checkpoints follow
    assert mem.state_cache_bytes == _bytes(t[:n] for pair in caches.mamba for t in pair) > 0
    assert mem.state_checkpoint_bytes == _bytes(t[n:] for pair in caches.mamba for t in pair)
    assert mem.kv_cache_bytes == (_bytes(t for pair in caches.kv for t in pair) if name == "granite-moe" else 0)
    assert mem.weights_bytes == _bytes(unique)
    assert all(c.shape[0] == sizes.num_slots + sizes.num_checkpoints for c, _ in caches.mamba)  # checkpoints follow
    usage = e.usage()
    assert usage.num_slots_total == sizes.num_slots - 1  # the scratch slot is never handed out
    assert usage.num_blocks_total == sizes.num_blocks


def test_usage_counters_follow_the_run():
    name = "granite-moe"
    llm = make(name, max_num_seqs=2, max_num_batched_tokens=8)
    e = llm.llm_engine
    start = e.usage()
    assert (start.num_running, start.num_waiting, start.num_slots_used, start.num_blocks_used) == (0, 0, 0, 0)
    assert (start.prompt_tokens, start.generation_tokens, start.steps, start.step_breakdown) == (0, 0, 0, {})
    prompts = prompts_for(name, lens=(5, 3, 9))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), {"prompt_token_ids": p}, params)
    assert (e.usage().num_waiting, e.usage().num_running) == (3, 0)
    e.step()
    first = e.usage()
    assert (first.num_running, first.num_waiting) == (2, 1)  # 5 + 3 tokens: the step's budget
    assert first.num_slots_used == 2 and first.num_blocks_used > 0 and first.steps == 1
    assert first.prompt_tokens == 8
    outs, steps = {}, 1
    while e.has_unfinished_requests():
        steps += 1
        outs.update({o.request_id: o for o in e.step() if o.finished})
    end = e.usage()
    assert end.steps == steps
    assert end.prompt_tokens == sum(map(len, prompts))
    assert end.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outs.values()) == 12
    assert end.preemptions == 0
    # every step is in the breakdown under how the runner ran it (on the CPU: eagerly)
    kinds = end.step_breakdown
    assert set(kinds) <= {"eager/prefill", "eager/decode", "eager/mixed"} and "eager/decode" in kinds
    assert sum(k.steps for k in kinds.values()) == steps
    assert sum(k.tokens for k in kinds.values()) == end.prompt_tokens + end.generation_tokens - len(prompts)
    assert all(0 < k.max_step_seconds <= k.seconds for k in kinds.values())
    # the snapshot is a copy: the engine's own counters are not the caller's to change
    kinds["eager/decode"].steps = -1
    assert e.usage().step_breakdown["eager/decode"].steps > 0
    e.reset_step_breakdown()
    assert e.usage().step_breakdown == {} and e.usage().steps == steps
    assert_pools_empty(llm)


def test_queue_full_is_its_own_error_and_changes_nothing():
    name = "bamba"
    llm = make(name, max_queue_len=1)
    e = llm.llm_engine
    prompts = prompts_for(name)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    e.add_request("a", {"prompt_token_ids": prompts[3]}, params)
    with pytest.raises(QueueFullError, match="queue is full"):
        e.add_request("b", {"prompt_token_ids": prompts[4]}, params)
    assert e.num_requests == 1 and e.usage().num_waiting == 1
    e.step()  # "a" admitted: the queue has room again, and "b" may take its id
    e.add_request("b", {"prompt_token_ids": prompts[4]}, params)
    while e.has_unfinished_requests():
        e.step()
    assert_pools_empty(llm)


def test_startup_summary_counts_checkpoints_apart_from_the_running_slots(caplog):
    from mambaserve.engine.stat_logger import log_startup_summary

    e = make("mamba2-untied", num_state_slots=5, num_state_checkpoints=7, mamba_block_size=8).llm_engine
    with caplog.at_level("INFO", logger="mambaserve"):
        log_startup_summary(e)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("caches:"))
    mib = e.memory.state_cache_bytes / 2**20
    assert line.startswith(f"caches: 5 state slots ({mib:.1f} MiB), 7 prefix-cache state checkpoints every 8 "
                           f"tokens ({7 / 5 * mib:.1f} MiB), no KV cache")
