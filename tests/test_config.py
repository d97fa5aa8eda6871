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
    args = parser.parse_args(["-tp", "1", "--trust-remote-code", "--no-enable-prefix-caching", "--kv-cache-dtype", "auto"])
    c = engine_config_from_args(args)
    assert c.tensor_parallel_size == 1 and c.trust_remote_code and c.enable_prefix_caching is False


@pytest.mark.parametrize("kwargs,reason", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(kv_cache_dtype="fp8"), "model dtype"),
    (dict(quantization="awq"), "quantized"),
    (dict(enable_prefix_caching=True), "prefix caching"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=12), "power of two"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(compilation_mode="fast"), "compilation_mode"),
    (dict(mamba_ssm_cache_dtype="int8"), "mamba_ssm_cache_dtype"),
    (dict(model="/no/such/checkpoint"), "does not exist"),
])
def test_unsupported_or_bad_values_say_why(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        EngineConfig(**kwargs)
