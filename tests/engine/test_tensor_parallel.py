"""Tensor parallelism on the CPU (Gloo, 2 and 4 ranks): every family's outputs equal one rank's.

One engine per family and world size runs one batch that takes every path at once: greedy
requests whose prompts are chunked (a budget of 16 tokens) and, with attention, preempted (12
KV blocks of 4 tokens), async-scheduled chained decodes, seeded sampling with n = 2, and
sampled and prompt logprobs. Its outputs must equal, token for token in float32, those of the
same engine on one rank. The checkpoints' shapes take every sharding rule (tests/models/tiny.py:
n_groups 1, 2 and 8; fewer KV heads than ranks; MoE with and without a shared expert, absorbed
or not; Zamba2's shared blocks; Mamba-1; tied and untied embeddings; a vocabulary that does not
split evenly). The ranks an engine starts are kept for the next engine of the same size, so a
world size costs its process start-up once.
"""

import functools

import pytest
import torch

from mambaserve import LLM, SamplingParams
from tests.engine.engines import count_chained
from tests.models.tiny import CONFIGS, checkpoint, hf_model

FAMILIES = ["granite-tp", "granite-tp-absorbed", "bamba-tp", "mamba2", "zamba2", "nemotron-h-moe",
            "falcon-h1-norm-first", "jamba", "mamba1"]
CASES = [(2, name) for name in FAMILIES] + [pytest.param(4, name, marks=pytest.mark.slow) for name in FAMILIES]
ENGINE = {"dtype": "float32", "device": "cpu", "skip_tokenizer_init": True, "max_num_batched_tokens": 16,
          "block_size": 4, "num_kv_blocks": 12, "max_model_len": 48}


def _requests(name):
    g = torch.Generator().manual_seed(1)
    vocab = hf_model(name).config.vocab_size

    def prompt(n):
        return {"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(prompt(n), greedy) for n in (1, 2, 3, 9, 17, 30)]
    requests += [(prompt(n), SamplingParams(n=2, temperature=0.8, seed=3 + n, max_tokens=6, ignore_eos=True))
                 for n in (5, 12)]
    requests.append((prompt(7), SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1,
                                               ignore_eos=True)))
    return requests


def _generate(llm, name):
    """Per request: its completions' tokens, their logprobs and its prompt logprobs (as floats)."""
    prompts, params = zip(*_requests(name))
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)

    def as_floats(steps):
        return [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in steps or []]

    return [([c.token_ids for c in o.outputs], [as_floats(c.logprobs) for c in o.outputs],
             as_floats(o.prompt_logprobs)) for o in outs]


@functools.cache
def _one_rank(name):
    llm = LLM(checkpoint(name), **ENGINE)
    return _generate(llm, name), llm.llm_engine.runner.spec


def _assert_logprobs_close(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x), (x, y)


@pytest.mark.parametrize("world_size, name", CASES)
@pytest.mark.slow
def test_outputs_equal_one_rank(world_size, name):
    want, whole_spec = _one_rank(name)
    llm = LLM(checkpoint(name), tensor_parallel_size=world_size, **ENGINE)
    try:
        chained = count_chained(llm)
        got = _generate(llm, name)
        engine = llm.llm_engine
        preemptions, spec = engine.usage().preemptions, engine.runner.spec
    finally:
        llm.llm_engine.shutdown()
    for (tokens, logprobs, prompt_logprobs), (want_tokens, want_logprobs, want_prompt) in zip(got, want):
        assert tokens == want_tokens
        for lp, want_lp in zip(logprobs, want_logprobs):
            _assert_logprobs_close(lp, want_lp)
        _assert_logprobs_close(prompt_logprobs, want_prompt)
    assert chained[0] > 0  # the async path ran: its device tokens were broadcast to the other ranks
    # rank 0's caches hold its shard: 1/N of the heads (Mamba2) or channels (Mamba-1) of every state,
    # its KV heads (one when the ranks outnumber them)
    assert [m.ssm_shape[0] * world_size for m in spec.mamba] == [m.ssm_shape[0] for m in whole_spec.mamba]
    assert [a.num_kv_heads for a in spec.attention] == [max(1, a.num_kv_heads // world_size)
                                                       for a in whole_spec.attention]
    if whole_spec.has_attention:
        assert preemptions > 0


def _config_dir(tmp_path, name, **overrides):
    """A checkpoint directory holding only the config of `name` with `overrides` (no weights:
    an engine that tried to load them would fail on their absence, not on the split)."""
    import transformers

    kw = {**CONFIGS[name], **overrides}
    arch = kw.pop("arch")
    getattr(transformers, f"{arch}Config")(architectures=[f"{arch}ForCausalLM"], **kw).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("name, overrides, world_size, reason", [
    ("bamba-tp", {"mamba_n_heads": 6, "mamba_d_head": 16, "mamba_n_groups": 3}, 2, r"n_groups=3.*divide n_groups"),
    ("bamba-tp", {"mamba_n_heads": 6, "mamba_d_head": 16, "mamba_n_groups": 1}, 4, r"Mamba2 heads.*6"),
    ("bamba-tp", {"mamba_n_heads": 6, "mamba_d_head": 16, "mamba_n_groups": 3, "intermediate_size": 96,
                  "num_attention_heads": 6, "num_key_value_heads": 2}, 3, r"exceeds num_key_value_heads=2"),
    ("granite-tp", {"intermediate_size": 18}, 4, r"experts' intermediate size.*18"),
    ("mamba1", {}, 5, r"Mamba-1 inner width.*72"),
])
def test_unsplittable_model_is_refused_before_anything_starts(tmp_path, monkeypatch, name, overrides, world_size,
                                                              reason):
    from mambaserve.engine import executor

    def no_workers(*args, **kwargs):
        raise AssertionError("worker processes started for a model that cannot split")

    monkeypatch.setattr(executor, "WorkerProcesses", no_workers)
    with pytest.raises(ValueError, match=reason):
        LLM(_config_dir(tmp_path, name, **overrides), tensor_parallel_size=world_size, **ENGINE)


@pytest.mark.slow
def test_ranks_started_by_torchrun_meet_through_the_environment(tmp_path):
    """Every rank runs the same script with torchrun's variables set (as over several nodes): rank
    0 generates, rank 1's LLM() serves rank 0's steps and ends its process when rank 0 is done."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from mambaserve.distributed.launch import free_local_port

    name, prompt = "bamba-tp", [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = LLM(checkpoint(name), **ENGINE).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from mambaserve import LLM, SamplingParams
        torch.set_num_threads(1)
        llm = LLM({checkpoint(name)!r}, tensor_parallel_size=2, **{ENGINE!r})
        out = llm.generate({{"prompt_token_ids": {prompt!r}}}, SamplingParams(temperature=0.0, max_tokens=6,
                           ignore_eos=True), use_tqdm=False)
        print("TOKENS", out[0].outputs[0].token_ids)
    """))
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert f"TOKENS {want[0].outputs[0].token_ids}" in outs[0] and "TOKENS" not in outs[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["granite-tp", "zamba2", "jamba"])
def test_gpu_two_ranks_with_graphs_equal_one_gpu(name):
    """NCCL, and the collectives captured in the decode and piecewise CUDA graphs: greedy outputs
    of two GPUs equal one GPU's (float32, no TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [p for p, _ in _requests(name)][:6]
    kw = {"dtype": "float32", "device": "cuda", "skip_tokenizer_init": True, "gpu_memory_utilization": 0.3,
          "max_num_seqs": 8, "cuda_graph_sizes": [1, 2, 4, 8]}
    want = [o.outputs[0].token_ids for o in LLM(checkpoint(name), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(checkpoint(name), tensor_parallel_size=2, **kw)
    try:
        assert llm.llm_engine.runner.decode_graphs is not None
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert got == want
