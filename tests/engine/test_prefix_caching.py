"""Prefix caching end to end on tiny random checkpoints (CPU, float32): greedy outputs with
caching on equal caching off token for token for every family, and the cached-token counts are
the ones the rules give (state checkpoints every 8 tokens, KV blocks of 4).

The reference is the same model with enable_prefix_caching=False (outputs depend only on the
prompt: batching, chunking and preemption are tested against each other in test_engine.py).
"""

import random

import pytest
import torch

from mambaserve import LLM, SamplingParams
from tests.engine.engines import EVERY_FAMILY as FAMILIES
from tests.models.tiny import checkpoint, hf_model

ATTENTION = {"granite-moe", "bamba", "falcon-h1", "jamba", "zamba2", "nemotron-h-moe"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
M = 8  # mamba_block_size of these tests; KV blocks of 4 tokens


def make(name, **kw):
    kw = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "block_size": 4, "mamba_block_size": M,
          **kw}
    return LLM(checkpoint(name), **kw)


def generate(llm, prompts, params=GREEDY, outputs=None):
    """Run prompts as one batch: (token ids of each request's completions, num_cached_tokens of
    each request's sequences); `outputs`, a list, gets the RequestOutputs."""
    engine = llm.llm_engine
    rids, seqs, done = [], {}, {}
    for p in prompts:
        rid = engine.add_request(None, {"prompt_token_ids": p}, params, final_only=True)
        seqs[rid] = list(engine.output_processor.requests[rid].seqs)
        rids.append(rid)
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
    if outputs is not None:
        outputs.extend(done[r] for r in rids)
    return ([[c.token_ids for c in done[r].outputs] for r in rids],
            [[s.num_cached_tokens for s in seqs[r]] for r in rids])


_REFERENCE: dict = {}


def reference(name, prompts, params=GREEDY):
    """Completions with caching off (one engine per family, kept)."""
    if name not in _REFERENCE:
        _REFERENCE[name] = make(name, enable_prefix_caching=False)
    return generate(_REFERENCE[name], prompts, params)[0]


def tokens_of(name, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = hf_model(name).config.vocab_size
    return lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()


def check(llm, name, prompts, params=GREEDY):
    """Generate with caching on, assert equal to caching off; returns num_cached_tokens per request."""
    out, cached = generate(llm, prompts, params)
    assert out == reference(name, prompts, params)
    return cached


def assert_stats_match(llm, cached_lists, num_prompt_tokens):
    stats = llm.llm_engine.scheduler.prefix_cache_stats
    assert stats.hits == sum(sum(c) for c in cached_lists)
    assert stats.queries == num_prompt_tokens


@pytest.mark.parametrize("name", FAMILIES)
def test_caching_on_equals_off_and_hits_where_the_rules_say(name):
    llm = make(name)
    toks = tokens_of(name, 1)
    cached, queried = [], 0

    def run(prompts, params=GREEDY):
        nonlocal queried
        c = check(llm, name, prompts, params)
        cached.extend(c)
        queried += sum(len(p) for p in prompts) * params.n
        return c

    # a shared system prompt with different user turns: the second takes the branch point, the third hits
    system = toks(21)
    assert [run([system + toks(n)]) for n in (5, 9, 3)] == [[[0]], [[0]], [[16]]]
    # a conversation re-sending its history (prompt + answer + a new user turn) every turn
    history = toks(13)
    hits = []
    for _ in range(3):
        out = reference(name, [history])[0][0]
        hits += run([history])[0]
        history = history + out + toks(6)
    assert hits == [0, 8, 24]
    # prefixes of an earlier prompt ending inside a block, on a boundary, one token after
    x = toks(33)
    assert run([x]) == [[0]]

    def tail(avoid):  # 5 tokens that leave x at once
        t = toks(5)
        t[0] = t[0] + 1 if t[0] == avoid else t[0]
        return t

    assert [run([x[:k] + tail(x[k])])[0][0] for k in (15, 16, 17)] == [0, 8, 16]
    # entirely cached prompts: all but the tail after the last boundary before the last token
    assert [run([x[:n]])[0][0] for n in (33, 16, 17, 25)] == [32, 8, 16, 16]
    # the same prompt twice in one batch: the second waits a step for the first one's checkpoint
    y = toks(19)
    assert run([y, y]) == [[0], [16]] and run([y]) == [[16]]
    # n = 2, seeded sampling: the first sibling resumes from the system prompt's checkpoint, the
    # second waits a step for the first one's checkpoint at its last boundary
    assert run([system + toks(4)], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6)) == [[16, 24]]
    assert_stats_match(llm, cached, queried)
    # prompt logprobs need every prompt row: such a request matches nothing and gets caching off's values
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    on, off = [], []
    out, c = generate(llm, [x], params, outputs=on)
    generate(_REFERENCE[name], [x], params, outputs=off)
    assert c == [[0]] and out == [[o.token_ids for o in r.outputs] for r in off]
    for a, b in zip(on[0].prompt_logprobs[1:], off[0].prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # reset: nothing is served afterwards
    assert llm.llm_engine.scheduler.reset_prefix_cache()
    assert check(llm, name, [x]) == [[0]]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_budgets(name, budget):
    llm = make(name, max_num_batched_tokens=budget)
    toks = tokens_of(name, 2)
    system, x = toks(19), toks(26)
    first = check(llm, name, [system + toks(6), system + toks(3), x])
    second = check(llm, name, [system + toks(9), x, x[:17] + toks(2)])
    # the second request's branch point made a checkpoint at 16 of the system prompt; x's last boundary
    # is 24; x[:17] + 2 could resume at 16 only, where x has no checkpoint (it takes one now)
    assert first == [[0], [0], [0]] and second == [[16], [24], [0]]


@pytest.mark.parametrize("name", FAMILIES)
def test_evictions_under_a_small_pool(name):
    kw = {"num_state_checkpoints": 2, "max_model_len": 48}
    if name in ATTENTION:
        kw["num_kv_blocks"] = 16  # one longest sequence needs 12
    llm = make(name, **kw)
    toks = tokens_of(name, 3)
    system = toks(18)
    prompts = [system + toks(n) for n in (4, 7, 2, 9)] + [toks(20) for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cached = check(llm, name, prompts, params)  # one batch: two checkpoints pending at most, the rest not taken
    # one by one: each new checkpoint evicts the least recently used of the two
    cached += [check(llm, name, [p], params)[0] for p in prompts[::-1] + prompts[:2]]
    assert sum(sum(c) for c in cached) > 0
    assert llm.llm_engine.scheduler.prefix_cache.checkpoints.num_cached <= 2
    if name in ATTENTION:
        assert llm.llm_engine.usage().preemptions > 0
    assert_stats_match(llm, cached, sum(map(len, prompts + prompts[::-1] + prompts[:2])))


@pytest.mark.parametrize("name", FAMILIES)
def test_preemption_and_abort_of_a_request_whose_prefix_others_share(name):
    kw = {"max_model_len": 64}
    if name in ATTENTION:
        kw["num_kv_blocks"] = 20
    llm = make(name, **kw)
    engine = llm.llm_engine
    toks = tokens_of(name, 4)
    system = toks(17)
    warm = system + toks(3)
    check(llm, name, [warm, warm[:17] + toks(2)])  # the system prompt's checkpoint at 16 exists now
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [system + toks(n) for n in (6, 5, 8, 4)]
    seqs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, long, final_only=True)
        seqs[i] = engine.output_processor.requests[f"r{i}"].seqs[0]
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step()})
    assert engine.abort_request("r0")
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert "r0" not in done
    assert [done[f"r{i}"].outputs[0].token_ids for i in (1, 2, 3)] == [r[0] for r in reference(name, prompts[1:], long)]
    assert [seqs[i].num_cached_tokens for i in range(4)] == [16] * 4  # kept as first set, preempted or not
    if name in ATTENTION:
        assert engine.usage().preemptions > 0
    # the aborted request's prompt again: still served from what it and the others left cached
    assert check(llm, name, [prompts[0]], long)[0][0] >= 16
    usage = engine.usage()
    assert usage.num_slots_used == 0 and usage.num_blocks_used == 0 and usage.num_running == 0


@pytest.mark.parametrize("name", ["granite-moe", "mamba2-untied", "jamba"])
def test_async_scheduling_off(name):
    llm = make(name, async_scheduling=False)
    toks = tokens_of(name, 5)
    system = toks(20)
    # the first one's last boundary (16) lies inside the system prompt: the next ones resume there
    assert [check(llm, name, [system + toks(n)])[0][0] for n in (3, 5, 7)] == [0, 16, 16]


def test_mamba_block_size_must_be_a_multiple_of_the_block_size_with_attention():
    with pytest.raises(ValueError, match="multiple of block_size"):
        make("granite-moe", mamba_block_size=6)
    make("mamba2-untied", mamba_block_size=6)  # no attention: any granularity


def test_default_granularity_long_repeat_and_a_300_token_system_prompt():
    """At the defaults (checkpoints every 256 tokens, KV blocks of 16): the first repeat of a
    2,000-token prompt resumes at 1,792 (floor(1,999 / 256) * 256), and a 300-token system prompt
    with a short user turn is resumed at 256 by the next request already."""
    name = "granite-moe"
    llm = LLM(checkpoint(name), dtype="float32", device="cpu", skip_tokenizer_init=True)
    toks = tokens_of(name, 6)
    long, system = toks(2000), toks(300)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert check(llm, name, [long], params) == [[0]] and check(llm, name, [long], params) == [[1792]]
    assert [check(llm, name, [system + toks(n)], params)[0][0] for n in (20, 45)] == [0, 256]


@pytest.mark.parametrize("name", ["bamba", "jamba"])
def test_checkpoints_inside_a_chunk_for_mamba2_layers_chunk_ends_for_mamba1(name):
    """Mamba2 layers write a checkpoint inside the prefill chunk (one step for the prompt);
    a model with Mamba-1 layers ends the chunk there instead. Both resume exactly."""
    llm = make(name)
    sched = llm.llm_engine.scheduler
    inner = name != "jamba"
    assert sched.min_inner_save_offset == (3 if inner else None)
    steps = []
    schedule = sched.schedule
    sched.schedule = lambda: steps.append(schedule()) or steps[-1]
    prompt = tokens_of(name, 7)(21)  # checkpoint at 16, the last boundary before the last token
    check(llm, name, [prompt])
    first = steps[0].scheduled[0]
    assert first.num_new_tokens == (21 if inner else 16)
    assert [o for o, _ in first.inner_saves] == ([16] if inner else [])
    assert check(llm, name, [prompt + tokens_of(name, 8)(3)]) == [[16]]


@pytest.mark.parametrize("name", ["granite-moe", "mamba2"])
def test_cache_salt_shares_only_among_requests_with_the_same_salt(name):
    """vLLM's cache_salt: a salted request never resumes from another salt's (or no salt's)
    prefix and its own prefix serves only its salt; outputs equal caching off."""
    llm, new = make(name), tokens_of(name, 11)
    prompt = new(30)
    engine = llm.llm_engine

    def run(salt):
        req = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt is not None else {})}
        rid = engine.add_request(None, req, GREEDY, final_only=True)
        seq = engine.output_processor.requests[rid].seqs[0]
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.finished), out)
        return out.outputs[0].token_ids, seq.num_cached_tokens

    want = reference(name, [prompt])[0][0]
    runs = [run(s) for s in (None, "tenant-a", "tenant-a", "tenant-b", None, "tenant-b")]
    assert all(tokens == want for tokens, _ in runs)
    assert [cached for _, cached in runs] == [0, 0, 24, 0, 24, 24]


@pytest.mark.parametrize("name", ["mamba2", "mamba1"])
def test_a_step_that_fails_leaves_no_checkpoint_behind(name):
    """A step that raises never wrote the checkpoint rows it reserved: once its request is aborted
    (as the server does), the same prompt must not resume from them. Models without attention
    match on checkpoints alone; logprobs compared with caching off (greedy tokens could agree)."""
    llm = make(name)
    engine = llm.llm_engine
    prompt = tokens_of(name, random.randrange(1 << 30))(5 * M + 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    real, calls = engine.runner.execute, []

    def fails_first(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kw)

    engine.runner.execute = fails_first
    engine.add_request("failed", {"prompt_token_ids": prompt}, params)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.abort_request("failed")
    got, want = [], []
    for _ in range(2):  # the repeat resumes from the checkpoints the second run wrote
        generate(llm, [prompt], params, got)
    generate(make(name, enable_prefix_caching=False), [prompt], params, want)
    assert got[1].num_cached_tokens > 0
    for out in got:
        lps = [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in (out.outputs[0], want[0].outputs[0])]
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(lps[0]), torch.tensor(lps[1]), rtol=0, atol=1e-4)
