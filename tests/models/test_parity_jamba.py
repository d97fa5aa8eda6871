"""Jamba in bfloat16 on the CPU against transformers: bfloat16 projections, experts and router
beside the float32 decay rates, skip and dt bias of its Mamba-1 mixers. (`test_parity.py` holds
the float32 parity of both tiny Jamba configs; its bfloat16 cases run on a GPU only.)

Bar: ours may be at most three times as far from transformers' float32 logits as transformers'
own bfloat16 model is (rounding in random tiny models is amplified; a real bug is off by O(1)).
Tokens are drawn away from router near-ties, where bfloat16 may pick another expert in either
implementation (`tie_free_tokens`).
"""

import copy

import pytest
import torch

from mambaserve.loader import load_model
from tests.conftest import rel_err
from tests.models.test_parity import Harness
from tests.models.tiny import checkpoint, hf_model, tie_free_tokens


@pytest.mark.parametrize("name", ["jamba", "jamba-moe-every-layer"])
def test_bf16_packed_prefill_then_decode_near_transformers(name):
    hf = hf_model(name)
    hf_low = copy.deepcopy(hf).to(torch.bfloat16)
    ours = load_model(checkpoint(name), dtype="bfloat16")
    mixer = next(layer.mamba for layer in ours.model.layers if layer.kind == "mamba")
    assert mixer.A_log.dtype == torch.float32 and mixer.b_layernorm.weight.dtype == torch.bfloat16
    lens, n_decode = [1, 4, 13], 2
    seqs = tie_free_tokens(hf, [n + n_decode for n in lens])
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
