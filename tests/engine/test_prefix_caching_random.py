"""Prefix caching under random engine shapes and traffic (CPU, float32): every output equals the
same request's alone on an engine with caching off, token for token.

Per family and seed an engine draws its step budget (3-64 tokens), checkpoint granularity
(4-16 tokens), async scheduling on or off, a KV or state pool small enough to preempt, a
max_num_seqs, and speculative decoding (none, n-gram or the model drafting for itself, k = 1
or 3); then three rounds of one to three prompts, each an exact repeat, an extension (a
conversation's next turn), a prefix of an earlier prompt, or a shared system prompt with a new
user turn, sometimes with its first prompt twice, sometimes with one request asking for prompt
logprobs, greedy or (without speculation) seeded sampling with n = 2.
"""

import random

import pytest
import torch

from mambaserve import LLM, SamplingParams
from tests.engine.engines import EVERY_FAMILY
from tests.models.tiny import checkpoint, hf_model

ATTENTION = {"granite-moe", "bamba", "falcon-h1", "jamba", "zamba2", "nemotron-h-moe"}
BASE = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "block_size": 4, "max_model_len": 96}
_REFERENCES: dict = {}


def _engine_kw(name, rng):
    kw = dict(max_num_batched_tokens=rng.choice([3, 7, 16, 64]), mamba_block_size=rng.choice([4, 8, 12, 16]),
              async_scheduling=rng.choice([True, False]), max_num_seqs=rng.choice([2, 4, 8]))
    if name in ATTENTION:
        kw["num_kv_blocks"] = rng.choice([30, 48, 200])
    else:
        kw["num_state_slots"] = rng.choice([3, 5, 9])
    k = rng.choice([0, 0, 1, 3])
    if k and rng.random() < 0.5:
        kw["speculative_config"] = {"method": "draft_model", "model": checkpoint(name), "num_speculative_tokens": k}
    elif k:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1}
    return kw


def _rounds(rng, tok):
    system, earlier, rounds = tok(rng.choice([0, 5, 13, 24, 33])), [], []
    for _ in range(3):
        batch = []
        for _ in range(rng.choice([1, 2, 3])):
            kind = rng.random() if earlier else 1.0
            if kind < 0.3:
                p = rng.choice(earlier)
            elif kind < 0.55:
                p = rng.choice(earlier) + tok(rng.randint(1, 12))
            elif kind < 0.7:
                e = rng.choice(earlier)
                p = e[: rng.randint(1, len(e))]
            else:
                p = system + tok(rng.randint(1, 20))
            batch.append(p[:80])
        if rng.random() < 0.3:
            batch.append(batch[0])
        rounds.append(batch)
        earlier += batch
    return rounds


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", EVERY_FAMILY)
def test_random_shapes_and_traffic_equal_caching_off(name, seed):
    rng = random.Random(f"{name}-{seed}")
    g = torch.Generator().manual_seed(seed)
    vocab = hf_model(name).config.vocab_size

    def tok(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    kw = _engine_kw(name, rng)
    llm = LLM(checkpoint(name), **BASE, **kw)
    if name not in _REFERENCES:
        _REFERENCES[name] = LLM(checkpoint(name), **BASE, enable_prefix_caching=False)
    ref = _REFERENCES[name]
    max_tokens = rng.choice([4, 9])
    if "speculative_config" not in kw and rng.random() < 0.5:
        params = SamplingParams(temperature=0.9, n=2, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    cached = 0
    for batch in _rounds(rng, tok):
        plist = [params] * len(batch)
        if rng.random() < 0.3:
            plist[rng.randrange(len(batch))] = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True, prompt_logprobs=1)
        got = llm.generate([{"prompt_token_ids": p} for p in batch], plist, use_tqdm=False)
        for p, q, out in zip(batch, plist, got):
            want = ref.generate({"prompt_token_ids": p}, q, use_tqdm=False)[0]
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs], (kw, len(p))
            cached += out.num_cached_tokens or 0
    stats = llm.llm_engine.scheduler.prefix_cache_stats
    assert stats.hits >= cached  # every sibling's hits count, num_cached_tokens is the first one's
