"""EngineConfig validation, and vLLM's options at the values this engine implements."""

import argparse

import pytest

from mambaserve.config import EngineConfig
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args


def test_vllm_options_at_their_supported_values_are_accepted():
    c = EngineConfig(tensor_parallel_size=1, trust_remote_code=True, kv_cache_dtype="auto", quantization=None,
                     enable_prefix_caching=False, max_num_seqs=4)
    assert c.trust_remote_code and c.max_num_seqs == 4
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["-tp", "1", "--trust-remote-code", "--no-enable-prefix-caching", "--kv-cache-dtype",
                              "auto"])
    c = engine_config_from_args(args)
    assert c.tensor_parallel_size == 1 and c.trust_remote_code and c.enable_prefix_caching is False


@pytest.mark.parametrize("kwargs,reason", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of"),
    (dict(quantization="awq"), "quantization must be None or one of"),
    (dict(quantization="FP8"), "quantization must be None or one of"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
    (dict(mamba_block_size=0), "mamba_block_size"),
    (dict(num_state_checkpoints=-1), "num_state_checkpoints"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=12), "power of two"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(compilation_mode="fast"), "compilation_mode"),
    (dict(mamba_ssm_cache_dtype="int8"), "mamba_ssm_cache_dtype"),
    (dict(model="/no/such/checkpoint"), "model path '/no/such/checkpoint' does not exist"),
    (dict(tokenizer="/no/such/tokenizer"), "tokenizer path '/no/such/tokenizer' does not exist"),
    (dict(seed=1.5), "seed must be an integer"),
])
def test_unsupported_or_bad_values_say_why(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("quantization", [None, "fp8", "compressed-tensors"])
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e4m3"])
def test_quantization_and_kv_cache_dtype_values_are_accepted(quantization, kv):
    c = EngineConfig(quantization=quantization, kv_cache_dtype=kv)
    assert (c.quantization, c.kv_cache_dtype) == (quantization, kv)


def test_quantization_flags_parse_and_bad_ones_are_refused(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    c = engine_config_from_args(parser.parse_args(["-q", "fp8", "--kv-cache-dtype", "fp8"]))
    assert (c.quantization, c.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("1k", 1000), ("25.6k", 25_600), ("1K", 1024),
                                          ("32K", 32_768), ("2m", 2_000_000), ("1M", 2**20), ("0.5k", 500)])
def test_max_model_len_takes_vllms_human_readable_counts(text, tokens):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--max-model-len", text]).max_model_len == tokens


@pytest.mark.parametrize("text", ["1.5K", "abc", "1.0001k", "k", "12x", "-", "1e3"])
def test_max_model_len_refuses_what_is_no_token_count(text, capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", text])
    assert "is not a token count" in capsys.readouterr().err


def test_cache_config_follows_the_engine_fields_and_checks_mamba_block_size():
    c = EngineConfig(block_size=8, mamba_block_size=24, num_state_checkpoints=3)
    cc = c.cache_config
    assert cc.enable_prefix_caching is True and cc.block_size == 8
    assert cc.resolved_mamba_block_size == 24 and cc.num_state_checkpoints == 3
    cc.check_model(has_attention=True)
    assert EngineConfig(enable_prefix_caching=None).enable_prefix_caching is True  # an unset flag
    assert EngineConfig(block_size=512).cache_config.resolved_mamba_block_size == 512
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(block_size=16, mamba_block_size=24).cache_config.check_model(has_attention=True)
    EngineConfig(block_size=16, mamba_block_size=24).cache_config.check_model(has_attention=False)
    EngineConfig(block_size=16, mamba_block_size=24, enable_prefix_caching=False).cache_config.check_model(True)


def test_prefix_cache_fields_with_caching_off_are_said_to_do_nothing(caplog):
    with caplog.at_level("WARNING", logger="mambaserve"):
        EngineConfig(mamba_block_size=64, num_state_checkpoints=3, enable_prefix_caching=False).cache_config  # noqa: B018
        EngineConfig(mamba_block_size=64)  # caching on: nothing to say
    said = [r.getMessage() for r in caplog.records]
    assert said == ["mamba_block_size=64, num_state_checkpoints=3: no effect with prefix caching off"]


@pytest.mark.slow
def test_seed_none_is_vllm_v1s_default_seed():
    """vLLM's LLM(seed=None) runs seeded with 0 (V1); it was a TypeError from torch.manual_seed."""
    from mambaserve import LLM, SamplingParams
    from tests.models.tiny import checkpoint

    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # drawn from the global generator

    def sample(seed):
        llm = LLM(checkpoint("mamba2"), skip_tokenizer_init=True, device="cpu", max_num_seqs=2, seed=seed)
        assert llm.llm_engine.config.seed == (0 if seed is None else seed)
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(None) == sample(0) != sample(1)
