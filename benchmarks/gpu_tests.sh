#!/usr/bin/env bash
# The GPU test suite (the tests that skip themselves without CUDA), in parts of under 5 minutes each.
# Run from the repository root on a GPU machine:
#   bash benchmarks/gpu_tests.sh [PART] [PYTEST_ARGS...]
#   all           (default) ops-engine, then models (~6 min)
#   ops-engine    every op test, the GPU engine tests (Triton vs reference, CUDA graphs vs eager), the demo model
#   models        the model and engine tests with a CUDA case ("cuda or gpu"): parity with transformers
#   falcon-jamba  the Falcon-H1 and Jamba GPU tests and the ops they add (activation, router top-k)
#   tensor-parallel  NCCL collectives captured in a CUDA graph (one GPU); two ranks against one (two GPUs)
# PYTEST_ARGS go to every pytest call (e.g. -k async; a -k of yours replaces the models part's own).
# Each part writes $OUT/gpu-tests-PART.log (the whole pytest output) and $OUT/gpu-tests-PART.json: GPU,
# commit, date, the selection, the passed / failed / error / skipped counts and the failing tests' ids.
# $OUT defaults to a new temporary folder: the logs are not results. The summary, not the log, goes
# into benchmarks/results/<gpu>/gpu-tests.json:
#   python3 benchmarks/file_results.py OUT/gpu-tests-*.json --commit HASH
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
PART=${1:-all}
PARALLEL=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
[ $# -gt 0 ] && shift

run_part() {  # NAME TIMEOUT_S PYTEST_ARGS...: one pytest call, its log and its summary
  local name=$1 limit=$2; shift 2
  local xml="$OUT/gpu-tests-$name.xml" start
  start=$(date +%s)
  # -n 8 (pytest-xdist): Triton compiles in parallel; -rP prints the near-tie reports of the bf16 comparisons
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider $PARALLEL -rP --junitxml="$xml" "$@" \
    >"$OUT/gpu-tests-$name.log" 2>&1
  local rc=$?
  python3 - "$xml" "$OUT/gpu-tests-$name.json" "$rc" "$(($(date +%s) - start))" "$(printf "%q " "$@")" <<'EOF'
import datetime, json, subprocess, sys, xml.etree.ElementTree as ET
xml, out, rc, seconds, selection = sys.argv[1:]
try:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
except ImportError:
    gpu = None
git = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True)
rec = {"kind": "gpu-tests", "gpu": gpu, "commit": git.stdout.strip() or None,
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "selection": selection.strip(), "exit_status": int(rc), "seconds": int(seconds)}
try:
    cases = list(ET.parse(xml).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    cases = None  # pytest was killed before it wrote the report (timeout), or did not start
if cases is not None:
    def outcome(case):
        kinds = {child.tag for child in case}
        return next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    ids = [(c.get("classname", "").replace(".", "/") + ".py::" + c.get("name", ""), outcome(c)) for c in cases]
    rec |= {k: sum(o == v for _, o in ids) for k, v in
            (("passed", "passed"), ("failed", "failure"), ("errors", "error"), ("skipped", "skipped"))}
    rec["failures"] = [i for i, o in ids if o in ("failure", "error")]
json.dump(rec, open(out, "w"), indent=1)
counts = ", ".join(f"{k} {rec[k]}" for k in ("passed", "failed", "errors", "skipped") if k in rec) or "no report"
print(f"[{out}] {counts} in {seconds} s (exit {rc})" + "".join(f"\n  FAILED {i}" for i in rec.get("failures", [])))
EOF
  rm -f "$xml"
}

case "$PART" in
  all|ops-engine)
    run_part ops-engine 260 tests/ops tests/engine/test_gpu.py tests/models/test_demo_model.py "$@" ;;&
  all|models)
    run_part models 150 tests/models tests/engine -k "cuda or gpu" --ignore tests/engine/test_gpu.py "$@" ;;&
  falcon-jamba)
    run_part falcon-jamba 300 tests/ops tests/models tests/engine \
      -k "falcon or jamba or activation or topk or router" "$@" ;;
  tensor-parallel)
    run_part tensor-parallel 300 tests/distributed tests/engine/test_tensor_parallel.py -k gpu "$@" ;;
  all|ops-engine|models) ;;
  *) echo "usage: $0 [all|ops-engine|models|falcon-jamba|tensor-parallel] [PYTEST_ARGS...]" >&2; exit 2 ;;
esac
echo "logs and summaries in $OUT"
