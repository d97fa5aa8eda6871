"""The engine on Zamba2 and Nemotron-H (CPU, float32, reference ops): greedy outputs must not
depend on batching, chunking or preemption, and the pools must return to empty.

Zamba2 is the case where one set of shared attention weights feeds several KV caches (one per
depth); Nemotron-H adds MLP-only and MoE layers that hold no cache at all.
"""

import pytest
import torch

from tests.engine.engines import assert_pools_empty, make, prompts_for, run

FAMILIES = ["zamba2", "nemotron-h-moe"]  # nemotron-h-moe has all four layer kinds: M, E, *, -


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


@pytest.mark.parametrize("name", FAMILIES)
def test_preemption_under_tiny_kv_budget(name, alone):
    # 12 blocks of 4 tokens: enough for the longest request alone (30 + 10 tokens), not for all at once
    llm = make(name, block_size=4, num_kv_blocks=12, max_model_len=48)
    assert run(llm, prompts_for(name)) == alone(name)
    assert llm.llm_engine.usage().preemptions > 0
    assert_pools_empty(llm)


@pytest.mark.parametrize("name, want", [("nemotron-h", torch.float32), ("zamba2", torch.bfloat16)])
def test_auto_ssm_cache_dtype_takes_the_family_default(name, want):
    llm = make(name, dtype="bfloat16", mamba_ssm_cache_dtype="auto", max_num_seqs=2)
    runner = llm.llm_engine.runner
    assert runner.ssm_dtype == want
    assert all(ssm.dtype == want for _, ssm in runner.caches.mamba)


def _gen(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_greedy_equals_cpu_float32(name):
    from mambaserve import LLM, SamplingParams
    from tests.models.tiny import checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, dtype="float32")
    cpu = _gen(LLM(checkpoint(name), device="cpu", **kw), prompts_for(name), params)
    gpu = _gen(LLM(checkpoint(name), device="cuda", enforce_eager=True, gpu_memory_utilization=0.05, **kw),
               prompts_for(name), params)
    assert gpu == cpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, dtype", [("zamba2", "bfloat16"), ("nemotron-h-moe", "float32")])
def test_gpu_graphs_equal_eager(name, dtype):
    """Decode and piecewise graphs: per-depth KV caches (Zamba2), the MoE's capture path. The MoE
    runs its experts on other row counts under capture than eagerly, so its outputs may differ
    by rounding: float32 (no TF32) keeps that far below any greedy decision."""
    from mambaserve import LLM, SamplingParams
    from tests.conftest import assert_greedy_close
    from tests.engine.engines import gen_with_logprobs
    from tests.models.tiny import checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = prompts_for(name, lens=(1, 2, 3, 9, 17, 30, 64, 5, 7))
    kw = dict(skip_tokenizer_init=True, dtype=dtype, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 2, 4, 8, 16],
              gpu_memory_utilization=0.05)
    eager = LLM(checkpoint(name), enforce_eager=True, **kw)
    graphed = LLM(checkpoint(name), **kw)
    assert graphed.llm_engine.runner.decode_graphs is not None
    for batch in ([prompts[0]], prompts[:3], prompts[:9]):
        if dtype == "float32":
            assert _gen(graphed, batch, params) == _gen(eager, batch, params)
        else:  # bfloat16 rounding of other padded shapes may flip a near tie, never more
            lp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
            assert_greedy_close(gen_with_logprobs(graphed, batch, lp), gen_with_logprobs(eager, batch, lp))
