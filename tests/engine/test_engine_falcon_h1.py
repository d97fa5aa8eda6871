"""The engine on Falcon-H1 (CPU, float32, reference ops): every layer holds a Mamba state slot
and KV blocks at once. Greedy outputs must not depend on batching, chunking or preemption, must
equal transformers' greedy generate, and the pools must return to empty. `test_gpu.py` runs
"falcon-h1" among its GPU families (eager Triton against the CPU in float32, graphs against
eager in bfloat16)."""

import pytest
import torch

from tests.engine.test_engine import _EagerPiecewise, alone, assert_pools_empty, make, prompts_for, run  # noqa: F401 (fixture)
from tests.models.tiny import hf_model

FAMILIES = ["falcon-h1", "falcon-h1-norm"]


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_equals_alone(name, alone):
    llm = make(name)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_equals_whole_prompts(name, alone):
    llm = make(name, max_num_batched_tokens=7)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("budget", [1, 7])
def test_padded_piecewise_steps_equal_alone(budget, alone):
    """Steps padded to a captured size as the piecewise graphs pad them (rows of no sequence):
    the padding rows must touch neither a state slot nor a KV block of a real request."""
    name = "falcon-h1"
    llm = make(name, max_num_batched_tokens=budget)
    runner = llm.llm_engine.runner
    runner.piecewise_graphs = _EagerPiecewise(runner.model)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


def test_preemption_under_tiny_kv_budget(alone):
    name = "falcon-h1"
    # 12 blocks of 4 tokens: enough for the longest request alone (30 + 10 tokens), not for all at once
    llm = make(name, block_size=4, num_kv_blocks=12, max_model_len=48)
    assert run(llm, prompts_for(name)) == alone(name)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_transformers_generate(name, alone):
    hf = hf_model(name)
    hf.generation_config.eos_token_id = None
    for p, ours in list(zip(prompts_for(name), alone(name)))[1:5]:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                              pad_token_id=0)[0, len(p):].tolist()
        assert ours == ref
