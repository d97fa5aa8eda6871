#!/usr/bin/env bash
# Benchmarks on a GPU, in parts of under 10 minutes each, on random weights (benchmarks/configs/, bf16).
# Run from the repository root on the GPU machine: bash benchmarks/gpu_benchmarks.sh PART
# Results land in $OUT (default: a new temporary folder), at most 8 files a part.
#   models             bench_models.py: granite-4.0-tiny-preview, bamba-9b, mamba-codestral-7b; graphs,
#                      eager and transformers (9.5 min)
#   async-scheduling   granite batch-1 latency with and without async scheduling at 1,024 and 31,500 in,
#                      and eager at 31,500 (~2 min)
#   zamba2-nemotron-h  zamba2-2.7b and nemotron-h-8b latency, graphs and eager, batch 1 and 32 (~5 min)
#   mamba1             mamba-130m latency; the Mamba-1 scan kernel and its config sweep (~2 min)
#   kernels            bamba-9b step profiles, the Mamba2 kernel benchmarks and sweep, the decode MoE
#                      tile sweep (~7 min)
#   throughput-steps   bamba-9b throughput with its step breakdown; a granite step profile (~4 min)
#   structured-outputs granite-4.0-tiny-preview: 256 requests, none vs 25% vs all constrained by a JSON
#                      schema, and none vs 25% without async scheduling on a second engine (3 alternating
#                      repeats; xgrammar from the wheels in .whl/ when it is not installed; set
#                      MAMBASERVE_COMMIT to the measured commit: the copy has no .git; ~7 min)
#   prefix-caching     benchmarks/prefix_caching.py, granite-4.0-tiny-preview then bamba-9b: multi-turn (8k of
#                      history by turn 1), shared-prefix and sharegpt-synthetic with caching on vs off (~6 min)
#   fp8                benchmarks/fp8.py: granite-4.0-tiny-preview then bamba-9b, bf16 vs quantization=fp8 batch-1
#                      latency at 1,024 and 31,500 in / 128 out (prefill and decode apart), throughput (128 x
#                      1,024 / 128), 32k-token requests that fit with kv_cache_dtype auto vs fp8; one JSON per
#                      model (set MAMBASERVE_COMMIT: the copy has no .git; ~8 min)
#   step-floor         benchmarks/profile_step.py with its floor tables (benchmarks/floor.py): granite-4.0-tiny-preview
#                      decode and prefill at 1,024 and 31,500 in, bamba-9b decode at batch 1 and 32, the decode-step
#                      fusions on and off (graphed-unfused: the launches before them); then bench latency granite
#                      31,500 / 128 / batch 1 (set MAMBASERVE_COMMIT: the copy has no .git; ~8 min)
#   spec-decode        benchmarks/spec_decode.py: the demo model's n-gram acceptance on code-like prompts (k=4), then
#                      granite-4.0-tiny-preview and bamba-9b with 70% of 4 drafts force-accepted: verify step vs
#                      decode step at batch 1 and 32, batch-1 decode speed-up (set MAMBASERVE_COMMIT; ~6 min)
# Afterwards, in the checkout: `python3 benchmarks/file_results.py OUT/*.json --commit HASH` files the
# latency and throughput records (and bench-models.json) under benchmarks/results/<gpu>/; kernel and
# profile records go by hand to <gpu>/kernels/ and <gpu>/profiles/ (benchmarks/results/README.md).
# A `models` run cut short by its budget: `bench_models.py --resume` (see its docstring) completes it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
BENCH="python3 -m mambaserve.entrypoints.cli bench"
DUMMY="--load-format dummy --dtype bfloat16 --skip-tokenizer-init --disable-tqdm"
case "${1:-}" in
  structured-outputs)
    python3 -c "import xgrammar" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl xgrammar
    timeout 570 python3 benchmarks/structured_outputs.py --model benchmarks/configs/granite-4.0-tiny-preview.json \
      --load-format dummy --dtype bfloat16 --num-prompts 256 --constrained-fraction 0.25 \
      --output-json "$OUT/structured-outputs-granite-4.0-tiny-preview.json" 2>&1 | tail -6
    ;;
  prefix-caching)
    # one process per model, so that a timeout keeps the other's JSON (commit: $MAMBASERVE_COMMIT or git)
    # bamba-9b (about 5x slower per token) runs smaller workloads, so that both fit one 10-minute call
    timeout 250 python3 benchmarks/prefix_caching.py --models granite-4.0-tiny-preview \
      --output "$OUT/prefix-caching-granite-4.0-tiny-preview.json" 2>&1 | grep -E "^\[|Error|Traceback" | cut -c1-160
    timeout 300 python3 benchmarks/prefix_caching.py --models bamba-9b --mt-conversations 4 --pr-requests 48 \
      --sharegpt-prompts 120 --output "$OUT/prefix-caching-bamba-9b.json" 2>&1 | grep -E "^\[|Error|Traceback" | cut -c1-160
    ;;
  fp8)
    # one process per model, so that a timeout keeps the other's JSON
    timeout 250 python3 benchmarks/fp8.py --models granite-4.0-tiny-preview --output "$OUT/fp8-granite-4.0-tiny-preview.json" \
      2>&1 | grep -E "^\[|Error|Traceback" | cut -c1-200
    timeout 300 python3 benchmarks/fp8.py --models bamba-9b --output "$OUT/fp8-bamba-9b.json" \
      2>&1 | grep -E "^\[|Error|Traceback" | cut -c1-200
    ;;
  spec-decode)
    # one process per part and model, so that a timeout keeps the others' JSON
    timeout 150 python3 benchmarks/spec_decode.py --parts acceptance --output "$OUT/spec-decode-acceptance.json" 2>&1 \
      | grep -E "^\[|Error|Traceback" | cut -c1-200
    for m in granite-4.0-tiny-preview bamba-9b; do
      timeout 200 python3 benchmarks/spec_decode.py --parts cost --models "$m" --output "$OUT/spec-decode-$m.json" 2>&1 \
        | grep -E "^\[|Error|Traceback" | cut -c1-200
    done
    ;;
  models)
    timeout 570 python3 benchmarks/bench_models.py --out-dir "$OUT" --budget-s 540 2>&1 | tail -40
    ;;
  async-scheduling)
    # batch-1 decode with and without async scheduling, side by side (1,024 and 31,500 in), then eager at
    # 31,500 in the same script (3 warm-up, 3 timed iterations each)
    for run in "--async-scheduling 1024" "--async-scheduling 31500" "--no-async-scheduling 1024" \
               "--no-async-scheduling 31500" "--enforce-eager 31500"; do
      set -- $run
      timeout 100 $BENCH latency --model benchmarks/configs/granite-4.0-tiny-preview.json $DUMMY \
        --input-len "$2" --output-len 128 --batch-size 1 --num-iters-warmup 3 --num-iters 3 --max-model-len 32768 \
        $1 --output-json "$OUT/latency-granite-in$2${1/--/-}.json" 2>&1 \
        | grep -E "^Avg latency|decode time|Error" | sed "s/^/[in$2 $1] /"
    done
    ;;
  zamba2-nemotron-h)
    # eager and graphs, batch 1 and 32 (one warm-up, two timed iterations: eager decode is slow); 8 files
    for mode in "" "--enforce-eager"; do
      for b in 1 32; do
        for m in zamba2-2.7b nemotron-h-8b; do
          timeout 75 $BENCH latency --model "benchmarks/configs/$m.json" $DUMMY --input-len 1024 --output-len 128 \
            --batch-size "$b" --num-iters-warmup 1 --num-iters 2 --max-model-len 2048 --max-num-batched-tokens 4096 \
            $mode --output-json "$OUT/latency-$m-bs$b${mode:+-eager}.json" 2>&1 \
            | grep -E "^Avg latency|decode time" | sed "s/^/[$m bs$b${mode:+ eager}] /"
        done
      done
    done
    ;;
  mamba1)
    timeout 60 python3 benchmarks/kernels.py --only selective_scan --sweep \
      --output-json "$OUT/kernels-mamba1-selective-scan.json" 2>&1 | tail -12
    for run in "1 " "32 " "1 --enforce-eager"; do
      set -- $run
      timeout 60 $BENCH latency --model benchmarks/configs/mamba-130m.json $DUMMY --input-len 1024 --output-len 128 \
        --batch-size "$1" --num-iters-warmup 2 --num-iters 3 --max-model-len 2048 ${2:-} \
        --output-json "$OUT/latency-mamba-130m-bs$1${2:+-eager}.json" 2>&1 \
        | grep -E "^Avg latency|decode time|Error" | sed "s/^/[mamba-130m bs$1 ${2:-}] /"
    done
    ;;
  kernels)
    # bamba-9b: a prefill, decode at batch 32, and steps of 64 decodes + one 512-token prompt (host side too)
    timeout 200 python3 benchmarks/profile_step.py --model bamba-9b --modes graphed --input-len 512 --batch-size 32 \
      --decode-steps 8 --mixed-decodes 64 --share 0.8 \
      --output-json "$OUT/profile-bamba-9b-in512-bs32-mixed64.json" 2>&1 \
      | grep -E "^\[|^ " | cut -c1-150 | head -120
    timeout 200 python3 benchmarks/kernels.py --sweep --output-json "$OUT/kernels-mamba2.json" 2>&1 | tail -30
    timeout 60 python3 benchmarks/kernels_attention_moe.py --only-decode-moe \
      --out "$OUT/kernels-moe-decode-sweep.json" 2>&1 | tail -9
    ;;
  throughput-steps)
    # bamba-9b throughput with the engine's step breakdown (decode-graph, piecewise and eager steps)
    timeout 170 $BENCH throughput --model benchmarks/configs/bamba-9b.json $DUMMY --dataset sharegpt-synthetic \
      --num-prompts 1000 --max-model-len 4096 --output-json "$OUT/throughput-bamba-9b.json" 2>&1 \
      | grep -E "^Throughput|^  steps|Error"
    timeout 90 python3 benchmarks/profile_step.py --model granite-4.0-tiny-preview --modes graphed \
      --output-json "$OUT/profile-granite-4.0-tiny-preview-in1024-bs1.json" 2>&1 | grep -E "^\[|^ "
    ;;
  step-floor)
    # one engine per mode and run (graphed; graphed-unfused inside ops.unfused()); the per-kernel rows are left out
    # of the printout (they are in the JSON), the floor tables and summaries kept
    for run in "granite-4.0-tiny-preview 1024 1 graphed,graphed-unfused 110" "granite-4.0-tiny-preview 31500 1 graphed 110" \
               "bamba-9b 1024 1 graphed,graphed-unfused 150" "bamba-9b 1024 32 graphed 110"; do
      set -- $run
      timeout "$5" python3 benchmarks/profile_step.py --model "$1" --input-len "$2" --batch-size "$3" --modes "$4" \
        --decode-steps 16 --share 0.45 --output-json "$OUT/floor-$1-in$2-bs$3.json" 2>&1 \
        | grep -vE "^ +[0-9.]+ us +x" | grep -vE "Warning|warn\(" | cut -c1-170
    done
    timeout 100 $BENCH latency --model benchmarks/configs/granite-4.0-tiny-preview.json $DUMMY --input-len 31500 \
      --output-len 128 --batch-size 1 --num-iters-warmup 3 --num-iters 3 --max-model-len 32768 \
      --output-json "$OUT/latency-granite-4.0-tiny-preview-in31500-out128-bs1.json" 2>&1 \
      | grep -E "^Avg latency|decode time|prefill|Error" | sed "s/^/[granite in31500 out128 bs1] /"
    ;;
  *) echo "usage: $0 models|async-scheduling|zamba2-nemotron-h|mamba1|kernels|throughput-steps|structured-outputs|prefix-caching|step-floor|spec-decode" >&2; exit 2 ;;
esac
echo "results in $OUT"
