"""benchmarks/structured_outputs.py on a tiny checkpoint with a tokenizer (the GPU numbers come
from the lead's runs): its record holds what it says, with equal work in every run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from tests.tokenized import tokenized_checkpoint  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"


def test_record_of_a_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("structured_outputs_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "so.json"
    assert bench.main(["--model", tokenized_checkpoint(), "--dtype", "float32", "--device", "cpu", "--num-prompts", "8",
                       "--input-len", "5", "--output-len", "6", "--repeats", "1", "--output-json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["num_prompts"] == 8 and rec["num_constrained"] == 2 and rec["commit"]
    for kind in ("none_constrained", "constrained", "none_constrained_sync"):
        run = rec[kind]
        assert run["output_tokens"] == 8 * 6 and run["finish_reasons"] == ["length"]  # the same work in each run
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["seconds"])
    assert rec["constrained"]["mask_host_seconds"] > rec["none_constrained"]["mask_host_seconds"]  # a scan only
    assert rec["cost"] == pytest.approx(rec["constrained"]["seconds"] / rec["none_constrained"]["seconds"] - 1)
    assert rec["meets_target"] == (rec["cost"] < 0.10) and rec["environment"]["gpu"] == "cpu"
