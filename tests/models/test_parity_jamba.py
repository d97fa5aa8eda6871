"""Jamba in bfloat16 on the CPU against transformers: bfloat16 projections, experts and router
beside the float32 decay rates, skip and dt bias of its Mamba-1 mixers. (`test_parity.py` holds
the float32 parity of both tiny Jamba configs; its bfloat16 cases run on a GPU only.)

Bar: ours may be at most three times as far from transformers' float32 logits as transformers'
own bfloat16 model is (rounding in random tiny models is amplified; a real bug is off by O(1)).
Tokens are drawn away from router near-ties, where bfloat16 may pick another expert in either
implementation (`tie_free_tokens`).
"""

import pytest
import torch

from mambaserve.loader import load_model
from tests.models.harness import assert_bf16_steps_near_transformers
from tests.models.tiny import checkpoint, hf_model, router_margins, steps_before_near_tie, tie_free_tokens


@pytest.mark.parametrize("name", ["jamba", "jamba-moe-every-layer"])
def test_bf16_packed_prefill_then_decode_near_transformers(name):
    hf = hf_model(name)
    ours = load_model(checkpoint(name), dtype="bfloat16")
    mixer = next(layer.mamba for layer in ours.model.layers if layer.kind == "mamba")
    assert mixer.A_log.dtype == torch.float32 and mixer.b_layernorm.weight.dtype == torch.bfloat16
    lens, n_decode = [1, 4, 13], 2
    assert_bf16_steps_near_transformers(hf, ours, tie_free_tokens(hf, [n + n_decode for n in lens]), lens, n_decode)


def test_steps_before_near_tie_counts_from_the_first_near_tie():
    """The helper test_gpu's Jamba graphs test cuts its runs with: tie-free tokens have no near tie;
    a threshold above a position's margin makes the steps that read that position (and later)
    count as near a tie."""
    hf = hf_model("jamba")
    seq = tie_free_tokens(hf, [10])[0]
    prompt, output = seq[:4], seq[4:]
    margins = router_margins(hf, seq)
    assert torch.isfinite(margins).all() and (margins >= 0.02).all()
    assert steps_before_near_tie(hf, prompt, output) == len(output)
    assert steps_before_near_tie(hf, prompt, output, min_margin=float("inf")) == 0
    q = 6  # a generated position: step q - len(prompt) + 1 is the first to read it
    threshold = float(margins[q]) * (1 + 1e-6)
    first = int((margins[: len(seq) - 1] < threshold).nonzero()[0, 0])
    assert steps_before_near_tie(hf, prompt, output, min_margin=threshold) == max(0, first - len(prompt) + 1)
