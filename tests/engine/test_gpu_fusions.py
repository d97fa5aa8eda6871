"""GPU-only: the decode-step fusions (the router in one launch, the Mamba2 gated norm inside
out_proj) against the same engine built and run inside `ops.unfused()`: the same greedy tokens
(float32: equal, logprobs to 1e-3; bfloat16: equal up to a near tie), graphs captured with the
fused kernels, and exactly one launch fewer per MoE router and per Mamba2 gated norm in each
decode step. Skipped without CUDA."""

import pytest
import torch

from mambaserve import LLM, SamplingParams, ops
from tests.conftest import assert_greedy_close
from tests.engine.engines import SHARE, gen_with_logprobs, prompts_for
from tests.models.tiny import checkpoint

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("fusions_on")]  # the fused paths are opt-in in the engine



# (name, MoE routers, Mamba2 mixers with a gated norm) of the tiny checkpoints
NAMES = [("granite-moe", 4, 2), ("granite-moe-absorbed", 3, 2), ("bamba", 0, 2), ("mamba2", 0, 2)]


def _engine(name, dtype, **kw):
    return LLM(checkpoint(name), skip_tokenizer_init=True, dtype=dtype, device="cuda", gpu_memory_utilization=SHARE,
               max_num_seqs=16, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [n for n, _, _ in NAMES])
def test_fused_decode_equals_unfused(name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = prompts_for(name)
    fused = gen_with_logprobs(_engine(name, dtype), prompts, params)
    with ops.unfused():
        unfused = gen_with_logprobs(_engine(name, dtype), prompts, params)
    if dtype == "float32":
        assert [t for t, _ in fused] == [t for t, _ in unfused]
        assert_greedy_close(fused, unfused, logprob_tol=1e-3)
    else:
        assert_greedy_close(fused, unfused)


def _kernels_per_decode_step(llm, prompt, steps=8) -> float:
    from torch.profiler import ProfilerActivity, profile

    def count(max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            torch.cuda.synchronize()
        return sum(1 for ev in prof.events() if ev.device_type.name == "CUDA")

    count(steps + 1)  # warm-up
    return (count(steps + 1) - count(1)) / steps


@pytest.mark.parametrize("name,routers,norms", NAMES)
def test_one_launch_fewer_per_router_and_gated_norm(name, routers, norms):
    """Graphed decode steps (the profiler sees the kernels of graph replays) without async
    scheduling (no step launched ahead): unfused minus fused = routers + gated norms a step."""
    prompt = prompts_for(name, lens=(5,))[0]
    fused = _kernels_per_decode_step(_engine(name, "bfloat16", async_scheduling=False), prompt)
    with ops.unfused():
        unfused = _kernels_per_decode_step(_engine(name, "bfloat16", async_scheduling=False), prompt)
    assert unfused - fused == pytest.approx(routers + norms)
