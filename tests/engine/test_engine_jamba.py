"""The engine on Jamba (`JambaForCausalLM`, tiny configs "jamba" and "jamba-moe-every-layer"):
greedy outputs must not depend on batching, chunking, padding or preemption, must equal
transformers' greedy generate, and the pools must return to empty. CPU, float32, reference ops;
`test_gpu.py` runs "jamba" among its GPU families (Triton against the CPU in float32, CUDA
graphs against eager in bfloat16)."""

import pytest
import torch

from tests.engine.test_engine import _EagerPiecewise, alone, assert_pools_empty, make, prompts_for, run  # noqa: F401
from tests.models.tiny import hf_model

NAMES = ["jamba", "jamba-moe-every-layer"]


@pytest.mark.parametrize("name", NAMES)
def test_batched_equals_alone(name, alone):
    llm = make(name)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)


@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_equals_whole_prompts(budget, alone):
    llm = make("jamba", max_num_batched_tokens=budget)
    assert run(llm, prompts_for("jamba")) == alone("jamba")
    assert_pools_empty(llm)


def test_padded_piecewise_steps_and_preemption_equal_alone(alone):
    """Steps padded as the piecewise graphs pad them, and a KV budget too small for all requests
    at once (12 blocks of 4 tokens): requests are preempted and recomputed."""
    name = "jamba-moe-every-layer"
    llm = make(name, max_num_batched_tokens=7)
    runner = llm.llm_engine.runner
    runner.piecewise_graphs = _EagerPiecewise(runner.model)
    assert run(llm, prompts_for(name)) == alone(name)
    assert_pools_empty(llm)
    llm = make(name, block_size=4, num_kv_blocks=12, max_model_len=48)
    assert run(llm, prompts_for(name)) == alone(name)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_generate(name, alone):
    hf = hf_model(name)
    hf.generation_config.eos_token_id = None
    for p, ours in list(zip(prompts_for(name), alone(name)))[1:5]:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                              pad_token_id=0)[0, len(p):].tolist()
        assert ours == ref


def test_cache_spec_and_stacked_experts():
    """One Mamba-1 state per Mamba layer and one KV cache per attention layer, in layer order;
    the MoE layers hold their experts stacked once loaded, the dense layers a gated MLP."""
    model = make("jamba").llm_engine.runner.model
    spec = model.cache_spec()
    # layers: mamba, attention, mamba, attention (period 2, offset 1); d_inner 64, d_state 8, width 4
    assert [s.conv_shape for s in spec.mamba] == [(3, 64)] * 2 and [s.ssm_shape for s in spec.mamba] == [(64, 8)] * 2
    assert [(a.num_kv_heads, a.head_dim) for a in spec.attention] == [(2, 8)] * 2
    experts = model.model.layers[0].feed_forward.experts
    assert experts.gate_up_proj.shape == (4, 48, 32) and experts.down_proj.shape == (4, 32, 24)
    assert hasattr(model.model.layers[1].feed_forward, "gate_proj")


def test_dummy_weights_from_a_bare_config():
    """load_format="dummy" on config.json alone: experts stacked after the random init, and the
    dt_proj biases are those of dt in [1e-3, 1e-1] (softplus^-1), not N(0, std)."""
    from mambaserve import LLM
    from tests.models.tiny import checkpoint

    llm = LLM(checkpoint("jamba") + "/config.json", load_format="dummy", skip_tokenizer_init=True, dtype="float32")
    model = llm.llm_engine.runner.model
    dt = torch.nn.functional.softplus(model.model.layers[0].mamba.dt_proj.bias)
    assert 1e-3 <= dt.min() and dt.max() <= 1e-1
    assert model.model.layers[2].feed_forward.experts.gate_up_proj.shape == (4, 48, 32)
    assert len(run(llm, prompts_for("jamba")[:2])[1]) == 10
