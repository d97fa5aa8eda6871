"""What only Jamba (`JambaForCausalLM`) has, on the engine: the cache declaration, the stacked
experts, dummy weights. CPU, float32, reference ops. The shared cases (batched, chunked,
arrivals, preemption, padded piecewise steps, async scheduling, greedy equal to transformers'
generate) run its "jamba" and "jamba-moe-every-layer" configs as entries of `test_engine.py`'s
suites, and `test_gpu.py`'s GPU families include "jamba"."""

import torch

from tests.engine.engines import make, prompts_for, run


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
