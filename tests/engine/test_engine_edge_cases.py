"""Engine inputs that public bug reports about Mamba / hybrid serving have hit (CPU, float32,
reference ops). Each test names the kind of report it follows.

The reference is always the same request generated alone (greedy unless a seed makes sampling
reproducible), or transformers where the engine's own semantics are those of transformers
(repetition penalty). After every scenario the state slots and KV blocks must be free again.
"""

import json
import random
import shutil
import tempfile

import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.engine.warm_up import warm_up_attention
from tests.engine.engines import assert_pools_empty, make, prompts_for, run
from tests.models.tiny import checkpoint, hf_model, skip_unless_transformers_per_group

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def drive(engine, arrivals, max_steps=500):
    """Step `engine`, adding arrivals[step] = [(request_id, prompt, params), ...] before each
    step; returns {request_id: [completion token ids, ...]} of the finished requests."""
    done, step = {}, 0
    arrivals = dict(arrivals)
    while engine.has_unfinished_requests() or arrivals:
        assert step < max_steps, "the engine stopped making progress"
        for rid, prompt, params in arrivals.pop(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        step += 1
    return done


# ---------------------------------------------------------------- prompt lengths
# vLLM #20838 (Bamba's initial states built wrong), vLLM PR #56196 (a prefill chunk shorter
# than the conv state), transformers PR #46741 (a chunk after the first started from zero state)

EDGE_LENS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17)  # conv width 4, SSD chunk size 8


@pytest.fixture(scope="module")
def alone_edge():
    cache = {}

    def get(name):
        if name not in cache:
            llm = make(name, max_num_seqs=1)
            prompts = prompts_for(name, lens=EDGE_LENS, seed=5)
            cache[name] = (prompts, [run(llm, [p])[0] for p in prompts])
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied", "nemotron-h", "zamba2", "mamba1-untied"])
@pytest.mark.parametrize("budget", [3, 8, 9])
def test_prompts_around_conv_width_and_chunk_size(name, budget, alone_edge):
    """Budgets 3 (chunks shorter than the conv state), 8 (chunks of exactly the SSD chunk size)
    and 9 (chunks that straddle it), over prompts of 1 .. 17 tokens all in flight at once."""
    prompts, ref = alone_edge(name)
    llm = make(name, max_num_batched_tokens=budget)
    assert run(llm, prompts) == ref
    assert_pools_empty(llm)


# ---------------------------------------------------------------- slot reuse
# vLLM PR #35157 (stale state index of a resumed request), SGLang PR #30986 (a request decoding
# from the previous occupant's recurrent state)

@pytest.mark.parametrize("name", ["bamba", "mamba2-untied"])
def test_short_prompts_in_slots_just_freed_by_long_requests(name, alone):
    """A freed slot still holds its last request's conv and SSM state: a 1-3 token prompt
    admitted into it (shorter than the conv state) must not see any of it."""
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, max_num_seqs=2)
    assert run(llm, [prompts[5], prompts[4]]) == [ref[5], ref[4]]
    assert run(llm, prompts[:3]) == ref[:3]
    assert run(llm, [prompts[2], prompts[5], prompts[0]]) == [ref[2], ref[5], ref[0]]
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied", "zamba2", "mamba1"])
def test_non_finite_leftovers_in_slots_and_blocks_are_never_read(name, alone):
    """vLLM PR #56196: a chunk reading a block a previous occupant left non-finite gave NaN
    logits. Every state slot and KV block starts full of NaN here: a new request (no initial
    state) and the unused tail of a KV block must not reach the output, not even as NaN * 0."""
    prompts, ref = prompts_for(name), alone(name)
    for kw in (dict(), dict(max_num_batched_tokens=5, block_size=4, num_kv_blocks=12, max_model_len=48)):
        llm = make(name, **kw)
        caches = llm.llm_engine.runner.caches
        for t in [t for pair in caches.mamba + caches.kv for t in pair]:
            t.fill_(float("nan"))
        assert run(llm, prompts) == ref
        assert_pools_empty(llm)


# ---------------------------------------------------------------- n > 1, identical prompts
# vLLM PR #16942 thread (the same input repeated across a batch generating differently with
# chunked prefill), vLLM #57267 (different outputs for the same batch with prefix caching)

@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=5),
                                dict(block_size=4, num_kv_blocks=12, max_model_len=48)])
def test_identical_prompts_and_n_greedy_completions_equal_alone(kw, alone):
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, **kw)
    outs = llm.generate([{"prompt_token_ids": prompts[5]}] * 3 + [{"prompt_token_ids": prompts[4]}],
                        [GREEDY] * 3 + [SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == [ref[5]] * 3
    assert [c.token_ids for c in outs[3].outputs] == [ref[4]] * 3
    assert_pools_empty(llm)


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=5), dict(block_size=4, num_kv_blocks=12, max_model_len=48)])
def test_seeded_n_completions_each_equal_their_own_request_alone(kw):
    """Completion i of a seeded n-request draws from seed + i (documented): it must equal a
    one-completion request with that seed, whatever else runs (chunking, preemption)."""
    name = "bamba"
    prompts = prompts_for(name)
    base = dict(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True)
    solo = make(name, max_num_seqs=1)
    ref = [run(solo, [prompts[4]], SamplingParams(seed=100 + i, **base))[0] for i in range(3)]
    assert len({tuple(r) for r in ref}) > 1  # the seeds do make a difference
    llm = make(name, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(n=3, seed=100, **base) if i == 4 else SamplingParams(**base)
                         for i in range(len(prompts))], use_tqdm=False)
    assert [c.token_ids for c in outs[4].outputs] == ref
    assert_pools_empty(llm)


# ---------------------------------------------------------------- aborts
# SGLang PR #20182 (state of a request aborted while waiting never freed), SGLang PR #12693 and
# candle-vllm PR #441 (aborted requests leaking state slots)

def test_aborts_while_waiting_mid_prefill_and_after_one_completion_finished(alone):
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, max_num_batched_tokens=6, max_num_seqs=3)
    e = llm.llm_engine
    e.add_request("long", {"prompt_token_ids": prompts[5]}, GREEDY)          # 30 tokens: 5 steps of prefill
    e.add_request("keep", {"prompt_token_ids": prompts[3]}, GREEDY)
    e.add_request("n2", {"prompt_token_ids": prompts[1]},
                  SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True))
    e.add_request("queued", {"prompt_token_ids": prompts[2]}, GREEDY)        # waits behind them
    e.step()
    e.step()
    long_seq = e.output_processor.requests["long"].seqs[0]
    assert 0 < long_seq.num_computed_tokens < len(prompts[5])  # mid-prefill
    assert e.output_processor.requests["queued"].seqs[0].state_slot is None  # still waiting
    assert e.abort_request("long") and e.abort_request("queued")
    e.add_request(7, {"prompt_token_ids": prompts[0]}, GREEDY)  # ids are strings: 7 is "7"
    assert e.abort_request(7) and not e.abort_request("7")
    done = {}
    for _ in range(200):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        n2 = e.output_processor.requests.get("n2")
        if n2 is not None and n2.seqs[0].is_finished and not n2.seqs[1].is_finished:
            assert e.abort_request("n2")  # one completion done, the other running: abort the rest
    assert done["keep"] == [ref[3]]
    assert "n2" not in done or done["n2"] == [ref[1]] * 2
    assert_pools_empty(llm)
    assert run(llm, prompts[:4]) == ref[:4]  # the freed slots start clean
    assert_pools_empty(llm)


# ---------------------------------------------------------------- more requests than slots
# vLLM PR #11414 (running requests exceeding the mamba cache slots crashed the engine), vLLM
# #49064 (max_num_seqs above the available Mamba cache blocks)

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_more_requests_than_state_slots(async_scheduling, alone):
    name = "bamba"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, num_state_slots=3, max_num_seqs=8, async_scheduling=async_scheduling)
    e = llm.llm_engine
    assert e.pool_sizes.max_num_seqs == 2 and e.pool_sizes.num_slots == 3  # the third slot is the scratch slot
    peak = [0]
    step = e.step

    def counted():
        out = step()
        usage = e.usage()
        peak[0] = max(peak[0], usage.num_running)
        assert usage.num_slots_used == usage.num_running
        return out

    e.step = counted
    assert run(llm, prompts * 2) == ref * 2
    assert peak[0] == 2
    assert_pools_empty(llm)


def test_n_larger_than_the_state_slots_and_too_few_slots_refused(alone):
    name = "mamba2-untied"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, num_state_slots=3)
    outs = llm.generate([{"prompt_token_ids": prompts[3]}, {"prompt_token_ids": prompts[1]}],
                        [SamplingParams(n=5, temperature=0.0, max_tokens=10, ignore_eos=True), GREEDY], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [ref[3]] * 5 and outs[1].outputs[0].token_ids == ref[1]
    assert_pools_empty(llm)
    with pytest.raises(ValueError, match="state fits"):
        make(name, num_state_slots=1)  # the only slot would be the scratch slot


@pytest.mark.parametrize("name", ["granite-moe", "bamba"])
def test_preemption_without_chunked_prefill(name, alone):
    """Whole prompts only, and a KV pool that holds one longest request: recomputes after
    preemption go through the same whole-or-nothing admission."""
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, enable_chunked_prefill=False, max_num_batched_tokens=48, block_size=4, num_kv_blocks=12,
               max_model_len=48)
    assert run(llm, prompts + prompts[::-1]) == ref + ref[::-1]
    assert llm.llm_engine.usage().preemptions > 0
    assert_pools_empty(llm)


def test_max_num_seqs_above_the_step_budget_and_a_budget_below_two_slots():
    """max_num_seqs above max_num_batched_tokens is clamped to it (more decodes than tokens per
    step would starve the newest): the pools are sized for the clamped count, as if it had been
    asked for, not for slots no request can hold. A cache budget that cannot hold one request's
    slot beside the scratch slot is refused, also for a model without attention (it used to be
    overrun with two slots)."""
    name = "granite-moe"
    big = make(name, max_num_seqs=10_000, max_num_batched_tokens=16).llm_engine.pool_sizes
    asked = make(name, max_num_seqs=16, max_num_batched_tokens=16).llm_engine.pool_sizes
    assert big.max_num_seqs == 16
    assert (big.num_slots, big.num_blocks) == (asked.num_slots, asked.num_blocks) and asked.num_slots == 17
    for name in ("mamba2-untied", "granite-moe"):
        with pytest.raises(ValueError, match="fewer than two state slots"):
            make(name, cpu_cache_bytes=1000)


# ---------------------------------------------------------------- mixed steps in every order
# vLLM PR #17146 / #16942 (prefill and decode requests split inside the mamba layer)

@pytest.mark.parametrize("name", ["granite-dense-rope", "mamba2-untied", "zamba2"])
def test_random_arrivals_and_budgets_equal_alone(name, alone):
    """Requests arrive at random steps under a small budget, so steps hold decodes, running
    prefill chunks and new admissions in every combination."""
    prompts, ref = prompts_for(name), alone(name)
    rng = random.Random(hash(name) % 1000)
    for budget in (4, 11):
        llm = make(name, max_num_batched_tokens=budget, max_num_seqs=4)
        arrivals = {}
        for i in rng.sample(range(12), 12):
            arrivals.setdefault(rng.randrange(0, 25), []).append((f"r{i}", prompts[i % 6], GREEDY))
        done = drive(llm.llm_engine, arrivals)
        assert done == {f"r{i}": [ref[i % 6]] for i in range(12)}
        assert_pools_empty(llm)


# ---------------------------------------------------------------- penalties
# vllm-metal PR #69 (repetition penalty must see prompt and output tokens, presence/frequency
# only output tokens), vLLM PR #1424 thread (repetition penalty not matching transformers)

@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied"])
def test_repetition_penalty_equals_transformers_and_alone(name):
    hf = hf_model(name)
    skip_unless_transformers_per_group(hf)
    hf.generation_config.eos_token_id = None
    prompts = prompts_for(name, lens=(3, 12, 20), seed=9)
    # a repetitive prompt: the penalty has something to act on from the first token
    prompts.append((prompts[0] * 6)[:15])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8)
    refs = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(8):  # greedy by full forwards, HF's penalty over prompt + output
                logits = hf(torch.tensor([ids])).logits[0, -1].double()
                seen = torch.tensor(sorted(set(ids)))
                v = logits[seen]
                logits[seen] = torch.where(v > 0, v / 1.8, v * 1.8)
                ids.append(int(logits.argmax()))
        refs.append(ids[len(p):])
    plain = run(make(name, max_num_seqs=1), prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert plain != refs  # the penalty changes something
    for kw in (dict(max_num_seqs=1), dict(max_num_batched_tokens=5),
               dict(block_size=4, num_kv_blocks=8, max_model_len=32) if name == "granite-moe" else dict()):
        llm = make(name, **kw)
        assert run(llm, prompts, params) == refs, kw
        assert_pools_empty(llm)


def test_presence_and_frequency_penalties_batched_equal_alone():
    name = "bamba"
    prompts = prompts_for(name)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2
    prompts = prompts[2:6] + prompts[:4]
    solo = make(name, max_num_seqs=1)
    ref = [solo.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
           for p, sp in zip(prompts, params)]
    for kw in (dict(), dict(max_num_batched_tokens=3), dict(block_size=4, num_kv_blocks=12, max_model_len=48)):
        llm = make(name, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, kw
        assert_pools_empty(llm)


# ---------------------------------------------------------------- max_tokens=1, length limits
# vLLM PR #9292 / SGLang reports on a first token sampled at the end of a chunked prefill

@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=4), dict(async_scheduling=False)])
def test_max_tokens_one_beside_longer_requests(kw, alone):
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, **kw)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], [one] * 6 + [GREEDY] * 6, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:6]] == [r[:1] for r in ref]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.outputs[0].token_ids for o in outs[6:]] == ref
    assert_pools_empty(llm)


def test_prompts_at_max_model_len(alone):
    """max_model_len 32 tokens, blocks of 4 and exactly one max-length sequence's worth of KV
    blocks: a 31-token prompt gets one token; max_tokens=None stops at the limit; a prompt of
    32 tokens is refused, and the requests beside it are not disturbed."""
    name = "granite-moe"
    vocab = hf_model(name).config.vocab_size
    g = torch.Generator().manual_seed(21)
    long_prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (31, 25, 20)]
    solo = make(name, max_num_seqs=1)
    ref = [run(solo, [p], SamplingParams(temperature=0.0, max_tokens=32 - len(p), ignore_eos=True))[0]
           for p in long_prompts]
    for async_scheduling in (False, True):
        llm = make(name, max_model_len=32, block_size=4, num_kv_blocks=8, async_scheduling=async_scheduling)
        e = llm.llm_engine
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([{"prompt_token_ids": long_prompts[0]}, {"prompt_token_ids": long_prompts[0] + [5]}],
                         GREEDY, use_tqdm=False)
        assert e.num_requests == 0 and not e.has_unfinished_requests()
        outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts],
                            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 7, 12]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert_pools_empty(llm)


# ---------------------------------------------------------------- EOS
# vLLM / SGLang reports of requests running past EOS or stopping on it under min_tokens

def _with_eos(name, eos, file="config.json"):
    """A copy of the tiny checkpoint whose config.json (or generation_config.json) names `eos`
    as the EOS token id(s)."""
    path = tempfile.mkdtemp(prefix=f"mambaserve-{name}-eos-")
    shutil.copytree(checkpoint(name), path, dirs_exist_ok=True)
    try:
        with open(f"{path}/{file}") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        cfg = {}
    cfg["eos_token_id"] = eos
    with open(f"{path}/{file}", "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eos_stops_each_request_where_it_would_alone(async_scheduling, alone):
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    eos = ref[3][4]  # the 5th greedy token of prompt 3 (maybe earlier in other prompts)
    llm = LLM(_with_eos(name, eos), skip_tokenizer_init=True, dtype="float32", device="cpu",
              async_scheduling=async_scheduling, max_num_batched_tokens=9)
    params = [SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in params], params * len(prompts),
                        use_tqdm=False)
    for i, r in enumerate(ref):
        plain, ignored, min6 = (o.outputs[0] for o in outs[3 * i: 3 * i + 3])
        cut = r.index(eos) + 1 if eos in r else None
        assert plain.token_ids == r[:cut] and plain.finish_reason == ("stop" if cut else "length")
        assert plain.stop_reason is None
        assert ignored.token_ids == r and ignored.finish_reason == "length"
        # min_tokens masks EOS: the first 6 tokens are greedy over the others (EOS masked)
        assert eos not in min6.token_ids[:6]
        if cut is not None and cut > 6:
            assert min6.token_ids == r[:cut]
    assert outs[9].outputs[0].finish_reason == "stop" and len(outs[9].outputs[0].token_ids) <= 5
    assert_pools_empty(llm)


def test_generation_config_end_tokens_stop_requests():
    """A chat checkpoint lists its end-of-turn token beside EOS in generation_config.json
    (vLLM #4589: they become stop tokens unless ignore_eos): the request stops on it with it as
    stop_reason, min_tokens masks it, ignore_eos runs past it."""
    name = "bamba"
    prompts = prompts_for(name)
    solo = make(name, max_num_seqs=1)
    ref = [run(solo, [p])[0] for p in prompts]
    end = ref[4][3]  # the 4th greedy token of prompt 4
    llm = LLM(_with_eos(name, [2, end], "generation_config.json"), skip_tokenizer_init=True, dtype="float32",
              device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in params], params * len(prompts),
                        use_tqdm=False)
    for i, r in enumerate(ref):
        plain, ignored, min10 = (o.outputs[0] for o in outs[3 * i: 3 * i + 3])
        cut = r.index(end) + 1 if end in r else None
        assert plain.token_ids == r[:cut]
        assert (plain.finish_reason, plain.stop_reason) == (("stop", end) if cut else ("length", None))
        assert ignored.token_ids == r and ignored.finish_reason == "length"
        assert end not in min10.token_ids and len(min10.token_ids) == 10
    assert outs[12].outputs[0].stop_reason == end and len(outs[12].outputs[0].token_ids) <= 4
    assert_pools_empty(llm)


def test_the_tokenizers_eos_stops_requests_when_the_config_names_another():
    """config.json and the tokenizer disagree on EOS (QwenLM/Qwen3 #927): as vLLM, the engine
    stops on the tokenizer's too (the bundled demo model's tokenizer on a tiny checkpoint)."""
    from transformers import AutoTokenizer

    from mambaserve.config import default_model

    name = "bamba"
    prompts = prompts_for(name)
    solo = make(name, max_num_seqs=1)
    ref = [run(solo, [p])[0] for p in prompts]
    end = ref[4][3]
    path = _with_eos(name, 2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model()}/{f}", path)
    with open(f"{path}/tokenizer_config.json") as f:
        tok_cfg = json.load(f)
    tok_cfg["eos_token"] = AutoTokenizer.from_pretrained(default_model()).convert_ids_to_tokens(end)
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(tok_cfg, f)
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.get_tokenizer().eos_token_id == end
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=10),
                        use_tqdm=False)
    for o, r in zip(outs, ref):
        cut = r.index(end) + 1 if end in r else None
        assert o.outputs[0].token_ids == r[:cut]
        assert o.outputs[0].finish_reason == ("stop" if cut else "length") and o.outputs[0].stop_reason is None
    assert_pools_empty(llm)


# ---------------------------------------------------------------- seeds across compositions
# vLLM PR #16942 thread (generations changing with what else is in the batch)

def test_seeded_sampling_independent_of_batch_chunking_preemption_and_async():
    name = "granite-moe"
    prompts = prompts_for(name)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=40 + i, max_tokens=9, ignore_eos=True)
              for i in range(len(prompts))]
    solo = make(name, max_num_seqs=1, async_scheduling=False)
    ref = [solo.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
           for p, sp in zip(prompts, params)]
    for kw in (dict(), dict(max_num_batched_tokens=3), dict(block_size=4, num_kv_blocks=12, max_model_len=48),
               dict(num_state_slots=3)):
        llm = make(name, **kw)
        # unseeded requests beside them draw from the global RNG in between
        noise = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[::-1]], params + [noise] * 6,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:6]] == ref, kw
        assert_pools_empty(llm)


# ---------------------------------------------------------------- bad input in a batch

@pytest.mark.parametrize("bad", [
    ({"prompt_token_ids": []}, GREEDY),
    ({"prompt_token_ids": [3, 4, 10**6]}, GREEDY),
    ({"prompt_token_ids": [3, 4, 5.0]}, GREEDY),
    ({"prompt_token_ids": [3, 4]}, SamplingParams(stop=["x"])),
    ({"prompt": "text"}, GREEDY),  # no tokenizer
    ({"prompt_token_ids": [3, 4]}, "not params"),
])
def test_a_bad_request_in_a_batch_leaves_the_engine_clean(bad, alone):
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name)
    e = llm.llm_engine
    e.add_request("running", {"prompt_token_ids": prompts[4]}, GREEDY)
    e.step()
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": prompts[3]}, bad[0], {"prompt_token_ids": prompts[2]}],
                     [GREEDY, bad[1], GREEDY], use_tqdm=False)
    assert e.num_requests == 1 and e.usage().num_slots_used == 1
    assert drive(e, {}) == {"running": [ref[4]]}
    assert run(llm, prompts[:3]) == ref[:3]
    assert_pools_empty(llm)


# ---------------------------------------------------------------- logprobs under recompute
# vLLM PR #8533 (prefill chunking of the mamba kernels), SGLang PR #1079 (chunked prefill
# feeding the wrong rows): prompt and sample logprobs assembled over chunks and recomputes

def test_logprobs_batched_chunked_and_preempted_equal_alone():
    name = "granite-moe"
    prompts = prompts_for(name)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    solo = make(name, max_num_seqs=1)
    ref = [solo.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]

    def flat(out):
        lps = [d for d in out.prompt_logprobs[1:]] + out.outputs[0].logprobs
        return [(t, lp.rank, lp.logprob) for d in lps for t, lp in d.items()]

    for kw in (dict(max_num_batched_tokens=5), dict(block_size=4, num_kv_blocks=12, max_model_len=48)):
        llm = make(name, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for o, r in zip(outs, ref):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
            got, want = flat(o), flat(r)
            assert [g[:2] for g in got] == [w[:2] for w in want]
            assert all(abs(g[2] - w[2]) < 1e-4 for g, w in zip(got, want))
        assert_pools_empty(llm)


# ---------------------------------------------------------------- streaming
# SGLang #11048 (n > 1 behaviour changing between versions), vLLM PR #10980 (parallel sampling
# in the streaming engine)

def test_streaming_outputs_grow_and_end_as_generate(alone):
    name = "bamba"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name, max_num_batched_tokens=7)
    e = llm.llm_engine
    n2 = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(f"s{i}", {"prompt_token_ids": p}, n2 if i % 2 else GREEDY)
    seen, finished = {}, {}
    while e.has_unfinished_requests():
        for out in e.step():
            assert out.request_id not in finished, "output after the request finished"
            toks = [c.token_ids for c in out.outputs]
            for k, t in enumerate(toks):
                prev = seen.get((out.request_id, k), [])
                assert t[: len(prev)] == prev and len(t) <= 10
                seen[(out.request_id, k)] = t
            if out.finished:
                assert all(c.finish_reason == "length" for c in out.outputs)
                finished[out.request_id] = toks
    assert finished == {f"s{i}": [ref[i]] * (2 if i % 2 else 1) for i in range(len(prompts))}
    assert_pools_empty(llm)


# ---------------------------------------------------------------- everything at once

def _random_params(rng):
    kw = dict(max_tokens=rng.choice([1, 2, 5, 10, None]), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1000), top_k=rng.choice([0, 5, 50]),
                  top_p=rng.choice([1.0, 0.8]))
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.7, 1.5])
    if rng.random() < 0.3:
        kw["presence_penalty"] = 1.0
    if rng.random() < 0.3:
        kw["stop_token_ids"] = rng.sample(range(3, 100), 8)
    if rng.random() < 0.3 and kw["max_tokens"] not in (None, 1):
        kw["min_tokens"] = rng.randint(1, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    return SamplingParams(**kw)


@pytest.mark.parametrize("name", ["granite-moe", "zamba2"])
def test_random_workload_equals_each_request_alone(name):
    """Requests with random prompts and sampling params (greedy or seeded, penalties, stop
    tokens, min_tokens, logprobs, no max_tokens) arrive at random steps into an engine with a
    small budget, few state slots and a KV pool that forces preemption; some are aborted. Each
    finished one must equal its request run alone; the pools must end empty. A fresh seed per
    run (printed on failure)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    vocab = hf_model(name).config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 3, 4, 7, 8, 9, 17, 30)]
    solo = make(name, max_num_seqs=1, max_model_len=48)
    llm = make(name, max_model_len=48, max_num_batched_tokens=rng.randint(1, 12), block_size=4, num_kv_blocks=12,
               num_state_slots=rng.randint(2, 6), async_scheduling=rng.random() < 0.7)
    e = llm.llm_engine
    live, step = {}, 0
    while step < 40 or e.has_unfinished_requests():
        assert step < 600, f"seed {seed}: no progress"
        if step < 40 and rng.random() < 0.4:
            live[f"r{step}"] = (rng.randrange(len(prompts)), _random_params(rng))
            e.add_request(f"r{step}", {"prompt_token_ids": prompts[live[f"r{step}"][0]]}, live[f"r{step}"][1])
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            assert e.abort_request(rid)
            del live[rid]
        for out in e.step():
            if out.finished:
                i, params = live.pop(out.request_id)
                want = solo.generate({"prompt_token_ids": prompts[i]}, params, use_tqdm=False)[0].outputs[0]
                got = out.outputs[0]
                assert (got.token_ids, got.finish_reason, got.stop_reason) == \
                    (want.token_ids, want.finish_reason, want.stop_reason), f"seed {seed}, {params}"
                if params.logprobs is not None:
                    assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs], f"seed {seed}"
        step += 1
    assert not live
    assert_pools_empty(llm)


def test_sampling_params_changed_after_submission_do_not_reach_the_request(alone):
    """vLLM PR #2881 (defensively copy sampling params): a caller that reuses and changes its
    SamplingParams object while a request runs must not change that request; a field set to
    nonsense after creation is refused when the request is added, leaving the engine clean."""
    name = "granite-moe"
    prompts, ref = prompts_for(name), alone(name)
    llm = make(name)
    e = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    e.add_request("a", {"prompt_token_ids": prompts[3]}, params)
    e.step()
    params.max_tokens, params.temperature = 2, 1.0
    params.stop_token_ids.append(ref[3][4])
    e.add_request("b", {"prompt_token_ids": prompts[2]}, params)
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request("c", {"prompt_token_ids": prompts[1]}, params)
    done = drive(e, {})
    assert done["a"] == [ref[3]] and len(done["b"][0]) <= 2
    assert_pools_empty(llm)


# ---------------------------------------------------------------- start-up warm-up
@pytest.mark.parametrize("name", ["granite-moe", "zamba2"])
def test_attention_warm_up_leaves_nothing_a_request_sees(name):
    """Reports: the second identical request slower than the first (prefix caching). A prompt
    resumed from a long cached prefix met a new attention kernel variant (short tiles, split
    context) and compiled it in its step; the GPU engine now runs those variants at start-up
    (`engine.warm_up.warm_up_attention`), in the scratch slot and blocks of the empty pool. Outputs
    after it, with caching on and a repeated prompt, are those of an engine without it."""
    prompts = prompts_for(name, lens=(30, 9, 30))
    plain = make(name, enable_prefix_caching=True, mamba_block_size=8, block_size=4)
    warmed = make(name, enable_prefix_caching=True, mamba_block_size=8, block_size=4)
    runner = warmed.llm_engine.runner
    batches = warm_up_attention(runner)
    assert batches and any(n > q for q, n in batches)  # a split-context batch among them
    assert all(n <= runner.max_model_len for _, n in batches)
    assert run(warmed, prompts) == run(plain, prompts)
    assert_pools_empty(warmed)
