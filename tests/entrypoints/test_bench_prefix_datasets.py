"""The prefix-sharing benchmark datasets (prefix_repetition, multi_turn), `bench serve
--dataset multi_turn` against a fake streaming server, and benchmarks/prefix_caching.py's
smoke run on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mambaserve.benchmarks.datasets import (
    build_requests,
    multi_turn_conversations,
    next_turn_prompt,
    prefix_repetition_requests,
    stand_in_answer,
)
from mambaserve.entrypoints.cli import main
from tests.entrypoints.fake_openai_server import FakeOpenAIServer

VOCAB = 97


def test_prefix_repetition_shape():
    reqs = prefix_repetition_requests(11, 7, 5, 3, 4, VOCAB, seed=3)
    assert len(reqs) == 11 and all(r.prompt_len == len(r.prompt) == 12 and r.output_len == 4 for r in reqs)
    prefixes = [tuple(r.prompt[:7]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 4, 4]  # 3 prefixes, 11 requests
    assert len({tuple(r.prompt[7:]) for r in reqs}) == 11  # each its own suffix
    assert prefixes != sorted(prefixes, key=prefixes.index)  # shuffled, not grouped
    assert all(0 <= t < VOCAB for r in reqs for t in r.prompt)
    assert [r.prompt for r in reqs] == [r.prompt for r in build_requests(
        "prefix_repetition", 11, vocab_size=VOCAB, seed=3, prefix_len=7, suffix_len=5, num_prefixes=3,
        prefix_output_len=4)]
    for bad in ({"num_prefixes": 12}, {"num_prefixes": 0}, {"prefix_len": 0}):
        kw = {"prefix_len": 7, "num_prefixes": 3} | bad
        with pytest.raises(ValueError, match="prefix-repetition"):
            prefix_repetition_requests(11, kw["prefix_len"], 5, kw["num_prefixes"], 4, VOCAB)


def test_multi_turn_shape():
    convs = multi_turn_conversations(3, 4, 10, 3, 2, VOCAB, seed=1)
    for c in convs:
        assert c.num_turns == 4 and len(c.history) == 10 and all(len(u) == 3 for u in c.user_turns)
        prompt = c.first_prompt()
        assert prompt == c.history + c.user_turns[0]
        for k in range(1, 4):
            answer = stand_in_answer(0, k - 1, c.output_len, VOCAB)
            nxt = next_turn_prompt(prompt, answer, c.user_turns[k])
            assert nxt[:len(prompt)] == prompt and nxt[len(prompt):len(prompt) + 2] == answer
            assert len(nxt) == 10 + (k + 1) * 3 + k * 2
            prompt = nxt
    with pytest.raises(ValueError, match="bench serve"):
        build_requests("multi_turn", 3, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="multi-turn"):
        multi_turn_conversations(3, 0, 10, 3, 2, VOCAB)


def test_bench_serve_multi_turn(tmp_path, capsys):
    out = tmp_path / "mt.json"
    n_conv, turns, prefix, user, answer = 3, 3, 9, 4, 5
    with FakeOpenAIServer(vocab_size=VOCAB) as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url, "--model", "fake-model", "--vocab-size", str(VOCAB),
                   "--dataset", "multi_turn", "--num-prompts", str(n_conv), "--multi-turn-num-turns", str(turns),
                   "--multi-turn-prefix-len", str(prefix), "--multi-turn-user-len", str(user),
                   "--multi-turn-output-len", str(answer), "--max-concurrency", "1", "--seed", "2",
                   "--disable-tqdm", "--output-json", str(out)])
        bodies = srv.bodies[1:]  # the first is the probe
    assert rc == 0
    assert "TTFT per turn" in capsys.readouterr().out
    convs = multi_turn_conversations(n_conv, turns, prefix, user, answer, VOCAB, seed=2)
    assert len(bodies) == n_conv * turns  # one conversation at a time: its turns in order
    for ci, conv in enumerate(convs):
        sent = [b["prompt"] for b in bodies[ci * turns:(ci + 1) * turns]]
        assert sent[0] == conv.first_prompt()
        for k in range(1, turns):  # turn k = turn k-1's prompt + its answer + the new user message
            assert sent[k] == sent[k - 1] + stand_in_answer(ci, k - 1, answer, VOCAB, 2) + conv.user_turns[k]
        assert all(b["max_tokens"] == answer for b in bodies)
    rec = json.loads(out.read_text())
    assert rec["completed"] == n_conv * turns and rec["failed"] == 0
    per_turn = rec["per_turn"]
    assert [t["turn"] for t in per_turn] == list(range(turns)) and all(t["completed"] == n_conv for t in per_turn)
    for t in per_turn:
        assert t["mean_prompt_len"] == prefix + (t["turn"] + 1) * user + t["turn"] * answer
        assert 0 < t["median_ttft_ms"] <= t["p99_ttft_ms"]
    # the fake server's stand-in cache: each later turn finds its previous prompt
    assert per_turn[0]["cached_tokens"] == 0
    assert per_turn[1]["cached_tokens"] == n_conv * (prefix + user)  # the answer part it has not seen
    assert rec["total_cached_tokens"] == sum(t["cached_tokens"] for t in per_turn)


@pytest.mark.slow
def test_prefix_caching_benchmark_smoke(tmp_path, monkeypatch):
    from tests.models.tiny import checkpoint

    spec = importlib.util.spec_from_file_location(
        "prefix_caching_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_caching.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("MAMBASERVE_COMMIT", "abc123")
    out = tmp_path / "pc.json"
    assert bench.main(["--smoke", "--models", checkpoint("granite-moe"), "--mamba-block-size", "16",
                       "--max-model-len", "256", "--mt-prefix-len", "40", "--mt-user-len", "5", "--mt-conversations",
                       "2", "--pr-prefix-len", "40", "--pr-requests", "4", "--sharegpt-prompts", "2",
                       "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["commit"] == "abc123" and rec["environment"]["gpu"] == "cpu" and len(rec["models"]) == 1
    m = rec["models"][0]
    for kind in ("on", "off"):
        mt = m["multi_turn"][kind]
        assert mt["requests"] == 2 * 3 and [t["turn"] for t in mt["per_turn"]] == [0, 1, 2]
        assert mt["per_turn"][1]["mean_prompt_len"] == 40 + 2 * 5 + 4  # turn 0's prompt + answer + user
        assert m["prefix_repetition"][kind]["requests"] == 4
        assert len(m["sharegpt_synthetic"][f"{kind}_runs"]) == 1
    assert m["multi_turn"]["off"]["cached_tokens"] == 0 and m["prefix_repetition"]["off"]["prefix_cache_hits"] == 0
    assert m["multi_turn"]["on"]["cached_tokens"] == m["multi_turn"]["on"]["prefix_cache_hits"]
    s = m["sharegpt_synthetic"]
    assert s["cost"] == pytest.approx(1 - s["on_median_output_tokens_per_s"] / s["off_median_output_tokens_per_s"])
    assert m["multi_turn"]["turn1_ttft_speedup_mean"] == pytest.approx(
        m["multi_turn"]["off"]["per_turn"][1]["mean_ttft_ms"] / m["multi_turn"]["on"]["per_turn"][1]["mean_ttft_ms"])
