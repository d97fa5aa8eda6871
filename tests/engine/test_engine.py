"""End-to-end engine behaviour on tiny random checkpoints (CPU, float32, reference ops).

Greedy outputs must not depend on how requests are batched, chunked, interleaved or preempted,
and must equal transformers' greedy generate. Pools must return to their starting counts.
"""

import pytest
import torch

from mambaserve import SamplingParams
from tests.engine.engines import (
    FAMILIES,
    GREEDY,
    EagerPiecewise,
    assert_pools_empty,
    count_chained,
    make,
    prompts_for,
    run,
)
from tests.models.tiny import hf_model, skip_unless_transformers_per_group

# The families the suites below also take, beyond FAMILIES (which the GPU tests share): Mamba-1;
# Zamba2 (shared attention weights feeding one KV cache per depth); Nemotron-H with all four layer
# kinds (M, E, *, -: MLP-only and MoE layers hold no cache); Jamba's second config (top-1 MoE after
# every layer, attention first). Each takes the cases its own file ran before.
MORE = ["mamba1", "zamba2", "nemotron-h-moe", "jamba-moe-every-layer"]


@pytest.mark.parametrize("name", FAMILIES + MORE)
def test_batched_equals_alone(name, alone):
    llm = make(name)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("budget, name", [(b, n) for b in (1, 7, 64) for n in FAMILIES]
                         + [(1, "mamba1"), (7, "mamba1"), (7, "zamba2"), (7, "nemotron-h-moe")])
def test_chunked_prefill_equals_whole_prompts(name, budget, alone):
    llm = make(name, max_num_batched_tokens=budget)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_request_arriving_while_others_decode(name, alone):
    llm = make(name)
    engine = llm.llm_engine
    prompts = prompts_for(name)
    done = {}
    engine.add_request("first", {"prompt_token_ids": prompts[4]}, GREEDY)
    engine.add_request("second", {"prompt_token_ids": prompts[0]}, GREEDY)
    pending = {2: 2, 3: 4, 5: 5}  # prompt index -> step at which it arrives
    step = 0
    while engine.has_unfinished_requests() or pending:
        for i, at in list(pending.items()):
            if step == at:
                engine.add_request(f"late{i}", {"prompt_token_ids": prompts[i]}, GREEDY)
                del pending[i]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    ref = alone(name)
    assert done["first"] == ref[4] and done["second"] == ref[0]
    assert done["late2"] == ref[2] and done["late3"] == ref[3] and done["late5"] == ref[5]
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", ["granite-moe", "bamba", "falcon-h1", "jamba", "zamba2", "nemotron-h-moe",
                                  "jamba-moe-every-layer"])
def test_preemption_under_tiny_kv_budget(name, alone):
    # 12 blocks of 4 tokens: enough for the longest request alone (30 + 10 tokens), not for all at once
    llm = make(name, block_size=4, num_kv_blocks=12, max_model_len=48)
    assert run(llm, prompts_for(name)) == alone(name)
    assert llm.llm_engine.usage().preemptions > 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", FAMILIES + ["jamba-moe-every-layer", "mamba1"])
def test_greedy_equals_transformers_generate(name, alone):
    hf = hf_model(name)
    skip_unless_transformers_per_group(hf)
    hf.generation_config.eos_token_id = None
    # transformers' decode step ignores time_step_limit while its prefill applies it (as
    # mamba_ssm's selective_state_update does); we apply it in both. For a config with a
    # limit, the reference is greedy decoding by full forwards, which has one meaning.
    limit = tuple(getattr(hf.config, "time_step_limit", None) or (0.0, float("inf")))
    for p, ours in list(zip(prompts_for(name), alone(name)))[1:5]:
        with torch.no_grad():
            if limit == (0.0, float("inf")):
                ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                  pad_token_id=0)[0, len(p):].tolist()
            else:
                ids = list(p)
                for _ in range(10):
                    ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
                ref = ids[len(p):]
        assert ours == ref


def test_abort_frees_slot_and_blocks_and_next_request_starts_clean(alone):
    name = "granite-moe"
    llm = make(name)
    engine = llm.llm_engine
    prompts = prompts_for(name)
    engine.add_request("a", {"prompt_token_ids": prompts[5]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": prompts[4]}, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.usage().num_slots_used == 2
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert_pools_empty(llm)
    # the slots just freed held live state: a new request must not see it
    assert run(llm, [prompts[3]]) == [alone(name)[3]]
    assert_pools_empty(llm)


def test_slots_never_shared():
    llm = make("bamba", max_num_batched_tokens=16)
    engine = llm.llm_engine
    for i, p in enumerate(prompts_for("bamba", lens=(5, 9, 2, 14, 7, 3, 11), seed=3)):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        slots = [s.state_slot for s in running]
        blocks = [b for s in running for b in s.block_table]
        assert len(set(slots)) == len(slots) and None not in slots
        assert len(set(blocks)) == len(blocks)
        assert engine.runner.scratch_slot not in slots
    assert_pools_empty(llm)


@pytest.mark.parametrize("bad", [
    {"prompt_token_ids": []},
    {"prompt_token_ids": [1, 2, 10**6]},
    {"prompt_token_ids": [1, -3]},
    {"prompt_token_ids": list(range(3, 200)) * 2},  # longer than max_model_len
    {"prompt_token_ids": [5, 6], "cache_salt": ""},
    {"prompt_token_ids": [5, 6], "cache_salt": 5},
    {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": None}},  # not implemented: not dropped silently
    {"prompt_token_ids": [5, 6], "prompt_token_id": [7]},  # a misspelt key
    {"prompt_token_ids": None},
    {"prompt_token_ids": 7},
    {"prompt_token_ids": [5, 6], "prompt": 3},
])
def test_bad_prompts_are_value_errors_and_engine_keeps_serving(bad, alone):
    llm = make("granite-moe", max_model_len=128)
    engine = llm.llm_engine
    p = prompts_for("granite-moe")
    engine.add_request("ok", {"prompt_token_ids": p[3]}, GREEDY)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", bad, GREEDY)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done = out.outputs[0].token_ids
    assert done == alone("granite-moe")[3]
    assert_pools_empty(llm)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(n=0), dict(top_k=-5)])
def test_nonsense_sampling_params_rejected(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_seeded_sampling_is_batch_independent():
    llm = make("bamba")
    prompts = prompts_for("bamba")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone_out = run(llm, [prompts[3]], params)[0]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [params if i == 3 else SamplingParams(temperature=1.0,
                                                               max_tokens=8) for i in range(len(prompts))],
                         use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone_out


def test_n_completions_and_logprobs():
    llm = make("granite-moe")
    p = prompts_for("granite-moe")[3]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                                                 logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    for c in out.outputs:
        for tok, d in zip(c.token_ids, c.logprobs):
            assert tok in d and all(v.logprob <= 0 for v in d.values())
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied"])
def test_prompt_logprobs_match_transformers(name):
    hf = hf_model(name)
    skip_unless_transformers_per_group(hf)
    llm = make(name, max_num_batched_tokens=7)  # chunked: prompt logprobs assembled over steps
    p = prompts_for(name)[5]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(p)):
        got = out.prompt_logprobs[j][p[j]].logprob
        assert abs(got - float(ref[j - 1, p[j]])) < 1e-4 * max(1.0, abs(float(ref[j - 1, p[j]])))


@pytest.mark.parametrize("budget, name", [(b, n) for b in (1, 3, 7) for n in ("granite-moe", "mamba2-untied",
                                                                                "falcon-h1", "jamba")]
                         + [(7, "mamba1"), (7, "jamba-moe-every-layer")])
def test_padded_piecewise_steps_equal_alone(name, budget, alone):
    # budget 1 (and 3 with three running) gives steps whose every sequence has one new token
    # and a state, some of them mid-prompt: the decode kernels must not get padding rows
    llm = make(name, max_num_batched_tokens=budget)
    runner = llm.llm_engine.runner
    runner.piecewise_graphs = EagerPiecewise(runner.model)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("first,second", [(("x#0", 1), ("x", 2)), (("x", 2), ("x#1", 1))])
def test_request_ids_clashing_with_sequence_ids_are_refused(first, second, alone):
    # a request "x" with n=2 runs sequences "x#0" and "x#1": a clash must leave the other alone
    llm = make("granite-moe")
    engine = llm.llm_engine
    p = prompts_for("granite-moe")
    engine.add_request(first[0], {"prompt_token_ids": p[3]},
                       SamplingParams(n=first[1], temperature=0.0, max_tokens=10, ignore_eos=True))
    with pytest.raises(ValueError):
        engine.add_request(second[0], {"prompt_token_ids": p[2]},
                           SamplingParams(n=second[1], temperature=0.0, max_tokens=10, ignore_eos=True))
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    assert done == {first[0]: [alone("granite-moe")[3]] * first[1]}
    assert_pools_empty(llm)


def test_prompt_logprobs_of_a_one_token_prompt_is_one_none():
    # as in vLLM: one entry per prompt token, None for the first (it has no context)
    llm = make("granite-moe")
    outs = llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": [5, 6]}],
                        SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert outs[0].prompt_logprobs == [None]
    assert outs[1].prompt_logprobs[0] is None and 6 in outs[1].prompt_logprobs[1]
    assert_pools_empty(llm)


def test_stop_strings_without_a_tokenizer_are_refused():
    llm = make("bamba")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop=["x"]), use_tqdm=False)
    assert_pools_empty(llm)


def test_n_completions_with_the_largest_seed():
    llm = make("bamba")
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(n=3, seed=2**63 - 1, temperature=1.0, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_pools_empty(llm)


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(block_size=4, num_kv_blocks=12,
                                                                             max_model_len=48),
                                dict(block_size=4, num_kv_blocks=12, max_model_len=48, max_num_batched_tokens=5)])
def test_prompt_and_generation_token_counters(kw):
    """Counted once each, also when chunked or recomputed after preemption (the last case preempts
    prefills midway: the rest of such a prompt is computed for the first time when it resumes)."""
    llm = make("granite-moe", **kw)
    prompts = prompts_for("granite-moe")
    outs = run(llm, prompts)
    usage = llm.llm_engine.usage()
    assert usage.preemptions > 0 or "num_kv_blocks" not in kw
    assert usage.prompt_tokens == sum(len(p) for p in prompts)
    assert usage.generation_tokens == sum(len(o) for o in outs)


@pytest.mark.parametrize("name", FAMILIES)
def test_async_scheduling_equals_sync(name):
    """The decode step launched before the host reads the previous tokens changes nothing:
    greedy, seeded sampling, stop tokens met mid-run, length limits, n=2, all as without it."""
    prompts = prompts_for(name)
    probe = run(make(name, async_scheduling=False), prompts, SamplingParams(temperature=0.0, max_tokens=12))
    stop_tok = probe[3][5]  # met at the 6th token of prompt 3's greedy run (maybe earlier elsewhere)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.9, seed=7, max_tokens=15),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=9, n=2),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        # min_tokens ends at the token the stop id is met: masked one step too long, it would run on
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=2, stop_token_ids=[probe[4][2]]),
    ]
    prompts = prompts + [prompts[4]]
    results = {}
    for mode in (False, True):
        llm = make(name, async_scheduling=mode, max_num_seqs=4)
        calls = count_chained(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
        assert (calls[0] > 0) == mode
        assert_pools_empty(llm)
    assert results[True] == results[False]
    assert results[True][3][0][1] == "stop" and len(results[True][3][0][0]) <= 6
    assert results[True][6][0][1] == "stop" and len(results[True][6][0][0]) <= 3


def test_abort_while_a_decode_step_is_in_flight(alone):
    """A request aborted while the step after its last is already launched: the other request
    continues as if alone, and the aborted one's slot and blocks come back."""
    name = "granite-moe"
    llm = make(name, max_num_seqs=4)
    e = llm.llm_engine
    prompts = prompts_for(name)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    e.add_request("keep", {"prompt_token_ids": prompts[4]}, params)
    e.add_request("drop", {"prompt_token_ids": prompts[5]}, params)
    for _ in range(4):
        e.step()
    assert e._inflight is not None  # the next decode step is running ahead
    assert e.abort_request("drop")
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"keep": alone(name)[4]}
    assert_pools_empty(llm)
