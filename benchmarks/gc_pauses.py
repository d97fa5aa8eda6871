"""Pauses of Python's cyclic garbage collector while an engine generates, with the engine's
start-up heap left to the collector and then frozen (`engine.gc_heap.gc_heap_frozen`, as
`serve` and `bench latency|throughput` run), one engine, side by side in one run.

The tiny test checkpoint of `tests/models/tiny.py` (granite-moe: Mamba2 + attention + MoE) on
the CPU, 512 requests of 20-120 prompt tokens and 48 sampled output tokens each, sent
`--rounds` times in one `generate` per mode (the collected mode first, right after start-up
and a warm-up, with the collector as they left it); prints and
writes, per mode, the objects the collector tracks, what one full collection of that heap
takes (timed before the run: the stall it would cause inside a step), and the collections of
each generation during the run with their total and longest pause. CPU only: the heap's
size, not the device, sets the pauses.

    python benchmarks/gc_pauses.py --output benchmarks/results/host/gc-pauses-tiny-granite-moe.json
"""

import argparse
import gc
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from mambaserve import LLM, SamplingParams  # noqa: E402
from mambaserve.benchmarks.common import write_json  # noqa: E402
from mambaserve.engine.gc_heap import gc_heap_frozen  # noqa: E402


def generate_with_pauses(llm, prompts, params) -> dict:
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - start[0])

    tracked = len(gc.get_objects())
    t = time.perf_counter()
    gc.collect()  # what a full collection costs with this heap (the stall one would cause in a step)
    full_ms = (time.perf_counter() - t) * 1e3
    gc.callbacks.append(on_gc)
    t = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        gc.callbacks.remove(on_gc)
    return {"seconds": round(time.perf_counter() - t, 3), "objects_tracked": tracked,
            "full_collection_ms": round(full_ms, 1),
            "collections": {f"gen{g}": {"count": len(p), "total_ms": round(sum(p) * 1e3, 2),
                                        "max_ms": round(max(p, default=0.0) * 1e3, 2)} for g, p in pauses.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", help="write the JSON record here")
    ap.add_argument("--rounds", type=int, default=3, help="the 512 requests sent this many times per mode")
    args = ap.parse_args()
    from tests.models.tiny import checkpoint, hf_model

    torch.set_num_threads(1)
    name = "granite-moe"
    llm = LLM(checkpoint(name), dtype="float32", device="cpu", skip_tokenizer_init=True, max_num_seqs=512,
              max_num_batched_tokens=4096, max_model_len=512, cpu_cache_bytes=4 << 30)
    vocab, rng = hf_model(name).config.vocab_size, random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(20, 120))]}
               for _ in range(512)]
    params = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=0)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up; the collector as start-up left it
    runs = {"start_up_heap_collected": generate_with_pauses(llm, prompts * args.rounds, params)}
    with gc_heap_frozen():
        runs["start_up_heap_frozen"] = generate_with_pauses(llm, prompts * args.rounds, params)
    for mode, r in runs.items():
        print(f"{mode:<24} {r['seconds']:6.2f} s, {r['objects_tracked']:>7} objects tracked, a full collection "
              f"{r['full_collection_ms']:.1f} ms; during generate: " + ", ".join(
            f"{g} {c['count']} x, {c['total_ms']:.1f} ms (max {c['max_ms']:.1f})" for g, c in r["collections"].items()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"benchmark": "garbage-collector pauses during generate", "model": f"tests/models/tiny.py:{name}",
              "device": "cpu", "python": sys.version.split()[0], "commit": os.environ.get("MAMBASERVE_COMMIT", commit),
              "requests": len(prompts) * args.rounds, "output_tokens": params.max_tokens, "runs": runs}
    if args.output:
        write_json(args.output, record)


if __name__ == "__main__":
    main()
