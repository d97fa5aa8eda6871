"""Speculative decoding end to end: greedy outputs with drafts verified equal outputs without,
token for token, for every family; the rejection sampler keeps the target distribution.

Random tiny checkpoints rarely repeat themselves, so n-gram drafts seldom hit; an oracle
proposer (the reference run's own continuation, with some drafts corrupted) makes every
acceptance length happen, and the n-gram proposer runs on repetitive prompts too."""

import pytest
import torch

from mambaserve import SamplingParams
from mambaserve.engine.rejection_sampler import verify_drafts
from mambaserve.engine.sampler import Sampler
from mambaserve.engine.sequence import Sequence
from tests.engine import engines
from tests.engine.engines import EVERY_FAMILY, run
from tests.models.tiny import hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make(name, **kw):
    """engines.make with a small cache budget: this file builds many engines."""
    kw.setdefault("cpu_cache_bytes", 1 << 26)
    return engines.make(name, **kw)


@pytest.fixture(autouse=True)
def _collect():
    """Free each test's engines at once (a wrapped runner method is a reference cycle)."""
    yield
    import gc

    gc.collect()


def ngram(k, lo=1, hi=3):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi, "prompt_lookup_min": lo}


def spec_prompts(name, seed=0):
    """Repetitive prompts (n-gram hits), random ones (misses), lengths 1 to 40."""
    g = torch.Generator().manual_seed(seed)
    vocab = hf_model(name).config.vocab_size
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    motif = rnd(5)
    return [motif * 6, rnd(1), rnd(17), motif * 3 + rnd(2) + motif, rnd(40)]


def oracle(llm, prompts, refs, corrupt_every=3, skip=lambda p: len(p) == 1):
    """Make the engine's proposer propose the reference continuation, the draft at position
    (step % k) replaced by a wrong token every `corrupt_every` steps; sequences whose prompt
    `skip` picks propose nothing (plain decodes beside the verifying ones)."""
    spec = llm.llm_engine.spec
    by_prompt = {tuple(p): r for p, r in zip(prompts, refs)}
    vocab = llm.llm_engine.vocab_size
    calls = [0]

    def propose(seq, k):
        if skip(seq.prompt_token_ids):
            return []
        calls[0] += 1
        drafts = list(by_prompt[tuple(seq.prompt_token_ids)][seq.num_output_tokens : seq.num_output_tokens + k])
        if drafts and calls[0] % corrupt_every == 0:
            j = calls[0] % len(drafts)
            drafts[j] = (drafts[j] + 1) % vocab
        return drafts

    spec._propose = propose
    return spec


# (family, k): every family, each k of 1, 3, 5 on several of them
CASES = [("granite-moe", 3), ("bamba", 1), ("mamba2-untied", 5), ("falcon-h1", 3), ("jamba", 5),
         ("zamba2", 1), ("nemotron-h-moe", 3), ("mamba1", 5)]


@pytest.mark.parametrize("name,k", CASES)
def test_greedy_equal_with_oracle_and_ngram_drafts(name, k):
    prompts = spec_prompts(name)
    refs = run(make(name, enable_prefix_caching=False), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(k), block_size=4, mamba_block_size=8)
    spec = oracle(llm, prompts, refs)
    # twice: the second pass hits the prefix cache the first one filled
    assert run(llm, prompts, GREEDY) == refs
    assert run(llm, prompts, GREEDY) == refs
    st = spec.stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert llm.llm_engine.usage().prefix_cache_hits > 0
    del spec._propose  # the n-gram proposer itself
    assert run(llm, prompts, GREEDY) == refs


def test_metrics_match_outputs():
    name, k = "bamba", 3
    prompts = spec_prompts(name)
    refs = run(make(name), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(k))
    spec = oracle(llm, prompts, refs)
    steps = [0]
    inner = llm.llm_engine.runner.execute

    def counted(scheduled, *a):
        steps[0] += sum(1 for s in scheduled if s.seq.num_computed_tokens + s.num_new_tokens >= s.seq.num_tokens)
        return inner(scheduled, *a)

    llm.llm_engine.runner.execute = counted
    assert run(llm, prompts, GREEDY) == refs
    st = spec.stats
    # every sampling row emits one token; each accepted draft one more (max_tokens cuts the drafts, never them)
    assert sum(map(len, refs)) == steps[0] + st.num_accepted_tokens
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    assert all(a >= b for a, b in zip(st.num_accepted_tokens_per_pos, st.num_accepted_tokens_per_pos[1:]))
    assert len(st.num_accepted_tokens_per_pos) <= k


def test_ngram_proposer():
    from mambaserve.engine.spec_decode import NgramProposer

    p = NgramProposer(3, 1)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest match of the 3-gram
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 4) == [7, 1, 2, 3]
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 5) == [9, 1, 2, 3, 7]  # the latest followed by 5 drafts
    assert p.propose([1, 2, 3, 4, 5], 3) == []  # no n-gram recurs
    assert p.propose([5, 6, 5], 4) == [6, 5]  # 1-gram, cut at the end
    assert p.propose([7, 7, 7, 7, 7, 7], 3) == [7, 7, 7]  # a run: a whole continuation, not the stub at its end
    assert NgramProposer(3, 2).propose([5, 6, 7, 5], 4) == []  # too short a match
    assert p.propose([4], 2) == []


def _lookup_reference(tokens, k, n_max, n_min):
    """Prompt lookup by its definition, in plain Python: every earlier start of the last n tokens."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        hits = [s for s in range(total - n) if tokens[s:s + n] == tokens[total - n:]]
        if hits:
            full = [s for s in hits if s + n + k <= total]
            start = (full[-1] if full else hits[0]) + n
            return tokens[start:start + k]
    return []


def test_ngram_proposer_matches_its_definition_on_random_sequences():
    import random

    from mambaserve.engine.spec_decode import NgramProposer

    rng = random.Random(0)
    for _ in range(3000):
        n_min = rng.randint(1, 4)
        n_max = rng.randint(n_min, 6)
        tokens = [rng.randrange(rng.choice([2, 3, 6, 50])) for _ in range(rng.randint(1, 60))]
        k = rng.randint(1, 6)
        want = _lookup_reference(tokens, k, n_max, n_min)
        assert NgramProposer(n_max, n_min).propose(tokens, k) == want, (tokens, k, n_max, n_min)


def test_token_array_grows_with_the_sequence():
    from mambaserve.engine.sequence import Sequence
    from mambaserve.engine.spec_decode import _TokenArray

    seq = Sequence("r", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=50))
    arr = _TokenArray()
    assert arr.of(seq).tolist() == [5, 6, 7]
    for t in range(8, 40):
        seq.output_token_ids.append(t)
        assert arr.of(seq).tolist() == seq.all_token_ids


@pytest.mark.parametrize("spec", [
    {"method": "medusa", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5},
    {"method": "draft_model", "num_speculative_tokens": 2},
    {"num_speculative_tokens": 2},
    "ngram",
])
def test_bad_speculative_config(spec):
    from mambaserve.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(spec)


def test_speculative_config_defaults_and_cli():
    import argparse

    from mambaserve.config import SpeculativeConfig
    from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args

    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (3, 3)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{bad"])


def _seq(params):
    return Sequence("r", prompt_token_ids=[1, 2], sampling_params=params)


def _chi_square(counts, probs):
    n = counts.sum()
    keep = probs * n > 0
    return float((((counts - n * probs) ** 2)[keep] / (n * probs)[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampler_keeps_target_distribution(with_q):
    """First emitted token over many draws vs the target p_0, for a point-mass draft (n-gram)
    and for a draft drawn from a distribution q recorded for the sampler."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.randn(2, vocab) * 1.5  # rows of one sequence with one draft + the bonus row
    params = SamplingParams(temperature=0.8, top_k=5)
    sampler = Sampler(None)
    p0 = torch.softmax(sampler.adjusted_logits(logits, [_seq(params)] * 2)[0] / 0.8, -1)
    p0[p0 < p0.sort().values[1]] = 0  # top-k 5 of 6: the smallest drops
    p0 = p0 / p0.sum()
    q = torch.softmax(torch.randn(vocab), -1)
    seqs = [_seq(params) for _ in range(n)]
    drafts = ([[int(torch.multinomial(q, 1))] for _ in range(n)] if with_q else [[int(p0.argmin() + 1) % vocab]] * n)
    out = verify_drafts(sampler, logits.repeat(n, 1), seqs, drafts, [q[None]] * n if with_q else None)
    first = torch.bincount(torch.tensor([toks[0] for toks, _ in out]), minlength=vocab).double()
    stat, dof = _chi_square(first, p0.double())
    assert stat < 30.0 + 3 * dof, (first / n, p0)  # far above chance only when the law is wrong
    assert first[p0 == 0].sum() == 0


def test_greedy_rejection_sampler_rows():
    sampler = Sampler(None)
    logits = torch.full((4, 5), -5.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 4] = 5.0  # argmax: 2, 3, 1, 4
    seqs = [_seq(SamplingParams(temperature=0.0, logprobs=1))]
    (tokens, lps), = verify_drafts(sampler, logits, seqs, [[2, 3, 0]])
    assert tokens == [2, 3, 1]
    assert [next(iter(d)) for d in lps] == tokens and lps[0][2].rank == 1
    (tokens, _), = verify_drafts(sampler, logits, seqs, [[2, 3, 1]])
    assert tokens == [2, 3, 1, 4]  # all accepted: the bonus token


def test_cases_cover_every_family():
    assert {n for n, _ in CASES} == set(EVERY_FAMILY) and {k for _, k in CASES} == {1, 3, 5}


@pytest.mark.parametrize("name", ["bamba", "jamba"])
def test_chunked_prefill_preemption_n_and_piecewise(name):
    """A small step budget (chunked prompts, drafts cut to the budget left), a KV pool that
    forces preemptions, n = 2, and the piecewise runner's padding (eager stand-in)."""
    from tests.engine.engines import EagerPiecewise

    prompts = spec_prompts(name, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    kw = dict(max_num_batched_tokens=12, block_size=4, num_kv_blocks=16, mamba_block_size=8, max_model_len=64)
    refs = run(make(name, enable_prefix_caching=False), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(4), **kw)
    runner = llm.llm_engine.runner
    runner.piecewise_graphs = EagerPiecewise(runner.model)
    spec = oracle(llm, prompts, refs, skip=lambda p: False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in refs]
    assert llm.llm_engine.usage().preemptions > 0 and spec.stats.num_accepted_tokens > 0


def test_stops_inside_accepted_tokens_and_logprobs():
    """max_tokens and a stop token falling inside a step's accepted drafts cut the output
    there; logprobs of accepted tokens are the plain run's."""
    name = "granite-moe"
    prompts = spec_prompts(name)
    refs = run(make(name), prompts, GREEDY)
    stop = [refs[i][6] for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=7 + i, ignore_eos=True, stop_token_ids=[stop[i]],
                             logprobs=2) for i in range(len(prompts))]
    plain = make(name).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make(name, speculative_config=ngram(5))
    spec = oracle(llm, prompts, refs, corrupt_every=4, skip=lambda p: False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert spec.stats.num_accepted_tokens > 0
    for a, b in zip(plain, outs):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
        assert len(b.logprobs) == len(b.token_ids)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            for t in da:
                assert abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank


def test_async_scheduling_does_not_chain_while_speculating():
    from tests.engine.engines import count_chained

    name = "mamba2-untied"
    prompts = spec_prompts(name)
    refs = run(make(name), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(2), async_scheduling=True)
    calls = count_chained(llm)
    oracle(llm, prompts, refs)
    assert run(llm, prompts, GREEDY) == refs and calls[0] == 0


@pytest.mark.slow
def test_sampled_outputs_keep_the_distribution():
    """Joint histogram of the second and third output tokens (verified with a draft: the first
    one comes from the prefill)
    over many seeded requests, with and without speculation: a two-sample chi-square test.
    allowed_token_ids makes the vocabulary 4 tokens; the oracle drafts a fixed token."""
    name = "bamba"
    prompt = spec_prompts(name)[2]
    allowed = [5, 9, 14, 20]
    n = 600
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s, allowed_token_ids=allowed)
              for s in range(n)]

    def hist(llm):
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        h = torch.zeros(len(allowed) ** 2, dtype=torch.float64)
        for o in outs:
            _, a, b = o.outputs[0].token_ids
            h[allowed.index(a) * len(allowed) + allowed.index(b)] += 1
        return h

    plain = hist(make(name, max_num_seqs=64))
    llm = make(name, max_num_seqs=64, speculative_config=ngram(1))
    llm.llm_engine.spec._propose = lambda seq, k: [allowed[1]]
    spec = hist(llm)
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 0
    keep = (plain + spec) > 0
    stat = float((((plain - spec) ** 2)[keep] / (plain + spec)[keep]).sum())
    dof = int(keep.sum()) - 1
    assert stat < dof + 4 * (2 * dof) ** 0.5 + 10, (plain, spec)


def test_stats_line_and_prometheus_counters():
    from mambaserve.engine.stat_logger import StatLogger
    from mambaserve.entrypoints.metrics import SPEC_DECODE_METRICS, ServerMetrics

    name = "bamba"
    prompts = spec_prompts(name)
    refs = run(make(name), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(3))
    oracle(llm, prompts, refs)
    metrics = ServerMetrics("m")
    metrics.update_engine(llm.llm_engine.usage())
    assert b"spec_decode" not in metrics.render()  # nothing drafted yet
    assert run(llm, prompts, GREEDY) == refs
    usage = llm.llm_engine.usage()
    st = usage.spec_decode
    assert st == llm.llm_engine.spec.stats and st is not llm.llm_engine.spec.stats  # a snapshot
    metrics.update_engine(usage)
    text = metrics.render().decode()
    for metric in SPEC_DECODE_METRICS:
        assert metric + "_total{" in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(st.num_accepted_tokens)}' in text
    pos0 = float(st.num_accepted_tokens_per_pos[0])
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {pos0}' in text
    line = StatLogger(interval=0.0).maybe_log(llm.llm_engine.usage)
    rate = 100.0 * st.num_accepted_tokens / st.num_draft_tokens
    assert f"Spec decode: draft acceptance rate {rate:.1f}%" in line
    assert f"mean acceptance length {1 + st.num_accepted_tokens / st.num_drafts:.2f}" in line


def test_forced_acceptance_benchmark_tool(monkeypatch):
    """MAMBASERVE_SPEC_FORCE_ACCEPT (benchmarks only): 70% of the drafts accepted on average."""
    monkeypatch.setenv("MAMBASERVE_SPEC_FORCE_ACCEPT", "0.7")
    llm = make("bamba", speculative_config=ngram(4))
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    outs = run(llm, spec_prompts("bamba")[:2], params)
    st = llm.llm_engine.spec.stats
    assert [len(o) for o in outs] == [41, 41] and st.num_drafts >= 2 * 40 // 5
    assert abs(st.num_accepted_tokens / st.num_draft_tokens - 0.7) < 0.05
    monkeypatch.setenv("MAMBASERVE_SPEC_FORCE_ACCEPT", "2")
    with pytest.raises(ValueError, match="MAMBASERVE_SPEC_FORCE_ACCEPT"):
        make("bamba", speculative_config=ngram(4))


@pytest.mark.slow
def test_spec_decode_benchmark_smoke(tmp_path, monkeypatch):
    import importlib.util
    import json
    from pathlib import Path

    from tests.models.tiny import checkpoint

    spec = importlib.util.spec_from_file_location(
        "spec_decode_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "spec_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("MAMBASERVE_COMMIT", "abc123")
    out = tmp_path / "sd.json"
    assert bench.main(["--smoke", "--models", checkpoint("bamba"), "--load-format", "auto", "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["commit"] == "abc123" and rec["environment"]["gpu"] == "cpu"
    acc = rec["acceptance"]
    assert acc["outputs_equal"] and acc["num_drafts"] > 0 and acc["tokens_per_step_spec"] >= 1.0
    assert [c["batch_size"] for c in rec["cost"]] == [1, 2]
    for c in rec["cost"]:
        assert abs(c["acceptance_rate"] - 0.7) < 0.1 and c["tokens_per_step_spec"] > 2.0
        assert c["verify_step_ms"] > 0 and c["decode_step_ms"] > 0


@pytest.mark.parametrize("target,drafter", [("mamba2-untied", "mamba2-untied"), ("jamba", "granite-dense-rope")])
def test_draft_model_greedy_equal(target, drafter):
    """A draft model: the target itself (nearly every draft accepted) and a model of another
    family with the same vocabulary (few); chunked prompts, preemptions, prefix caching on."""
    from tests.models.tiny import checkpoint

    prompts = spec_prompts(target)
    refs = run(make(target, enable_prefix_caching=False), prompts, GREEDY)
    spec = {"method": "draft_model", "model": checkpoint(drafter), "num_speculative_tokens": 3}
    llm = make(target, speculative_config=spec, max_num_batched_tokens=16, block_size=4, mamba_block_size=8,
               num_kv_blocks=24, max_model_len=64)
    assert run(llm, prompts, GREEDY) == refs
    assert run(llm, prompts, GREEDY) == refs
    st = llm.llm_engine.spec.stats
    assert st.num_drafts > 0
    if target == drafter:
        assert st.num_accepted_tokens > 0.9 * st.num_draft_tokens
    drafter_pools = llm.llm_engine.spec.drafter
    drafter_pools.propose([])  # nothing runs: every shadow is released
    assert drafter_pools.slots.num_used == 0 and (drafter_pools.blocks is None or drafter_pools.blocks.num_used == 0)


def test_draft_model_vocabulary_must_match():
    from tests.models.tiny import checkpoint

    spec = {"method": "draft_model", "model": checkpoint("bamba"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary"):
        make("jamba", speculative_config=spec)


def test_prompt_tokens_and_step_kinds_not_skewed_by_drafts():
    name = "bamba"
    prompts = spec_prompts(name)
    refs = run(make(name), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(3), enable_prefix_caching=False)
    oracle(llm, prompts, refs, corrupt_every=1)  # a rejection every step: accepted < drafted
    assert run(llm, prompts, GREEDY) == refs
    usage = llm.llm_engine.usage()
    assert usage.prompt_tokens == sum(map(len, prompts))
    assert usage.generation_tokens == sum(map(len, refs))
    kinds = {k.split("/")[1] for k in usage.step_breakdown}
    assert "decode" in kinds


def test_requests_without_drafts_are_told_once(caplog):
    """A request speculation cannot speed up (penalties, min_tokens) is served as before, and
    the log says once per reason why it got no drafts (nothing about it is ignored silently)."""
    name = "bamba"
    prompts = spec_prompts(name)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
    refs = run(make(name), prompts, params)
    llm = make(name, speculative_config=ngram(2))
    with caplog.at_level("INFO", logger="mambaserve"):
        assert run(llm, prompts, params) == refs
        assert llm.llm_engine.spec.stats.num_drafts == 0
        run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=4))
    told = [r.getMessage() for r in caplog.records if "proposes no drafts" in r.getMessage()]
    assert len(told) == 2 and "penalties" in told[0] and "min_tokens" in told[1], told
