"""Prefix caching's offline surface: the flags reach EngineConfig, LLM(enable_prefix_caching=...)
and lm_eval's model_args reach the engine, RequestOutput.num_cached_tokens agrees with the
engine's counters, LLM.reset_prefix_cache() refuses while a request runs and forgets otherwise,
and the stats line's hit-rate part. The checks that need real hits run once the core is in."""

from __future__ import annotations

import argparse
import random

import pytest

from mambaserve import LLM, SamplingParams
from mambaserve.cache import prefix_cache
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args
from mambaserve.engine.stats import format_prefix_cache_hit_rate
from tests.models.tiny import checkpoint

CORE = hasattr(prefix_cache, "PrefixCache")
BLOCK = 16


def _config(*flags):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(["--model", checkpoint("granite-moe"), *flags]))


def test_flags():
    assert _config().enable_prefix_caching is True  # on by default
    off = _config("--no-enable-prefix-caching", "--mamba-block-size", "32", "--num-state-checkpoints", "5")
    assert (off.enable_prefix_caching, off.mamba_block_size, off.num_state_checkpoints) == (False, 32, 5)
    assert _config("--enable-prefix-caching").cache_config.enable_prefix_caching is True
    with pytest.raises(ValueError, match="mamba_block_size"):
        _config("--mamba-block-size", "0")


def test_num_cached_tokens_reset_and_counters():
    llm = LLM(checkpoint("granite-moe"), dtype="float32", enable_prefix_caching=True, mamba_block_size=BLOCK,
              skip_tokenizer_init=True)
    off = LLM(checkpoint("granite-moe"), dtype="float32", enable_prefix_caching=False, mamba_block_size=BLOCK,
              skip_tokenizer_init=True)
    assert llm.llm_engine.config.enable_prefix_caching and not off.llm_engine.config.enable_prefix_caching
    rng = random.Random()
    prompt = {"prompt_token_ids": [rng.randrange(1, 200) for _ in range(4 * BLOCK + 3)]}
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    outs = [llm.generate(prompt, greedy, use_tqdm=False)[0] for _ in range(2)]
    ref = off.generate(prompt, greedy, use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in outs] == [ref.outputs[0].token_ids] * 2
    assert outs[0].num_cached_tokens == 0 and ref.num_cached_tokens == 0
    usage = llm.llm_engine.usage()
    assert usage.prefix_cache_hits == sum(o.num_cached_tokens for o in outs)  # one sequence per request
    assert usage.prefix_cache_queries == 2 * len(prompt["prompt_token_ids"]) or not CORE
    assert off.llm_engine.usage().prefix_cache_hits == 0
    if CORE:
        assert outs[1].num_cached_tokens == 4 * BLOCK  # every whole block; the last tokens are computed

    engine = llm.llm_engine
    engine.add_request("busy", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request runs: nothing dropped
    if CORE:
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 4 * BLOCK
    engine.abort_request("busy")
    assert llm.reset_prefix_cache() is True and off.reset_prefix_cache() is True
    again = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == ref.outputs[0].token_ids


def test_hit_rate_line():
    assert format_prefix_cache_hit_rate(200, 50) == "Prefix cache hit rate: 25.0%"
    assert format_prefix_cache_hit_rate(0, 0) == "Prefix cache hit rate: 0.0%"
    assert format_prefix_cache_hit_rate(3, 3) == "Prefix cache hit rate: 100.0%"


def test_lm_eval_model_args_reach_the_engine():
    lm_eval_model = pytest.importorskip("mambaserve.eval.lm_eval_model")
    from tests.tokenized import tokenized_checkpoint

    lm = lm_eval_model.MambaServeLM(pretrained=tokenized_checkpoint(), dtype="float32", device="cpu",
                                    enable_prefix_caching=False, mamba_block_size=32)
    cfg = lm.model.llm_engine.config
    assert (cfg.enable_prefix_caching, cfg.mamba_block_size) == (False, 32)
