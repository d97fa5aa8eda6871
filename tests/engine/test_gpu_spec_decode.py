"""GPU-only: speculative decoding through the Triton kernels (the fused verify ops) and the
graphs (verify steps in the full verify graphs where every sequence verifies k drafts, piecewise
otherwise; plain decodes in the full decode graphs) against no
speculation. float32 (TF32 off) to the graphs-vs-eager bar (1e-3 nats), bfloat16 to the bf16
one (a near tie may flip). Drafts: the plain run's own continuation with some corrupted
(`test_spec_decode.oracle`), and n-gram drafts on the bundled demo model. Skipped without CUDA.
"""

import pytest
import torch

from mambaserve import LLM, SamplingParams
from tests.conftest import assert_greedy_close
from tests.engine.engines import EVERY_FAMILY, SHARE, gen_with_logprobs
from tests.engine.test_spec_decode import ngram, oracle, spec_prompts
from tests.models.tiny import checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", EVERY_FAMILY)
def test_gpu_spec_decode_equals_plain_with_graphs(name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = {"skip_tokenizer_init": True, "dtype": dtype, "device": "cuda", "max_num_seqs": 8, "block_size": 16,
          "mamba_block_size": 16, "cuda_graph_sizes": [1, 2, 4, 8], "gpu_memory_utilization": SHARE}
    prompts = spec_prompts(name)
    plain = LLM(checkpoint(name), **kw)
    a = gen_with_logprobs(plain, prompts, PARAMS)
    llm = LLM(checkpoint(name), speculative_config=ngram(3), **kw)
    spec = oracle(llm, prompts, [t for t, _ in a])
    b = gen_with_logprobs(llm, prompts, PARAMS)
    if dtype == "float32":
        assert assert_greedy_close(a, b, max_gap=1e-3, logprob_tol=1e-3) == [None] * len(prompts)
    else:
        assert_greedy_close(a, b, logprob_tol=0.6 if name in ("jamba", "zamba2") else 0.25)
    assert spec.stats.num_accepted_tokens > 0
    assert {k.split("/")[0] for k in llm.llm_engine.stats.step_breakdown} >= {"piecewise"}


def test_gpu_demo_model_ngram_acceptance():
    """The trained demo model accepts n-gram drafts on a repetitive prompt, and its greedy text
    is the plain run's."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
    plain = LLM(gpu_memory_utilization=SHARE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(gpu_memory_utilization=SHARE, speculative_config=ngram(4, lo=2, hi=4))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    st = llm.llm_engine.spec.stats
    assert out.token_ids == plain.token_ids
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0.3 * st.num_draft_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", EVERY_FAMILY)
def test_gpu_verify_graphs_equal_plain(name, dtype):
    """Every sequence verifies k drafts in most steps: those replay the captured verify graphs
    (batch 5 padded to 8, then smaller as sequences finish)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = {"skip_tokenizer_init": True, "dtype": dtype, "device": "cuda", "max_num_seqs": 8, "block_size": 16,
          "mamba_block_size": 16, "cuda_graph_sizes": [1, 2, 4, 8], "gpu_memory_utilization": SHARE}
    prompts = spec_prompts(name)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    a = gen_with_logprobs(LLM(checkpoint(name), **kw), prompts, params)
    llm = LLM(checkpoint(name), speculative_config=ngram(3), **kw)
    oracle(llm, prompts, [t for t, _ in a], corrupt_every=7, skip=lambda p: False)
    b = gen_with_logprobs(llm, prompts, params)
    if dtype == "float32":
        assert assert_greedy_close(a, b, max_gap=1e-3, logprob_tol=1e-3) == [None] * len(prompts)
    else:
        assert_greedy_close(a, b, logprob_tol=0.6 if name in ("jamba", "zamba2") else 0.25)
    assert llm.llm_engine.stats.step_breakdown["verify_graph/decode"].steps > 0
