"""Mamba-1 in bfloat16 on the CPU against transformers: the residual stream kept in float32
(residual_in_fp32) or in the model dtype, the float32 decay rates, skip and dt bias beside
bfloat16 projections. (`test_parity.py` holds the float32 parity of both tiny Mamba-1 configs;
its bfloat16 cases run on a GPU only.)

Bar: ours may be at most three times as far from transformers' float32 logits as transformers'
own bfloat16 model is (rounding in random tiny models is amplified; a real bug is off by O(1)).
"""

import pytest
import torch

from mambaserve.loader import load_model
from tests.models.harness import assert_bf16_steps_near_transformers
from tests.models.tiny import checkpoint, hf_model


@pytest.mark.parametrize("name", ["mamba1", "mamba1-untied"])
def test_bf16_packed_prefill_then_decode_near_transformers(name):
    hf = hf_model(name)
    ours = load_model(checkpoint(name), dtype="bfloat16")
    assert ours.backbone.layers[0].mixer.A_log.dtype == torch.float32
    lens, n_decode = [1, 4, 19], 2
    seqs = [torch.randint(3, hf.config.vocab_size, (n + n_decode,)).tolist() for n in lens]
    assert_bf16_steps_near_transformers(hf, ours, seqs, lens, n_decode)
