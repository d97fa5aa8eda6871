#!/usr/bin/env bash
# End-to-end figures of two checkouts measured side by side in one run on one GPU, so that a change
# is judged against its base under the same machine state (random bf16 weights, benchmarks/configs/).
# Run from the repository root on the GPU machine:
#   bash benchmarks/compare_trees.sh BASE_DIR [CASES...]
# BASE_DIR: another checkout of mambaserve (e.g. made here with `git worktree add .base <commit>`, named
# in the GPU call's carry list). Each case runs in the base, then in this tree, REPEATS times (default 1), so
# drift between the two halves of the run shows up as spread. CASES (default: all of them):
#   granite-31500   granite-4.0-tiny-preview latency, 31,500 in / 128 out / batch 1 (3 warm-up, 3 timed)
#   granite-1024    the same at 1,024 in
#   bamba-throughput  bamba-9b throughput, 1,000 sharegpt-synthetic requests
#   bamba-31500     bamba-9b latency, 31,500 in / 128 out / batch 1
# Writes $OUT/compare-trees.json (one record per case, tree and repeat: model, workload, GPU, date,
# both commits from $BASE_COMMIT / $HEAD_COMMIT, the figures) and prints a table.
set -uo pipefail
export PYTHONUNBUFFERED=1
BASE=${1:?usage: compare_trees.sh BASE_DIR [CASES...]}
shift
CASES=${*:-granite-31500 granite-1024 bamba-throughput}
OUT=${OUT:-$(mktemp -d)}
HEAD_DIR=$(pwd)
DUMMY="--load-format dummy --dtype bfloat16 --skip-tokenizer-init --disable-tqdm"
CFG=$HEAD_DIR/benchmarks/configs
records=$OUT/compare-trees.jsonl
: >"$records"

run_case() {  # TREE_DIR LABEL CASE REPEAT
  local dir=$1 label=$2 case=$3 rep=$4 json
  json=$OUT/tmp-$label-$case-$rep.json
  local cmd
  case "$case" in
    granite-31500|granite-1024|bamba-31500)
      local model=granite-4.0-tiny-preview in=${case#*-}
      [[ $case == bamba-* ]] && model=bamba-9b
      cmd="bench latency --model $CFG/$model.json $DUMMY --input-len $in --output-len 128 --batch-size 1
           --num-iters-warmup 3 --num-iters 3 --max-model-len 32768" ;;
    bamba-throughput)
      cmd="bench throughput --model $CFG/bamba-9b.json $DUMMY --dataset sharegpt-synthetic --num-prompts 1000
           --max-model-len 4096" ;;
    *) echo "unknown case $case" >&2; return ;;
  esac
  (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 -m mambaserve.entrypoints.cli $cmd --output-json "$json" \
    >"$OUT/tmp-$label-$case-$rep.log" 2>&1) || echo "[$label $case $rep] failed: $(tail -3 "$OUT/tmp-$label-$case-$rep.log")"
  python3 - "$json" "$label" "$case" "$rep" >>"$records" <<'EOF'
import json, sys
path, label, case, rep = sys.argv[1:]
try:
    rec = json.load(open(path))
except (OSError, ValueError):
    rec = {"error": "no result"}
print(json.dumps({"tree": label, "case": case, "repeat": int(rep), "result": rec}))
EOF
}

for rep in $(seq 1 "${REPEATS:-1}"); do
  for case in $CASES; do
    run_case "$BASE" base "$case" "$rep"
    run_case "$HEAD_DIR" head "$case" "$rep"
  done
done

python3 - "$records" "$OUT/compare-trees.json" <<'EOF'
import datetime, json, os, sys
import torch
rows = [json.loads(line) for line in open(sys.argv[1])]
def figure(r):
    res = r["result"]
    for key in ("avg_latency", "tokens_per_second", "total_tokens_per_second"):
        if key in res:
            return key, res[key]
    return None, None
out = {"kind": "compare-trees", "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "base_commit": os.environ.get("BASE_COMMIT"), "head_commit": os.environ.get("HEAD_COMMIT"),
       "weights": "dummy bf16", "records": rows}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"{'case':<18} {'tree':<5} {'rep':>3}  figure")
for r in rows:
    key, val = figure(r)
    res = r["result"]
    extra = ""
    if "avg_decode_time_per_token" in res:
        extra = f" prefill={res['avg_prefill_time']:.4f} s decode/token={res['avg_decode_time_per_token'] * 1e3:.3f} ms"
    print(f"{r['case']:<18} {r['tree']:<5} {r['repeat']:>3}  {key}={val}{extra}")
EOF
rm -f "$OUT"/tmp-*.json "$records"
echo "results in $OUT"
