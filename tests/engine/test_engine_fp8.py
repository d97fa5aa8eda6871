"""FP8 in the engine: online quantization="fp8" on the demo model against its bfloat16 run,
an FP8 KV cache (twice the blocks, close to the model-dtype cache, and the same as a reference
that quantizes K and V the same way), and the configurations refused."""

import json
import shutil

import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.config import default_model
from tests.engine.engines import make, prompts_for, run

DEMO_PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):", "1, 2, 3, 4,"]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two greedy runs chose the same token (a run that diverges keeps
    counting its later positions, so this is a floor on how often FP8 agrees)."""
    same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    return same / sum(len(t) for t in a)


def _demo_tokens(**kw):
    llm = LLM(default_model(), dtype="bfloat16", device="cpu", **kw)
    outs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_online_fp8_demo_model_agrees_with_bfloat16():
    _, bf16 = _demo_tokens()
    llm, fp8 = _demo_tokens(quantization="fp8")
    assert llm.llm_engine.runner.model.model.layers[0].mamba.in_proj.weight.dtype == torch.float8_e4m3fn
    agreement = greedy_agreement(bf16, fp8)
    print(f"greedy agreement fp8 vs bf16 on the demo model: {agreement:.3f}")
    assert agreement >= 0.5
    assert all(a[:1] == b[:1] for a, b in zip(bf16, fp8)), "the first greedy token should survive FP8 weights"


def test_kv_fp8_doubles_the_blocks_and_stays_close():
    prompts = prompts_for("granite-moe")
    # a budget the KV blocks, not the running sequences, bound
    budget = dict(cpu_cache_bytes=1 << 17, max_num_seqs=8, max_model_len=256, enable_prefix_caching=False,
                  dtype="bfloat16")
    auto = make("granite-moe", **budget)
    fp8 = make("granite-moe", kv_cache_dtype="fp8", **budget)
    ra, rf = auto.llm_engine.runner, fp8.llm_engine.runner
    assert rf.caches.kv[0][0].dtype == torch.float8_e4m3fn and ra.caches.kv[0][0].dtype == torch.bfloat16
    assert rf.spec.attention[0].bytes_per_token * 2 == ra.spec.attention[0].bytes_per_token  # 2 bytes -> 1
    assert rf.spec.bytes_per_slot == ra.spec.bytes_per_slot  # the Mamba states are not FP8
    assert rf.num_blocks >= 2 * ra.num_blocks, (rf.num_blocks, ra.num_blocks)
    logits_a = auto.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True), use_tqdm=False)
    logits_f = fp8.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True), use_tqdm=False)
    first_a = [o.outputs[0].token_ids[0] for o in logits_a]
    first_f = [o.outputs[0].token_ids[0] for o in logits_f]
    assert sum(a == b for a, b in zip(first_a, first_f)) >= len(prompts) - 1


def test_kv_fp8_engine_matches_a_reference_quantizing_kv_the_same_way(monkeypatch):
    """The FP8-KV engine equals the same engine whose model-dtype cache holds the FP8 values
    (K and V rounded to e4m3 with scale 1 as they are written): the engine's cache path, not
    the rounding, is what is compared."""
    from mambaserve import ops

    prompts = prompts_for("granite-moe", lens=(3, 9, 17))
    fp8 = run(make("granite-moe", kv_cache_dtype="fp8", max_num_seqs=4), prompts)
    real = ops.reshape_and_cache

    def rounding(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        fp = torch.float8_e4m3fn
        real(k.clamp(-448, 448).to(fp).to(k.dtype), v.clamp(-448, 448).to(fp).to(v.dtype), k_cache, v_cache,
             slot_mapping, k_scale, v_scale)

    monkeypatch.setattr(ops, "reshape_and_cache", rounding)
    ref = run(make("granite-moe", max_num_seqs=4), prompts)
    assert fp8 == ref


def test_quantization_configs_that_cannot_apply_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no quantization_config"):
        LLM(default_model(), device="cpu", quantization="compressed-tensors")
    ckpt = tmp_path / "awq"
    shutil.copytree(default_model(), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'awq' are not supported"):
        LLM(str(ckpt), device="cpu")
    with pytest.raises(ValueError, match="does not apply"):
        LLM(str(ckpt), device="cpu", quantization="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FP8 GEMM on Hopper)")
@pytest.mark.parametrize("name", ["granite-moe", "bamba", pytest.param("jamba", marks=pytest.mark.xfail(
    strict=False, reason="on an H200 (6bf12d6) Jamba's first-step FP8 top-5 shared no token with bf16's, while on "
    "the CPU its FP8 model equals the dequantized one exactly: not explained yet (issue 24)"))])
def test_gpu_fp8_graphs_equal_eager_and_stay_near_bf16(name):
    """On the GPU: quantization="fp8" with an FP8 KV cache, CUDA graphs against eager (the same
    kernels up to padding: near ties only), and against the bfloat16 engine (close logprobs on
    the first step: FP8 moves them, not by nats)."""
    from tests.conftest import assert_greedy_close
    from tests.engine.engines import SHARE, gen_with_logprobs
    from tests.models.tiny import checkpoint

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = prompts_for(name, lens=(1, 3, 9, 17, 30))
    kw = dict(skip_tokenizer_init=True, dtype="bfloat16", device="cuda", max_num_seqs=8, gpu_memory_utilization=SHARE,
              cuda_graph_sizes=[1, 2, 4, 8])
    eager = LLM(checkpoint(name), enforce_eager=True, quantization="fp8", kv_cache_dtype="fp8", **kw)
    graphed = LLM(checkpoint(name), quantization="fp8", kv_cache_dtype="fp8", **kw)
    bf16 = LLM(checkpoint(name), enforce_eager=True, **kw)
    g, e, b = (gen_with_logprobs(x, prompts, params) for x in (graphed, eager, bf16))
    diverged = assert_greedy_close(g, e, max_gap=0.5, logprob_tol=0.5)
    assert diverged.count(None) >= len(diverged) // 2
    for (_, lf), (_, lb) in zip(e, b):
        common = set(lf[0]) & set(lb[0])
        assert common and max(abs(lf[0][t] - lb[0][t]) for t in common) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name,preset", [("granite-tp-absorbed", "FP8"), ("bamba-tp", "FP8_DYNAMIC")])
def test_compressed_tensors_checkpoint_on_two_ranks_equals_one(name, preset):
    """Tensor parallelism over an FP8 checkpoint: each rank reads its shard of the FP8 weights and of
    their per-row scales (whole per-tensor scales), and the outputs equal one rank's."""
    pytest.importorskip("compressed_tensors")
    from tests.models.fp8_checkpoints import write_fp8_checkpoint

    path, _ = write_fp8_checkpoint(name, preset, ["lm_head"])
    prompts = prompts_for(name, lens=(1, 5, 17))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, device="cpu", dtype="float32", skip_tokenizer_init=True,
                  max_num_seqs=4)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in outs])
    for (ta, la), (tb, lb) in zip(*runs):
        assert ta == tb
        assert all(abs(x[t] - y[t]) < 1e-4 for x, y in zip(la, lb) for t in x.keys() & y.keys())
