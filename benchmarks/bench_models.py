"""Latency and throughput of the model configs on the GPU at hand: mambaserve with CUDA graphs,
mambaserve eager, and transformers, in one command that ends within a time budget (default 9 min).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_models.py --out-dir "$OUT"
    python3 benchmarks/file_results.py "$OUT/bench-models.json" --commit HASH   # afterwards, in the checkout

For granite-4.0-tiny-preview, bamba-9b and mamba-codestral-7b (benchmarks/configs/, random
weights, bfloat16) it runs:
- mambaserve with CUDA graphs (the default compilation mode): latency at (input 1,024, output
  128, batch 1), (31,500, 128, 1) and (1,024, 128, 32); throughput on 1,000 requests of the
  built-in ShareGPT-shaped dataset;
- transformers `generate` (benchmarks/hf_baseline.py) on the same workloads, except the
  31,500-token one (it runs out of memory there), one timed iteration each, throughput capped
  at --hf-max-seconds;
- mambaserve with --enforce-eager on the three latency workloads.
Each (engine, model) pair is one worker process that builds the engine once and runs its
workloads in turn, in that priority order; a worker gets what is left of the budget (keeping a
floor for each worker still to come) and is killed past it. Every workload writes its own
record (the same JSON as `mambaserve bench ...` / hf_baseline.py) as soon as it ends, and
after every worker the driver merges all of them into OUT/bench-models.json and rewrites
OUT/bench-models.md (the table: ours vs transformers); the workers' output goes to
OUT/bench-models.log. A run cut short still leaves what it measured. Without --out-dir (and no
$OUT) the files go to a new temporary folder, named at the end. Three files in all, whatever the
number of workloads; file_results.py then files each record under benchmarks/results/<gpu>/
(latency/, throughput/, and the table as models.md).

Arguments: --out-dir, --work-dir (the per-workload records; default a temporary folder),
--models (config names or paths), --parts (graphed hf eager), --budget-s (540),
--hf-max-seconds (20), --resume, --smoke. A run cut short is completed by a second one that
resumes from the first's records: `--resume bench-models.json` (a copy of the first run's file
in the checkout) runs only the workers it lacks and writes the merged file. --smoke shrinks
every workload to a few tokens so the plumbing runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the GPU machine runs from a checkout, mambaserve not installed
MODELS = ["granite-4.0-tiny-preview", "bamba-9b", "mamba-codestral-7b"]
PARTS = ["graphed", "hf", "eager"]  # priority order
MAX_MODEL_LEN = 32768  # the 31,500 + 128 workload fits
# (name, input_len, output_len, batch_size, warmup, iters) per part; the transformers runs are
# one timed iteration (it takes ~0.13 s a decode step) and skip the long prompt (out of memory)
LATENCY = {
    "graphed": [("in1024-out128-bs1", 1024, 128, 1, 2, 5), ("in31500-out128-bs1", 31500, 128, 1, 1, 3),
                ("in1024-out128-bs32", 1024, 128, 32, 1, 3)],
    # eager decode is host-bound (about 40-50 ms a token): fewer iterations, so all three fit
    "eager": [("in1024-out128-bs1", 1024, 128, 1, 1, 2), ("in31500-out128-bs1", 31500, 128, 1, 1, 2),
              ("in1024-out128-bs32", 1024, 128, 32, 1, 1)],
    "hf": [("in1024-out128-bs1", 1024, 128, 1, 0, 1), ("in1024-out128-bs32", 1024, 128, 32, 0, 1)],
}
NUM_PROMPTS = 1000
SKIPPED = {("hf", "in31500-out128-bs1"): "transformers runs out of memory on a 31,500-token prompt"}
CAP_S = {"graphed": 150, "hf": 100, "eager": 90}  # most seconds one worker may take
FLOOR_S = {"graphed": 45, "hf": 40, "eager": 35}  # kept back for each worker still to come
SMOKE = {"latency": (12, 3, 2, 0, 1), "num_prompts": 4, "output_len": 3}


# ------------------------------------------------------------------ workers
def _model_args(model: str, smoke: bool) -> list[str]:
    # relative to the repository (the workers run there), so that records hold no machine paths
    path = model if os.path.exists(model) else f"benchmarks/configs/{model}.json"
    if smoke:
        return ["--model", path, "--dtype", "float32"]
    return ["--model", path, "--load-format", "dummy", "--dtype", "bfloat16"]


def _latency_jobs(part: str, smoke: bool):
    for name, i, o, b, w, n in LATENCY[part]:
        if smoke:
            i, o, b, w, n = SMOKE["latency"]
        yield f"latency-{name}", ["--input-len", str(i), "--output-len", str(o), "--batch-size", str(b),
                                  "--num-iters-warmup", str(w), "--num-iters", str(n)]


def _throughput_flags(smoke: bool, hf: bool = False) -> list[str]:
    flags = ["--dataset", "sharegpt-synthetic", "--num-prompts", str(SMOKE["num_prompts"] if smoke else NUM_PROMPTS)]
    if smoke:
        flags += ["--output-len", str(SMOKE["output_len"])] + ([] if hf else ["--num-warmup-prompts", "1"])
    if hf:
        # transformers' PyTorch SSD scan needs 128-512 GiB at batches of 32 of these prompts (out
        # of memory on the H200): batches of 2 fit
        flags += ["--hf-max-batch-size", "2"]
    return flags


def worker_ours(model: str, part: str, work: Path, smoke: bool) -> None:
    """One engine for `model`, all its workloads in turn; a record file per workload."""
    from mambaserve.benchmarks import latency, throughput
    from mambaserve.entrypoints.cli import build_parser
    from mambaserve.llm import LLM

    engine_flags = _model_args(model, smoke) + ["--max-model-len", str(MAX_MODEL_LEN), "--skip-tokenizer-init"]
    if part == "eager":
        engine_flags.append("--enforce-eager")
    parse = build_parser().parse_args
    t0 = time.perf_counter()
    llm = None
    jobs = list(_latency_jobs(part, smoke))
    if part == "graphed":
        jobs.append(("throughput-sharegpt-synthetic", _throughput_flags(smoke)))
    for job, flags in jobs:
        kind = job.split("-")[0]
        out = work / f"{_stem(model)}__mambaserve-{part}__{job}.json"
        args = parse(["bench", kind, *engine_flags, *flags, "--disable-tqdm", "--output-json", str(out)])
        if llm is None:
            from mambaserve.engine.arg_utils import engine_config_from_args

            llm = LLM.from_config(engine_config_from_args(args))
            print(f"[{model} {part}] engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        t = time.perf_counter()
        (latency if kind == "latency" else throughput).main(args, llm=llm)
        print(f"[{model} {part}] {job} done in {time.perf_counter() - t:.1f} s", flush=True)


def worker_hf(model: str, work: Path, smoke: bool, max_seconds: float) -> None:
    """One transformers model for `model`, the baseline workloads in turn."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import hf_baseline

    model_flags = _model_args(model, smoke)
    model_flags = [f for f in model_flags if f not in ("--load-format", "dummy")]
    t0 = time.perf_counter()
    probe = hf_baseline.build_parser().parse_args(["latency", *model_flags])
    device = "cuda" if hf_baseline.torch.cuda.is_available() else "cpu"
    net = hf_baseline.load_hf_model(probe.model, hf_baseline.DTYPES[probe.dtype], device)
    print(f"[{model} hf] model ready in {time.perf_counter() - t0:.1f} s", flush=True)
    jobs = [(job, ["latency", *model_flags, *flags]) for job, flags in _latency_jobs("hf", smoke)]
    jobs.append(("throughput-sharegpt-synthetic",
                 ["throughput", *model_flags, *_throughput_flags(smoke, hf=True), "--max-seconds", str(max_seconds)]))
    for job, argv in jobs:
        t = time.perf_counter()
        hf_baseline.main([*argv, "--output-json", str(work / f"{_stem(model)}__transformers__{job}.json")], net=net)
        print(f"[{model} hf] {job} done in {time.perf_counter() - t:.1f} s", flush=True)


def _stem(model: str) -> str:
    return Path(model).stem if model.endswith(".json") else Path(model).name


# ------------------------------------------------------------------ driver
def run_worker(cmd: list[str], timeout: float, log) -> str:
    """Run a worker in its own process group; kill the group past `timeout`. Returns its status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True, text=True, errors="replace")
    deadline = time.monotonic() + timeout
    tail: list[str] = []
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        line = proc.stdout.readline()
        if line:
            log.write(line)
            tail = (tail + [line])[-40:]
            if line.startswith("["):
                print("   " + line.rstrip(), flush=True)
            continue
        if proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"killed after {timeout:.0f} s (time budget)"
        time.sleep(0.2)
    log.flush()
    if proc.returncode != 0:
        print("   worker failed; its last lines:\n" + "".join("   | " + t for t in tail[-25:]), flush=True)
        return f"failed (exit {proc.returncode})"
    return "ok"


def expected_runs(models: list[str], parts: list[str]) -> list[str]:
    names = []
    for model in models:
        for part in parts:
            engine = "transformers" if part == "hf" else f"mambaserve-{part}"
            jobs = [f"latency-{n[0]}" for n in LATENCY["graphed"]]
            jobs += ["throughput-sharegpt-synthetic"] if part in ("graphed", "hf") else []
            names += [f"{_stem(model)}__{engine}__{job}" for job in jobs]
    return names


def merge(work: Path, out_dir: Path, models, statuses: dict, started: float, prior: dict) -> dict:
    """All records so far (this run's, else `prior`'s), in one JSON; a run without one says why."""
    from mambaserve.benchmarks.common import write_json

    runs = {}
    for name in expected_runs(models, PARTS):
        path = work / f"{name}.json"
        _, engine, job = name.split("__")
        part = "hf" if engine == "transformers" else engine.split("-")[1]
        if path.is_file():
            with open(path) as f:
                runs[name] = json.load(f)
        elif (part, job.removeprefix("latency-")) in SKIPPED:
            runs[name] = {"skipped": SKIPPED[(part, job.removeprefix("latency-"))]}
        elif _measured(prior.get(name)):
            runs[name] = prior[name]
        else:
            worker = f"{name.split('__')[0]}/{part}"
            runs[name] = {"not_run": statuses.get(worker, "not started (time budget or --parts)")}
    gpu = next((r["environment"]["gpu"] for r in runs.values() if "environment" in r), None)
    result = {"gpu": gpu, "commit": _commit(), "elapsed_s": round(time.monotonic() - started, 1),
              "workers": statuses, "runs": runs}
    result["summary_markdown"] = summary_table(runs, models)
    write_json(out_dir / "bench-models.json", result)
    (out_dir / "bench-models.md").write_text(f"GPU: {gpu}\n\n" + result["summary_markdown"] + "\n")
    return result


def _commit() -> str | None:
    """The checkout's commit, if it is a git checkout (a copied tree is not: file_results.py --commit)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _measured(rec: dict | None) -> bool:
    return bool(rec) and ("avg_latency" in rec or "tokens_per_second" in rec)


def _cell(rec: dict | None, kind: str) -> str:
    if rec is None:
        return "-"
    if "skipped" in rec:
        return "OOM (skipped)" if "memory" in rec["skipped"] else "skipped"
    if "not_run" in rec or "error" in rec:
        return "OOM" if "memory" in rec.get("error", "") else "not run"
    if kind == "latency":
        return f"{rec['avg_latency']:.3f} s ({rec['avg_decode_time_per_token'] * 1e3:.2f} ms/tok)"
    cut = f", {rec['elapsed_time']:.0f}-s window" if rec.get("truncated") else ""
    return f"{rec['tokens_per_second']:,.0f} tok/s ({rec['output_tokens_per_second']:,.0f} out{cut})"


def summary_table(runs: dict, models) -> str:
    """Markdown: per model and workload, ours (graphs, eager), transformers, and the speed-up."""
    rows = ["| model | workload | mambaserve (graphs) | mambaserve (eager) | transformers | speed-up vs transformers |",
            "|---|---|---|---|---|---|"]
    for model in models:
        m = _stem(model)
        for job in [f"latency-{n[0]}" for n in LATENCY["graphed"]] + ["throughput-sharegpt-synthetic"]:
            kind = job.split("-")[0]
            engines = ("mambaserve-graphed", "mambaserve-eager", "transformers")
            g, e, h = (runs.get(f"{m}__{eng}__{job}") for eng in engines)
            ratio = "-"
            if _measured(g) and _measured(h):
                ratio = (h["avg_latency"] / g["avg_latency"] if kind == "latency"
                         else g["tokens_per_second"] / h["tokens_per_second"])
                ratio = f"{ratio:.1f}x"
            rows.append(f"| {m} | {job} | {_cell(g, kind)} | {_cell(e, kind)} | {_cell(h, kind)} | {ratio} |")
    rows += ["", "Latency: average seconds per batch (decode ms per output token); throughput: total tokens/s "
             "(output tokens/s). Speed-up: transformers' latency over ours with graphs, or our throughput over "
             "transformers' (a transformers run cut to a time window overstates it: the speed-up is then a lower "
             "bound)."]
    rows += _targets(runs, models)
    return "\n".join(rows)


def _targets(runs: dict, models) -> list[str]:
    """The targets: bamba-9b >= 11,000 total tokens/s; every latency workload >= 10x transformers."""
    lines = []
    thr = runs.get("bamba-9b__mambaserve-graphed__throughput-sharegpt-synthetic")
    if "bamba-9b" in [_stem(m) for m in models] and _measured(thr):
        ok = "met" if thr["tokens_per_second"] >= 11000 else "NOT met"
        lines.append(f"- bamba-9b throughput {thr['tokens_per_second']:,.0f} total tokens/s (target >= 11,000): {ok}")
    for model in models:
        for name, *_ in LATENCY["hf"]:
            g = runs.get(f"{_stem(model)}__mambaserve-graphed__latency-{name}")
            h = runs.get(f"{_stem(model)}__transformers__latency-{name}")
            if _measured(g) and _measured(h):
                r = h["avg_latency"] / g["avg_latency"]
                lines.append(f"- {_stem(model)} latency {name}: {r:.1f}x transformers (target >= 10x): "
                             f"{'met' if r >= 10 else 'NOT met'}")
    return ["", "Targets:"] + lines if lines else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT") or None,
                   help="where bench-models.json/.md/.log go (default: $OUT, else a new temporary folder)")
    p.add_argument("--work-dir", default=None,
                   help="where each workload's record goes (default: a temporary folder; "
                        "bench-models.json holds them all)")
    p.add_argument("--models", nargs="+", default=MODELS, help="config names in benchmarks/configs, or paths")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--hf-max-seconds", type=float, default=20)
    p.add_argument("--resume", default=None, metavar="BENCH_MODELS_JSON",
                   help="an earlier run's bench-models.json: keep its records, run only the workers it lacks")
    p.add_argument("--smoke", action="store_true", help="a few tokens per workload, float32: test the plumbing on CPU")
    p.add_argument("--worker", nargs=2, metavar=("PART", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-models-out-"))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mambaserve-bench-models-"))
    if args.worker:
        part, model = args.worker
        if part == "hf":
            worker_hf(model, work, args.smoke, args.hf_max_seconds)
        else:
            worker_ours(model, part, work, args.smoke)
        return 0

    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    prior = {}
    if args.resume:
        with open(args.resume) as f:
            prior = json.load(f)["runs"]
    plan = [(part, model) for part in args.parts for model in args.models
            if not all(_measured(prior.get(n)) or "skipped" in prior.get(n, {})
                       for n in expected_runs([model], [part]))]
    statuses: dict[str, str] = {}
    with open(out_dir / "bench-models.log", "a") as log:
        for k, (part, model) in enumerate(plan):
            left = args.budget_s - (time.monotonic() - started)
            reserve = sum(FLOOR_S[q] for q, _ in plan[k + 1:])
            # earlier workers come first: at least their floor, else what the later floors leave
            timeout = min(CAP_S[part], max(FLOOR_S[part], left - reserve), left - 5)
            key = f"{_stem(model)}/{part}"
            if timeout < 15:
                statuses[key] = "not started (time budget)"
                print(f"-- {key}: skipped, {left:.0f} s left", flush=True)
                continue
            print(f"-- {key}: up to {timeout:.0f} s ({left:.0f} s left)", flush=True)
            log.write(f"\n===== {key}\n")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, model, "--work-dir", str(work),
                   "--hf-max-seconds", str(min(args.hf_max_seconds, max(5.0, timeout / 4)))]
            statuses[key] = run_worker(cmd + (["--smoke"] if args.smoke else []), timeout, log)
            merge(work, out_dir, args.models, statuses, started, prior)
    result = merge(work, out_dir, args.models, statuses, started, prior)
    print(f"\nGPU: {result['gpu']}; {result['elapsed_s']} s; records in {out_dir / 'bench-models.json'}\n")
    print(result["summary_markdown"])
    missing = sorted({f"{k}: {v}" for k, v in statuses.items() if v != "ok"})
    if missing:
        print("\nincomplete workers:\n  " + "\n  ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
