"""Mamba-1 in bfloat16 on the CPU against transformers: the residual stream kept in float32
(residual_in_fp32) or in the model dtype, the float32 decay rates, skip and dt bias beside
bfloat16 projections. (`test_parity.py` holds the float32 parity of both tiny Mamba-1 configs;
its bfloat16 cases run on a GPU only.)

Bar: ours may be at most three times as far from transformers' float32 logits as transformers'
own bfloat16 model is (rounding in random tiny models is amplified; a real bug is off by O(1)).
"""

import copy

import pytest
import torch

from mambaserve.loader import load_model
from tests.conftest import rel_err
from tests.models.test_parity import Harness
from tests.models.tiny import checkpoint, hf_model


@pytest.mark.parametrize("name", ["mamba1", "mamba1-untied"])
def test_bf16_packed_prefill_then_decode_near_transformers(name):
    hf = hf_model(name)
    ours = load_model(checkpoint(name), dtype="bfloat16")
    assert ours.backbone.layers[0].mixer.A_log.dtype == torch.float32
    lens, n_decode = [1, 4, 19], 2
    seqs = [torch.randint(3, hf.config.vocab_size, (n + n_decode,)).tolist() for n in lens]
    assert_bf16_steps_near_transformers(hf, ours, seqs, lens, n_decode)


def assert_bf16_steps_near_transformers(hf, ours, seqs, lens, n_decode):
    """One packed prefill of seqs[i][:lens[i]], then n_decode decode steps of every sequence, each
    step's logits within the bar of the module docstring. hf: the float32 transformers model."""
    hf_low = copy.deepcopy(hf).to(torch.bfloat16)
    h = Harness(ours, len(lens), max(lens) + n_decode)

    def check(got, ids, rows, what):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, rows]
            low = hf_low(torch.tensor([ids])).logits[0, rows].float()
        assert rel_err(got, ref) < max(3e-2, 3 * rel_err(low, ref)), what

    got = h.step({i: s[:n] for i, (s, n) in enumerate(zip(seqs, lens))})
    for i, (s, n) in enumerate(zip(seqs, lens)):
        check(got[i], s[:n], slice(0, n), f"prefill of prompt {i}")
    for t in range(n_decode):
        got = h.step({i: [s[n + t]] for i, (s, n) in enumerate(zip(seqs, lens))})
        for i, (s, n) in enumerate(zip(seqs, lens)):
            check(got[i][0], s[:n + t + 1], -1, f"decode step {t} of prompt {i}")
