#!/usr/bin/env bash
# The GPU work a session owes, in three device calls of under 10 minutes each, in priority order.
# Run from the repository root on the device machine; results land in $OUT (copy them into
# benchmarks/results/ afterwards).
#   bash benchmarks/gpu_session.sh tests     # 1: every GPU test, then the kernel benchmark with its sweep
#   bash benchmarks/gpu_session.sh engine    # 2: the three issue-7 models, graphed, transformers, eager
#   bash benchmarks/gpu_session.sh families  # 3: zamba2-2.7b and nemotron-h-8b latency (issue 11)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
case "${1:-}" in
  tests)
    # ops tests run on CUDA by themselves when it is there; the model files mix CPU and GPU cases
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops tests/engine/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/models tests/engine/test_engine_zamba2_nemotron.py \
      -k "cuda or gpu" 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -15
    timeout 240 python3 benchmarks/kernels.py --sweep --output-json "$OUT/kernels-h200.json" 2>&1 | tail -40
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
  *) echo "usage: $0 tests|engine|families" >&2; exit 2 ;;
esac
