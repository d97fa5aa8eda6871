"""What only Zamba2 and Nemotron-H have, on the engine: their "auto" SSM cache dtype (the
family default), and (skipped without CUDA) CUDA graphs against eager over Zamba2's per-depth
KV caches of one set of shared attention weights and Nemotron-H's MoE capture path.

The shared cases (batched, chunked, preemption; GPU against CPU in float32) run "zamba2" and
"nemotron-h-moe" (all four layer kinds: M, E, *, -) as entries of `test_engine.py`'s and
`test_gpu.py`'s suites.
"""

import pytest
import torch

from tests.engine.engines import make, prompts_for


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
