"""Greedy outputs of every family's tiny checkpoint, on the CPU in float32 and bfloat16, equal
the ones recorded before the decode-step fusions (tests/data/greedy_before_fusions.json: the
residual add folded into the next RMSNorm in Nemotron-H and Zamba2, the gated norm folded
into out_proj, the router in one launch). The record was written by this file's
`record()` on main at f87b3ee with torch 2.13 (`python -m tests.models.test_greedy_unchanged`);
transformers parity is checked elsewhere, this checks that the fused paths changed no token.
Another torch's CPU kernels may round bfloat16 differently: the test runs under the recording's
torch version only (re-record for another).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.engines import make, prompts_for, run

RECORD = Path(__file__).resolve().parents[1] / "data" / "greedy_before_fusions.json"
NAMES = ["granite-moe", "granite-moe-absorbed", "granite-dense-rope", "bamba", "bamba-head-dim", "mamba2",
         "mamba2-untied", "zamba2", "zamba2-gqa", "nemotron-h", "nemotron-h-moe", "falcon-h1", "falcon-h1-norm",
         "falcon-h1-norm-first", "jamba", "mamba1"]
DTYPES = ["float32", "bfloat16"]
RECORDED_WITH = "2.13"  # torch major.minor of the record


def greedy(name: str, dtype: str) -> list[list[int]]:
    """Greedy 10-token answers of the tiny checkpoint to its six seeded prompts (lengths 1-30)."""
    return run(make(name, dtype=dtype), prompts_for(name))


def record() -> None:
    runs = {f"{n}/{d}": greedy(n, d) for n in NAMES for d in DTYPES}
    RECORD.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in runs.items()) + "\n}\n")


@pytest.mark.skipif(".".join(torch.__version__.split(".")[:2]) != RECORDED_WITH,
                    reason=f"the record is of torch {RECORDED_WITH}'s CPU kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_unchanged(name, dtype):
    assert greedy(name, dtype) == json.loads(RECORD.read_text())[f"{name}/{dtype}"]


if __name__ == "__main__":
    record()
    sys.exit(0)
