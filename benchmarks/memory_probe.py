"""Build one engine and report how its GPU memory was split (weights, caches, graphs), then
run the bench latency / throughput workloads on it: a check of the cache budget at full scale.

    python3 benchmarks/memory_probe.py --model bamba-9b --gpu-memory-utilization 0.75 --out "$OUT/probe.json"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bamba-9b")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--workloads", default="latency-1024-1,latency-31500-1,latency-1024-32,throughput")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from mambaserve import LLM
    from mambaserve.benchmarks.latency import measure_latency

    path = str(REPO / "benchmarks" / "configs" / f"{args.model}.json")
    free0, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    engine = llm.llm_engine
    sizes = engine.pool_sizes
    free1, _ = torch.cuda.mem_get_info()
    rec = {"model": args.model, "gpu": torch.cuda.get_device_name(), "build_s": time.perf_counter() - t0,
           "total_GiB": total / 2**30, "used_by_engine_GiB": (free0 - free1) / 2**30,
           "allocated_GiB": torch.cuda.memory_allocated() / 2**30, "num_slots": sizes.num_slots,
           "num_blocks": sizes.num_blocks, "max_num_seqs": sizes.max_num_seqs, "results": {}}
    print(json.dumps(rec), flush=True)
    for w in args.workloads.split(","):
        t = time.perf_counter()
        if w.startswith("latency"):
            _, i, b = w.split("-")
            res = measure_latency(llm, int(i), 128, int(b), 1, 3, use_tqdm=False)
            rec["results"][w] = {k: res[k] for k in ("avg_latency", "avg_prefill_time", "avg_decode_time_per_token")}
        else:
            from mambaserve.benchmarks.datasets import synthetic_requests
            from mambaserve.benchmarks.throughput import measure_throughput

            reqs = synthetic_requests(1000, engine.vocab_size)
            rec["results"][w] = measure_throughput(llm, reqs, use_tqdm=False)
        print(w, json.dumps(rec["results"][w]), f"{time.perf_counter() - t:.1f} s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
