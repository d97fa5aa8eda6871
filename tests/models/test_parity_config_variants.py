"""Config fields at values none of the tiny checkpoints carry, against transformers (float32, CPU):
each case is a tiny config with a few fields changed, saved by transformers and loaded by us; one
packed prefill of prompts of several lengths, then decode steps, must give transformers' logits."""

import pytest
import torch
import transformers

from mambaserve.loader import load_model
from tests.conftest import rel_err
from tests.models.harness import Harness
from tests.models.tiny import CONFIGS, _perturb, skip_unless_transformers_per_group

LENS = [1, 3, 10, 19]

# (tiny config, fields changed)
VARIANTS = [
    # transformers' GraniteMoeHybrid turns the whole head, whatever partial_rotary_factor says
    ("granite-dense-rope", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                                                "partial_rotary_factor": 0.5}}),
    ("granite-moe", {"position_embedding_type": "rope",
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}),
]


def _variant(base: str, fields: dict, path) -> transformers.PreTrainedModel:
    kw = {**CONFIGS[base], **fields}
    arch = kw.pop("arch")
    torch.manual_seed(0)
    hf = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**kw)).eval()
    _perturb(hf, 0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("base,fields", VARIANTS, ids=[f"{b}-{'-'.join(f)}" for b, f in VARIANTS])
def test_config_variant_matches_transformers(base, fields, tmp_path):
    hf = _variant(base, fields, tmp_path)
    skip_unless_transformers_per_group(hf)
    ours = load_model(tmp_path, dtype="float32")
    n_decode = 2
    seqs = [torch.randint(3, hf.config.vocab_size, (n + n_decode,)).tolist() for n in LENS]
    h = Harness(ours, len(LENS), max(LENS) + n_decode)
    got = h.step({i: s[:n] for i, (s, n) in enumerate(zip(seqs, LENS))})
    with torch.no_grad():
        for i, (s, n) in enumerate(zip(seqs, LENS)):
            assert rel_err(got[i], hf(torch.tensor([s[:n]])).logits[0]) < 1e-4, f"prefill of prompt {i} (len {n})"
        for t in range(n_decode):
            got = h.step({i: [s[n + t]] for i, (s, n) in enumerate(zip(seqs, LENS))})
            for i, (s, n) in enumerate(zip(seqs, LENS)):
                ref = hf(torch.tensor([s[:n + t + 1]])).logits[0, -1]
                assert rel_err(got[i][0], ref) < 1e-4, f"decode step {t} of prompt {i}"
