#!/usr/bin/env bash
# The GPU work a session owes, in device calls of under 10 minutes each, in priority order.
# Run from the repository root on the device machine; results land in $OUT (copy them into
# benchmarks/results/ afterwards). Chain the calls (each within the machine's 30 s idle window)
# to pay for one machine start only.
#   bash benchmarks/gpu_session.sh tests     # 1: every GPU test, bamba-9b throughput by step kind, a step profile (~9 min)
#   bash benchmarks/gpu_session.sh kernels   # bamba-9b step profiles, the Mamba kernel benchmarks, the decode MoE sweep (~7 min)
#   bash benchmarks/gpu_session.sh async     # granite batch-1 latency with and without async scheduling (~2 min)
#   bash benchmarks/gpu_session.sh verify    # all GPU tests (ops, engine, parity); mamba-130m latency and scan sweep (~8 min)
#   bash benchmarks/gpu_session.sh new       # Falcon-H1 and Jamba, never run on a GPU yet: their GPU tests and the router op (~4 min)
#   bash benchmarks/gpu_session.sh engine    # 2: the three issue-7 models, graphed, transformers, eager (9.5 min)
#   bash benchmarks/gpu_session.sh families  # 3: zamba2-2.7b and nemotron-h-8b latency (issue 11, ~5 min)
# A part cut short by its budget: `run_h200.py --resume` (see its docstring) completes it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
case "${1:-}" in
  tests)
    # -n 8: Triton compiles in parallel; -rP prints the near-tie reports of the bf16 comparisons
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rP tests/ops tests/engine/test_gpu.py \
      tests/models/test_demo_model.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|first differing"
    timeout 110 python3 -m pytest -q -p no:cacheprovider -n 8 tests/models/test_parity.py \
      tests/models/test_parity_zamba2_nemotron.py tests/engine/test_engine_zamba2_nemotron.py -k "cuda or gpu" 2>&1 \
      | tee -a "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED"
    # bamba-9b throughput with the engine's step breakdown (where the time of issue 7's target goes)
    timeout 170 python3 -m mambaserve.entrypoints.cli bench throughput --model benchmarks/configs/bamba-9b.json \
      --load-format dummy --dtype bfloat16 --dataset sharegpt-synthetic --num-prompts 1000 --max-model-len 4096 \
      --skip-tokenizer-init --disable-tqdm --output-json "$OUT/throughput-bamba-9b.json" 2>&1 | grep -E "^Throughput|^  steps|Error"
    timeout 90 python3 benchmarks/profile_step.py --model granite-4.0-tiny-preview --modes graphed \
      --output-json "$OUT/profile-granite-in1024.json" 2>&1 | grep -E "^\[|^ "
    ;;
  kernels)
    # bamba-9b: a prefill, decode at batch 32, and steps of 64 decodes + one 512-token prompt (host side too)
    timeout 200 python3 benchmarks/profile_step.py --model bamba-9b --modes graphed --input-len 512 --batch-size 32 \
      --decode-steps 8 --mixed-decodes 64 --share 0.8 --output-json "$OUT/profile-bamba-mixed.json" 2>&1 \
      | grep -E "^\[|^ " | cut -c1-150 | head -120
    timeout 200 python3 benchmarks/kernels.py --sweep --output-json "$OUT/kernels-h200.json" 2>&1 | tail -30
    timeout 60 python3 benchmarks/kernels_attention_moe.py --only-decode-moe --out "$OUT/moe-decode-sweep.json" 2>&1 | tail -9
    ;;
  async)
    # issue 6: batch-1 decode with and without async scheduling, side by side (granite, 1,024 and 31,500 in),
    # then the eager run at 31,500 in the same script (3 warm-up, 3 timed iterations each)
    for run in "--async-scheduling 1024" "--async-scheduling 31500" "--no-async-scheduling 1024" \
               "--no-async-scheduling 31500" "--enforce-eager 31500"; do
      set -- $run
      timeout 100 python3 -m mambaserve.entrypoints.cli bench latency --model benchmarks/configs/granite-4.0-tiny-preview.json \
        --load-format dummy --dtype bfloat16 --input-len "$2" --output-len 128 --batch-size 1 --num-iters-warmup 3 \
        --num-iters 3 --max-model-len 32768 --skip-tokenizer-init --disable-tqdm $1 \
        --output-json "$OUT/latency-granite-in$2${1/--/-}.json" 2>&1 | grep -E "^Avg latency|decode time|Error" | sed "s/^/[in$2 $1] /"
    done
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/engine/test_gpu.py -k "async" 2>&1 | tail -3
    ;;
  verify)
    timeout 260 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops tests/engine/test_gpu.py tests/models/test_demo_model.py \
      2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/models tests/engine -k "cuda or gpu" \
      --ignore tests/engine/test_gpu.py 2>&1 | tee -a "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
    timeout 60 python3 benchmarks/kernels.py --only selective_scan --sweep --output-json "$OUT/kernels-mamba1.json" 2>&1 | tail -12
    for run in "1 " "32 " "1 --enforce-eager"; do
      set -- $run
      timeout 60 python3 -m mambaserve.entrypoints.cli bench latency --model benchmarks/configs/mamba-130m.json --load-format dummy \
        --dtype bfloat16 --input-len 1024 --output-len 128 --batch-size "$1" --num-iters-warmup 2 --num-iters 3 \
        --max-model-len 2048 --skip-tokenizer-init --disable-tqdm ${2:-} --output-json "$OUT/latency-mamba-130m-bs$1${2:+-eager}.json" 2>&1 \
        | grep -E "^Avg latency|decode time|Error" | sed "s/^/[mamba-130m bs$1 ${2:-}] /"
    done
    ;;
  new)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_activation.py tests/engine/test_gpu.py \
      tests/models/test_parity.py tests/models/test_parity_falcon_h1.py tests/models/test_parity_jamba.py \
      tests/engine/test_engine_jamba.py -k "falcon or jamba or activation or topk or router" 2>&1 \
      | tee "$OUT/gpu-tests-new.log" | grep -E "passed|failed|FAILED|Error" | tail -15
    ;;
  engine)
    timeout 570 python3 benchmarks/run_h200.py --out-dir "$OUT" --budget-s 540 2>&1 | tail -40
    ;;
  families)
    # issue 11: eager and graphed, batch 1 and 32 (one warm-up, two timed iterations: eager decode is slow)
    for mode in "" "--enforce-eager"; do
      for b in 1 32; do
        for m in zamba2-2.7b nemotron-h-8b; do
          timeout 75 python3 -m mambaserve.entrypoints.cli bench latency --model "benchmarks/configs/$m.json" --load-format dummy \
            --dtype bfloat16 --input-len 1024 --output-len 128 --batch-size "$b" --num-iters-warmup 1 --num-iters 2 \
            --max-model-len 2048 --max-num-batched-tokens 4096 --disable-tqdm $mode --output-json "$OUT/latency-$m-bs$b${mode:+-eager}.json" 2>&1 \
            | grep -E "^Avg latency|decode time" | sed "s/^/[$m bs$b${mode:+ eager}] /"
        done
      done
    done
    ;;
  *) echo "usage: $0 tests|kernels|async|verify|new|engine|families" >&2; exit 2 ;;
esac
