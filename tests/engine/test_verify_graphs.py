"""The full graphs of uniform verify steps (every sequence verifies k drafts), on the CPU: no
graph is captured there, but `DecodeGraphRunner` runs the same forward over the same
persistent buffers, static verify plan and padding rows as a replay would, so that the step
routing, the buffers and the padding are checked against plain generation here (the captured
graphs themselves: tests/engine/test_gpu_spec_decode.py)."""

import pytest

from mambaserve import SamplingParams
from mambaserve.engine.cuda_graph import DecodeGraphRunner
from tests.engine.engines import run
from tests.engine.test_spec_decode import GREEDY, make, ngram, oracle, spec_prompts


def install_verify_graphs(llm, sizes):
    """Give the engine's runner verify graphs of these batch sizes for 2..k + 1 new tokens per
    sequence, as a GPU engine captures them (on the CPU: eager replays)."""
    r = llm.llm_engine.runner
    for q in range(2, r.verify_stride + 1):
        r.verify_graphs[q] = DecodeGraphRunner(
            r.model, r.caches, sizes=sizes, max_model_len=r.max_model_len, block_size=r.block_size,
            has_attention=r.has_attention, device=r.device, query_len=q,
            verify_rows=(r.verify_base, r.verify_stride), pad_slot=r.scratch_slot)
        r.verify_graphs[q].capture()
    return r.verify_graphs


@pytest.mark.parametrize("name,k", [("granite-moe", 3), ("jamba", 2), ("mamba2-untied", 4), ("mamba1", 1)])
def test_uniform_verify_steps_in_graph_buffers_equal_plain_generation(name, k):
    prompts = spec_prompts(name)  # 5 sequences: padded to 8, then to 4, 2 and 1 as they finish
    refs = run(make(name, enable_prefix_caching=False), prompts, GREEDY)
    llm = make(name, speculative_config=ngram(k), block_size=4, mamba_block_size=8, max_num_seqs=8)
    graphs = install_verify_graphs(llm, [1, 2, 4, 8])[k + 1]
    oracle(llm, prompts, refs, skip=lambda p: False)
    assert run(llm, prompts, GREEDY) == refs
    assert run(llm, prompts, GREEDY) == refs  # prefix-cache hits the first pass filled
    steps = llm.llm_engine.stats.step_breakdown
    assert steps["verify_graph/decode"].steps > 0, steps
    # padding rows never wrote a real slot: the scratch slot is the only one they read
    assert int(graphs.state_indices[len(prompts):].min()) == graphs.pad_slot


def test_only_uniform_verify_steps_take_the_graphs():
    """Steps where sequences verify different numbers of drafts (or none) run through the
    general path; the steps where every sequence verifies as many take the graphs of that
    many; the outputs are those of plain generation either way."""
    name, k, params = "bamba", 3, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = spec_prompts(name)
    refs = run(make(name, enable_prefix_caching=False), prompts, params)
    llm = make(name, speculative_config=ngram(k), max_num_seqs=8)
    install_verify_graphs(llm, [1, 2, 4, 8])
    spec = oracle(llm, prompts, refs, corrupt_every=7, skip=lambda p: False)
    inner = spec._propose

    def propose(seq, kk):  # the 17-token prompt: none, then k - 1 drafts in its first steps
        drafts = inner(seq, kk)
        if len(seq.prompt_token_ids) == 17 and seq.num_output_tokens < 6:
            return drafts[: kk - 1] if seq.num_output_tokens else []
        return drafts

    spec._propose = propose
    runner, seen = llm.llm_engine.runner, []
    forward = runner._forward

    def recorded(step, tokens):
        out = forward(step, tokens)
        seen.append((tuple(step.query_lens), len(step.verify_state_rows), out[2]))
        return out

    runner._forward = recorded
    assert run(llm, prompts, params) == refs
    for lens, verifying, path in seen:
        uniform = verifying == len(lens) and len(set(lens)) == 1 and 2 <= lens[0] <= k + 1
        assert (path == "verify_graph") == uniform, (lens, verifying, path)
    assert {p for *_, p in seen} >= {"verify_graph", "eager"}


def test_verify_graph_needs_its_rows():
    with pytest.raises(ValueError, match="verify_rows"):
        DecodeGraphRunner(None, None, sizes=[1], max_model_len=64, block_size=16, has_attention=False,
                          device=__import__("torch").device("cpu"), query_len=3)
