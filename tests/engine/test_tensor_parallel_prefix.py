"""Prefix caching under tensor parallelism on the CPU (2 Gloo ranks): every rank applies the
step's checkpoint copies to its own shard, so outputs equal one rank's with caching off, token
for token in float32, while prefixes are served from the cache (KV blocks and checkpoints)."""

import pytest
import torch

from mambaserve import LLM, SamplingParams
from tests.models.tiny import checkpoint, hf_model

ENGINE = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "max_num_batched_tokens": 16,
          "block_size": 4, "mamba_block_size": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _batches(name):
    g = torch.Generator().manual_seed(2)
    vocab = hf_model(name).config.vocab_size

    def toks(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    system, x = toks(19), toks(25)
    return [[system + toks(4), system + toks(6)], [system + toks(3), x], [x, x[:17] + toks(3), system + toks(9)]]


def _run(llm, batches):
    outs = []
    for batch in batches:
        res = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in res])
    return outs


@pytest.mark.slow  # starts rank processes, as the other multi-rank equality tests
@pytest.mark.parametrize("name", ["granite-tp", "mamba2", "jamba"])
def test_prefix_caching_over_two_ranks_equals_one_rank_without_it(name):
    batches = _batches(name)
    want = _run(LLM(checkpoint(name), enable_prefix_caching=False, **ENGINE), batches)
    llm = LLM(checkpoint(name), tensor_parallel_size=2, **ENGINE)
    try:
        got = _run(llm, batches)
        hits = llm.llm_engine.scheduler.prefix_cache_stats.hits
    finally:
        llm.llm_engine.shutdown()
    assert got == want
    assert hits >= 16 + 24 + 16  # the system prompt twice, x once
