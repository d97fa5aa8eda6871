"""What only Mamba-1 (`MambaForCausalLM`, tiny config "mamba1") has, on the engine: its cache
shapes and the "auto" SSM cache dtype, and (skipped without CUDA) the Triton kernels in CUDA
graphs (decode graphs, and piecewise graphs whose holes are the Mamba-1 mixer's conv + scan)
against eager. The shared cases (batched, chunked, padded piecewise steps, greedy equal to
transformers' generate) run "mamba1" as entries of `test_engine.py`'s suites; `test_gpu.py`
runs it among its GPU families (eager Triton against the CPU in float32, graphs against eager
in bfloat16)."""

import pytest
import torch

from mambaserve import SamplingParams
from tests.engine.engines import GREEDY, assert_pools_empty, make, prompts_for, run

NAME = "mamba1"


def test_auto_ssm_cache_dtype_is_the_model_dtype():
    llm = make(NAME, dtype="bfloat16", mamba_ssm_cache_dtype="auto", max_num_seqs=2)
    runner = llm.llm_engine.runner
    assert runner.ssm_dtype == torch.bfloat16
    spec = runner.model.cache_spec()
    assert [s.ssm_shape for s in spec.mamba] == [(72, 16)] * 2 and [s.conv_shape for s in spec.mamba] == [(3, 72)] * 2
    assert all(ssm.dtype == torch.bfloat16 and ssm.shape[1:] == (72, 16) for _, ssm in runner.caches.mamba)
    # the bfloat16 model on the CPU (float32 residual stream) still generates
    assert len(run(llm, prompts_for(NAME)[:2])[1]) == GREEDY.max_tokens


def _gen(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_gpu_graphs_equal_eager(mode):
    """Decode graphs (one-step conv and scan kernels) and piecewise graphs (mixed steps, chunks of
    a 200-token prompt beside decodes) against eager, float32 without TF32: the same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
              max_num_batched_tokens=64, gpu_memory_utilization=0.05)
    prompts = prompts_for(NAME, lens=(1, 200, 3, 30, 2, 9, 17), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    eager = make(NAME, enforce_eager=True, **kw)
    graphed = make(NAME, compilation_mode=mode, **kw)
    assert graphed.llm_engine.runner.piecewise_graphs is not None
    assert (graphed.llm_engine.runner.decode_graphs is not None) == (mode == "full_and_piecewise")
    for batch in ([prompts[0]], prompts[:3], prompts):
        assert _gen(graphed, batch, params) == _gen(eager, batch, params)
    assert_pools_empty(graphed)
