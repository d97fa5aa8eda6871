"""The bundled demo model: the engine equals transformers on a trained model's sharp distributions."""

import sysconfig
from pathlib import Path

import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.config import default_model
from tests.conftest import assert_greedy_close

PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass ", "    for i in range(", "# Copyright"]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model(), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model())


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu")


def _held_out_text() -> str:
    # textwrap.py is one of the files held out of training (see the model card)
    return (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:6000]


def test_prompt_logprobs_on_held_out_file_match_transformers(hf, llm):
    model, tok = hf
    ids = tok(_held_out_text())["input_ids"][:400]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    ours = torch.tensor([out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))], dtype=torch.float64)
    theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-4
    # a trained model: perplexity far below the vocabulary size
    assert float(torch.exp(-theirs.mean())) < 100


def test_greedy_64_tokens_equal_transformers_generate(hf, llm):
    model, tok = hf
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)[0,
                                                                                                             ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist()
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_greedy_first_32_tokens_equal_transformers(hf):
    """bfloat16 on both sides: ours (Triton kernels, fused norms) and transformers round at
    different places, so a near tie may flip; up to it, tokens are equal (assert_greedy_close)."""
    model, tok = hf
    gpu = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs = gpu.generate(PROMPTS, params, use_tqdm=False)
    ours = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]
    ref_model = model.to("cuda", torch.bfloat16)
    theirs = []
    try:
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")["input_ids"].cuda()
            with torch.no_grad():
                gen = ref_model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                                         output_logits=True, return_dict_in_generate=True)
            steps = []
            for logits in gen.logits:
                lp = torch.log_softmax(logits[0].float(), -1)
                top = lp.topk(5)
                steps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            theirs.append((gen.sequences[0, ids.shape[1]:].tolist(), steps))
    finally:
        model.to("cpu", torch.float32)
    diverged = assert_greedy_close(ours, theirs)
    print("first differing step per prompt (None: all 32 equal):", diverged)
