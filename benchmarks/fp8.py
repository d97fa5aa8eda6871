"""FP8 against bfloat16 on one GPU (issue 24): dummy weights, one JSON per model.

For each model (benchmarks/configs/*.json, random weights, bfloat16) and each of
quantization=None and "fp8" (weights per output channel at load, activations per token):
- latency at batch 1, 1,024 and 31,500 prompt tokens, 128 out: prefill (time to first token)
  and decode per token, separately (`mambaserve.benchmarks.latency.measure_latency`);
- throughput: --num-prompts random requests of 1,024 in / 128 out in one generate call;
then, with bfloat16 weights, kv_cache_dtype "auto" against "fp8": the KV blocks the budget
gives and the 32k-token requests that fit (KV blocks for 32,768 tokens each, and a state slot).
The record holds the GPU name, the commit ($MAMBASERVE_COMMIT, else `git rev-parse HEAD`),
the versions, each run's engine record and the speedups (bf16 time / fp8 time).

    python3 benchmarks/fp8.py --models granite-4.0-tiny-preview --output OUT/fp8-granite.json
    python3 benchmarks/fp8.py --smoke --device cpu --models mambaserve/assets/demo-model/config.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mambaserve import LLM  # noqa: E402
from mambaserve.benchmarks.common import environment_info, write_json  # noqa: E402
from mambaserve.benchmarks.common import git_commit as _git_commit  # noqa: E402
from mambaserve.benchmarks.datasets import BenchRequest, random_token_ids  # noqa: E402
from mambaserve.benchmarks.latency import measure_latency  # noqa: E402
from mambaserve.benchmarks.throughput import measure_throughput  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
LONG = 32768


def commit() -> str | None:
    return _git_commit(ROOT)


def engine(model: str, args, **kw) -> LLM:
    path = model if os.path.exists(model) else str(CONFIGS / f"{model}.json")  # a name, or a config path
    return LLM(path, load_format="dummy", dtype=args.dtype, device=args.device,
               skip_tokenizer_init=True, max_model_len=kw.pop("max_model_len", LONG), disable_log_stats=True,
               gpu_memory_utilization=args.gpu_memory_utilization, **kw)


def free() -> None:
    """Give an engine's GPU memory back once the caller has dropped its last reference (the
    next engine sizes itself from what is free: a live one made the H200 run run out of memory)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_weights(model: str, quantization: str | None, args) -> dict:
    """Latency at each input length and one throughput run, for one weight format."""
    t0 = time.perf_counter()
    llm = engine(model, args, quantization=quantization, max_model_len=256 if args.smoke else LONG)
    rec = {"quantization": quantization, "startup_s": time.perf_counter() - t0,
           "weight_bytes": llm.llm_engine.memory.weights_bytes,
           "latency": {}}
    for n_in in args.input_lens:
        warm, iters = (2, 3) if n_in <= 4096 else (1, 2)
        if args.smoke:
            warm, iters = 0, 1
        r = measure_latency(llm, n_in, args.output_len, 1, warm, iters, use_tqdm=False)
        rec["latency"][str(n_in)] = {k: r[k] for k in ("avg_latency", "avg_prefill_time", "avg_decode_time_per_token",
                                                       "prefill_times", "decode_times_per_token")}
        print(f"[{model} {quantization or 'bf16'} in{n_in}] prefill {r['avg_prefill_time'] * 1e3:.1f} ms, "
              f"decode {r['avg_decode_time_per_token'] * 1e3:.3f} ms/token", flush=True)
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.vocab_size
    reqs = [BenchRequest(random_token_ids(rng, args.tp_input_len, vocab), args.tp_input_len, args.output_len)
            for _ in range(args.num_prompts)]
    t = measure_throughput(llm, reqs, use_tqdm=False, num_warmup_prompts=min(8, args.num_prompts))
    rec["throughput"] = {k: t[k] for k in t if k != "step_breakdown"}
    print(f"[{model} {quantization or 'bf16'} throughput] {t.get('tokens_per_second', t)}", flush=True)
    del llm
    free()
    return rec


def kv_fit(model: str, args) -> dict:
    """KV blocks and 32k-token requests that fit, kv_cache_dtype auto vs fp8 (bf16 weights, eager)."""
    out = {}
    for kv in ("auto", "fp8"):
        llm = engine(model, args, kv_cache_dtype=kv, enforce_eager=True, max_num_seqs=1024,
                     max_model_len=LONG if not args.smoke else 64)
        sizes = llm.llm_engine.pool_sizes
        bs = llm.llm_engine.config.block_size
        long = sizes.max_model_len if args.smoke else LONG
        by_kv = sizes.num_blocks // -(-long // bs) if sizes.num_blocks else None
        out[kv] = {"num_blocks": sizes.num_blocks, "block_size": bs, "num_slots": sizes.num_slots,
                   "requests_by_kv_blocks": by_kv,
                   "requests_32k_fit": min(by_kv, sizes.num_slots - 1) if by_kv is not None else sizes.num_slots - 1}
        print(f"[{model} kv {kv}] {out[kv]}", flush=True)
        del llm
        free()
    a, f = out["auto"]["requests_32k_fit"], out["fp8"]["requests_32k_fit"]
    out["ratio_fp8_over_auto"] = f / a if a else None
    return out


def speedups(bf16: dict, fp8: dict) -> dict:
    s = {}
    for n_in, b in bf16["latency"].items():
        f = fp8["latency"][n_in]
        s[f"decode_in{n_in}"] = b["avg_decode_time_per_token"] / f["avg_decode_time_per_token"]
        s[f"prefill_in{n_in}"] = b["avg_prefill_time"] / f["avg_prefill_time"]
    bt, ft = bf16["throughput"].get("elapsed_time"), fp8["throughput"].get("elapsed_time")
    if bt and ft:
        s["throughput"] = bt / ft
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["granite-4.0-tiny-preview", "bamba-9b"])
    p.add_argument("--input-lens", nargs="+", type=int, default=[1024, 31500])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=128, help="throughput requests")
    p.add_argument("--tp-input-len", type=int, default=1024, help="prompt tokens of each throughput request")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--output", default=None, help="the JSON record (default: print only)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    args = p.parse_args(argv)
    if args.smoke:
        args.input_lens, args.output_len, args.num_prompts, args.tp_input_len = [16], 4, 2, 8
    record = {"benchmark": "fp8", "commit": commit(), "environment": environment_info(device=args.device),
              "args": vars(args), "models": {}}
    for model in args.models:
        m = record["models"][model] = {}
        m["bf16"] = run_weights(model, None, args)
        m["fp8"] = run_weights(model, "fp8", args)
        m["speedup"] = speedups(m["bf16"], m["fp8"])
        print(f"[{model} speedup] {m['speedup']}", flush=True)
        m["kv_fit"] = kv_fit(model, args)
        if args.output:  # after each model: a timeout keeps what was measured
            write_json(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
