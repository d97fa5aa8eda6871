"""File latency and throughput records into benchmarks/results/, one file per measured thing.

    python3 benchmarks/file_results.py RECORD.json [RECORD.json ...] --commit HASH [--results DIR]

A RECORD is what `mambaserve bench latency|throughput --output-json`, `benchmarks/hf_baseline.py
--output-json` or `benchmarks/bench_models.py` wrote (bench-models.json holds a record per
workload; its table goes to <gpu>/models.md). Each measurement lands in

    DIR/<gpu>/latency/<model>-in<I>-out<O>-bs<B>[-<variant>].json
    DIR/<gpu>/throughput/<model>-<dataset>-<num_prompts>[-<variant>].json

<gpu> is the device name without its vendor ("NVIDIA H200" -> h200). <variant> is empty for the
default engine (CUDA graphs, async scheduling), else `eager` (--enforce-eager),
`no-async-scheduling`, `eager-no-async-scheduling`, or `transformers` (transformers' generate).
The record gains model, workload, variant, gpu, date and commit as its first fields; machine
paths among its flags become paths in the repository. Where the file exists, the newer
measurement (by date) stays whole and the older one becomes an entry of its "history" (newest
first: commit, date, the measured fields, versions and flags). --commit names the code
that was measured (the GPU machine's copy of the tree has no git history to ask).

A summary of a GPU test run (gpu_tests.sh's gpu-tests-PART.json) goes into DIR/<gpu>/gpu-tests.json,
newest first; the test log itself is not kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROVENANCE = ("model", "workload", "variant", "gpu", "date", "commit")
# what a history entry leaves out: the file's own name says these (engine_config repeats args)
SAME_IN_HISTORY = ("model", "workload", "variant", "gpu", "benchmark", "engine_config", "history")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; 'cpu' -> 'cpu'."""
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "unknown-gpu"


def model_name(model: str) -> str:
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".json" else path.name


def variant_of(rec: dict) -> str:
    if rec["environment"].get("engine") == "transformers":
        return "transformers"
    args = rec.get("args", {})
    eager = bool(args.get("enforce_eager")) or rec.get("compilation_mode") in ("eager", "none")
    parts = (["eager"] if eager else []) + (["no-async-scheduling"] if args.get("async_scheduling") is False else [])
    return "-".join(parts) or "graphs"


def workload_of(rec: dict) -> str:
    args = rec.get("args", {})
    if rec["benchmark"] == "latency":
        return f"in{args['input_len']}-out{args['output_len']}-bs{args['batch_size']}"
    if rec["benchmark"] == "throughput":
        dataset = args["dataset"]
        if dataset == "random":
            dataset = f"random-in{args['input_len']}-out{args['output_len']}"
        elif dataset.endswith(".json"):
            dataset = Path(dataset).stem
        return f"{dataset}-{args['num_prompts']}"
    raise ValueError(f"not a latency or throughput record: benchmark={rec['benchmark']!r}")


def place(rec: dict, results: Path) -> Path:
    """Where `rec` is filed: results/<gpu>/<latency|throughput>/<model>-<workload>[-<variant>].json."""
    model = model_name(rec.get("args", {}).get("model") or rec["engine_config"]["model"])
    variant = variant_of(rec)
    stem = f"{model}-{workload_of(rec)}" + ("" if variant == "graphs" else f"-{variant}")
    return results / gpu_slug(rec["environment"]["gpu"]) / rec["benchmark"] / f"{stem}.json"


def _in_repo(key: str, value: str, here: str) -> str:
    """A machine path as the repository knows it: configs from benchmarks/, the record's own path
    for output_json, else the last path component (a checkpoint folder's name)."""
    if not value.startswith("/"):
        return value
    tail = value.partition("/benchmarks/")[2]
    if tail:
        return f"benchmarks/{tail}"
    return here if key == "output_json" else Path(value).name


def with_provenance(rec: dict, path: Path, commit: str | None) -> dict:
    """`rec` with model, workload, variant, gpu, date and commit first and no machine paths."""
    here = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    rec = json.loads(json.dumps(rec))
    for section in ("args", "engine_config"):
        for key, value in rec.get(section, {}).items():
            if isinstance(value, str):
                rec[section][key] = _in_repo(key, value, here)
    head = {"model": model_name(rec.get("args", {}).get("model") or rec["engine_config"]["model"]),
            "workload": workload_of(rec), "variant": variant_of(rec), "gpu": rec["environment"]["gpu"],
            "date": rec.get("date") or rec["environment"]["timestamp"], "commit": rec.get("commit") or commit}
    return head | {k: v for k, v in rec.items() if k not in PROVENANCE}


def history_entry(old: dict) -> dict:
    """What `old` measured, for a history: its commit, date, results, versions and flags."""
    entry = {"commit": old.get("commit"), "date": old.get("date")}
    entry |= {k: v for k, v in old.items() if k not in SAME_IN_HISTORY + ("commit", "date")}
    if "args" in entry:
        entry["args"] = {k: v for k, v in entry["args"].items() if k != "output_json"}
    return entry


def merge(existing: dict | None, rec: dict) -> dict:
    """The newer of the two measurements whole, the older in front of the other's history."""
    if existing is None:
        return rec
    if (existing["date"], existing.get("commit")) == (rec["date"], rec.get("commit")):
        if existing.get("history") and not rec.get("history"):
            rec["history"] = existing["history"]
        return rec  # the same measurement filed again
    history = existing.pop("history", []) + rec.pop("history", [])
    newer, older = (rec, existing) if rec["date"] >= existing["date"] else (existing, rec)
    history.append(history_entry(older))
    newer["history"] = sorted(history, key=lambda e: e.get("date") or "", reverse=True)
    return newer


def file_record(rec: dict, results: Path, commit: str | None) -> Path:
    path = place(rec, results)
    rec = with_provenance(rec, path, commit)
    existing = json.loads(path.read_text()) if path.is_file() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merge(existing, rec), indent=1) + "\n")
    return path


def records_of(doc: dict) -> list[dict]:
    """The records in a file: a bench-models.json holds one per workload (skipped ones hold none)."""
    if "runs" in doc:
        return [r for r in doc["runs"].values() if "benchmark" in r and "environment" in r]
    if "benchmark" in doc:
        return [doc]
    raise ValueError("neither a bench record nor a bench-models.json (no 'benchmark' or 'runs' field)")


def write_models_table(doc: dict, results: Path, commit: str | None) -> Path | None:
    """bench-models.json's table as <gpu>/models.md, headed by the GPU, commit and date."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_models

    recs = records_of(doc)
    if not recs:
        return None
    gpu = recs[0]["environment"]["gpu"]
    date = min(r["environment"]["timestamp"] for r in recs)
    models = list(dict.fromkeys(name.split("__")[0] for name in doc["runs"]))
    lines = [f"GPU: {gpu}; commit {doc.get('commit') or commit}; {date[:10]}", "",
             bench_models.summary_table(doc["runs"], models)]
    cut = [f"{k}: {v}" for k, v in doc.get("workers", {}).items() if v != "ok"]
    if cut:
        lines += ["", "Incomplete: " + "; ".join(cut) + "."]
    path = results / gpu_slug(gpu) / "models.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def file_test_summary(summary: dict, results: Path, commit: str | None) -> Path:
    """A GPU test run's summary (benchmarks/gpu_tests.sh), newest first in <gpu>/gpu-tests.json."""
    if not summary.get("gpu") or summary["gpu"] == "cpu":
        raise ValueError("a GPU test summary without a GPU name")
    summary = {k: v for k, v in summary.items() if k != "kind"}
    summary["commit"] = summary.get("commit") or commit
    path = results / gpu_slug(summary["gpu"]) / "gpu-tests.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    doc["runs"] = sorted(doc["runs"] + [summary], key=lambda r: r.get("date") or "", reverse=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="bench records, bench-models.json files or gpu_tests.sh summaries")
    p.add_argument("--commit", default=None, help="the commit measured (kept where a record names its own)")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    results = Path(args.results).resolve()
    for name in args.records:
        doc = json.loads(Path(name).read_text())
        if doc.get("kind") == "gpu-tests":
            print(f"{name} -> {file_test_summary(doc, results, args.commit)}")
            continue
        for rec in records_of(doc):
            rec = dict(rec, commit=rec.get("commit") or doc.get("commit"))
            print(f"{name} -> {file_record(rec, results, args.commit)}")
        if "runs" in doc:
            print(f"{name} table -> {write_models_table(doc, results, args.commit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
