#!/usr/bin/env bash
# lm_eval on the bundled demo model, bfloat16 weights against quantization=fp8 (online FP8), on the
# repository's tiny local tasks (tests/data/lm_eval_tasks: multiple choice, rolling perplexity, greedy
# generation). A few minutes on the 2-core CPU machine; DEVICE=cuda for a GPU.
# Usage, from the repository root: bash benchmarks/fp8_lm_eval.sh [OUT_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$(mktemp -d)}
cd "$ROOT/tests/data/lm_eval_tasks"  # the tasks' data_files are relative to their folder
for q in none fp8; do
  extra=""
  [ "$q" = fp8 ] && extra=",quantization=fp8"
  PYTHONPATH="$ROOT" python3 -m mambaserve.eval --model mambaserve \
    --model_args "pretrained=$ROOT/mambaserve/assets/demo-model,dtype=bfloat16$extra" --device "${DEVICE:-cpu}" \
    --include_path . --tasks mambaserve_mc,mambaserve_ppl,mambaserve_gen --batch_size auto \
    --output_path "$OUT/$q" 2>&1 | { grep -E "^\|" || true; } | sed "s/^/[$q] /"
done
echo "results under $OUT"
