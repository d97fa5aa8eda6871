"""Engines over the tiny test checkpoints and the helpers the engine tests share.

Plain helpers (not fixtures, not tests): the families the shared suites run, an engine on the
CPU reference path, seeded prompts, greedy runs, pool checks, and stand-ins that let the CPU
exercise the graph runners' padding. The `alone` fixture built on them is in conftest.py.
"""

import torch

from mambaserve import LLM, SamplingParams
from tests.models.tiny import checkpoint, hf_model

# Falcon-H1: state + KV in every layer; Jamba: Mamba-1 with dt/B/C norms, NoPE attention, softmax top-k MoE
FAMILIES = ["granite-moe", "bamba", "mamba2-untied", "falcon-h1", "falcon-h1-norm", "jamba"]
# one checkpoint of every family the engine serves: Granite 4.0-H (MoE), Bamba, Mamba2, Falcon-H1,
# Jamba, Zamba2, Nemotron-H, Mamba-1 (the prefix-caching suites run each)
EVERY_FAMILY = ["granite-moe", "bamba", "mamba2-untied", "falcon-h1", "jamba", "zamba2", "nemotron-h-moe", "mamba1"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# each engine's share of the GPU in the GPU tests: several engines live in one test process
SHARE = 0.05


def make(name, **kw):
    """An engine on the CPU reference path (the GPU path has its own tests in test_gpu.py)."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLM(checkpoint(name), skip_tokenizer_init=True, **kw)


def prompts_for(name, lens=(1, 2, 3, 9, 17, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = hf_model(name).config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_pools_empty(llm):
    e = llm.llm_engine
    usage = e.usage()
    assert usage.num_slots_used == 0 and usage.num_blocks_used == 0
    assert usage.num_running == 0 and usage.num_waiting == 0
    assert not e.has_unfinished_requests() and e.num_requests == 0


class EagerPiecewise:
    """Stands in for the piecewise graph runner on the CPU: the step is padded to the next
    captured size exactly as the graphs pad it (padding rows: token 0, position 0, no sequence)
    and run eagerly with the real step's context."""

    def __init__(self, model, sizes=(8, 16, 32, 64)):
        self.model, self.sizes = model, sizes

    def padded_size(self, num_tokens):
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(self, input_ids, positions, ctx):
        t = input_ids.shape[0]
        pad = self.padded_size(t) - t
        ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        pos = torch.cat([positions, positions.new_zeros(pad)])
        return self.model(ids, pos, ctx)[:t]


def count_chained(llm):
    """Wrap the runner's chained-decode entry point: returns a list whose [0] counts its calls."""
    runner, calls = llm.llm_engine.runner, [0]
    inner = runner.execute_chained_decode

    def counted(*args, **kw):
        calls[0] += 1
        return inner(*args, **kw)

    runner.execute_chained_decode = counted
    return calls


def gen_with_logprobs(llm, prompts, params):
    """Greedy runs as `assert_greedy_close` takes them: (token ids, top-candidate logprobs)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]
