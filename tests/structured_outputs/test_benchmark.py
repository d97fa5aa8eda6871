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
KINDS = ("none_constrained", "constrained", "all_constrained", "none_constrained_sync", "constrained_sync")


def test_record_of_a_tiny_run(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("structured_outputs_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("MAMBASERVE_COMMIT", "abc123")  # the GPU machine's copy has no .git
    out = tmp_path / "so.json"
    assert bench.main(["--model", tokenized_checkpoint(), "--dtype", "float32", "--device", "cpu", "--num-prompts", "8",
                       "--input-len", "5", "--output-len", "6", "--repeats", "2", "--output-json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["num_prompts"] == 8 and rec["num_constrained"] == 2 and rec["commit"] == "abc123"
    for kind in KINDS:
        run = rec[kind]
        assert run["output_tokens"] == 8 * 6 and run["finish_reasons"] == ["length"]  # the same work in each run
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["seconds"])
        assert len(run["all_seconds"]) == 2 and run["seconds"] in run["all_seconds"]
        constrained = kind not in ("none_constrained", "none_constrained_sync")
        assert (run["mask_fill_seconds"] > 0) == constrained  # no fill without a constrained row
        assert run["mask_host_seconds"] > 0 or not constrained
    assert rec["cost"] == pytest.approx(rec["constrained"]["seconds"] / rec["none_constrained"]["seconds"] - 1)
    assert rec["cost_all_constrained"] == pytest.approx(
        rec["all_constrained"]["seconds"] / rec["none_constrained"]["seconds"] - 1)
    assert rec["cost_sync"] == pytest.approx(
        rec["constrained_sync"]["seconds"] / rec["none_constrained_sync"]["seconds"] - 1)
    assert rec["meets_target"] == (rec["cost"] < 0.10) and rec["environment"]["gpu"] == "cpu"


def test_commit_falls_back_to_git(monkeypatch):
    spec = importlib.util.spec_from_file_location("structured_outputs_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.delenv("MAMBASERVE_COMMIT", raising=False)
    head = bench.commit()
    assert head is None or len(head) == 40
