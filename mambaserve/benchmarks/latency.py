"""`mambaserve bench latency`: the time of one batch end to end, as vLLM's benchmark_latency.

A batch of `--batch-size` random-token prompts of `--input-len` tokens, each generating `--n`
completions of exactly `--output-len` tokens (EOS ignored), is run through `LLM.generate` `--num-iters-warmup` times
untimed, then `--num-iters` times timed. Each iteration draws new prompts (seeded): with the
same prompts every time, prefix caching (on by default) would serve every repeat from its
cache and the prefill figures would time a cache hit, not the prompt. Besides the end-to-end latencies and their
percentiles it reports, from the same timed runs, the prefill time (from the start of the batch
until every request has its first token) and the decode time per output token (the rest of
the batch divided by output_len - 1, i.e. one decode step of the whole batch).
"""

from __future__ import annotations

import argparse
import sys
import time

from mambaserve.benchmarks.common import (
    PERCENTILES,
    add_run_flags,
    args_record,
    check_run_flags,
    engine_record,
    environment_info,
    memory_record,
    percentiles,
    resolve_skip_tokenizer,
    write_json,
)
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args
from mambaserve.engine.gc_heap import gc_heap_frozen


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench latency`: vLLM's benchmark_latency ones plus the shared engine flags."""
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (random ids)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--n", type=int, default=1, help="completions generated per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    parser.add_argument("--output-json", default=None, help="write the results record here")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_run_flags(parser)
    add_engine_args(parser)


def time_batch(llm, prompts: list[list[int]], params) -> dict:
    """Run one batch through `llm.generate`; returns latency, prefill_time (until the last
    request's first token), decode_time_per_token and the number of generated tokens."""
    start = time.time()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    latency = time.perf_counter() - t0
    # first_token_time is stamped by the engine (wall clock) when a request's first token is sampled
    prefill = max(o.metrics["first_token_time"] for o in outs) - start
    prefill = min(max(prefill, 0.0), latency)
    n_out = params.max_tokens
    decode = (latency - prefill) / (n_out - 1) if n_out > 1 else 0.0
    return {"latency": latency, "prefill_time": prefill, "decode_time_per_token": decode,
            "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}


def measure_latency(llm, input_len: int, output_len: int, batch_size: int, num_iters_warmup: int,
                    num_iters: int, seed: int = 0, use_tqdm: bool = True, n: int = 1) -> dict:
    """Warm up, then time `num_iters` batches (n completions per prompt); returns the measured part
    of the results record."""
    import numpy as np

    from mambaserve.benchmarks.datasets import random_token_ids
    from mambaserve.sampling_params import SamplingParams

    for name, v in (("--input-len", input_len), ("--output-len", output_len), ("--batch-size", batch_size),
                    ("--num-iters", num_iters), ("--n", n)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {num_iters_warmup}")
    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    runs = []
    for phase, iters in (("Warmup iterations", num_iters_warmup), ("Profiling iterations", num_iters)):
        it = range(iters)
        if use_tqdm and iters:
            from tqdm.auto import tqdm

            it = tqdm(it, desc=phase, dynamic_ncols=True)
        timed = [time_batch(llm, [random_token_ids(rng, input_len, vocab) for _ in range(batch_size)], params)
                 for _ in it]
        if phase.startswith("Profiling"):
            runs = timed
    rec = latency_record([r["latency"] for r in runs], [r["prefill_time"] for r in runs],
                         [r["decode_time_per_token"] for r in runs], [r["output_tokens"] for r in runs],
                         input_len=input_len, output_len=output_len, batch_size=batch_size, n=n)
    rec["cached_tokens"] = [r["cached_tokens"] for r in runs]  # served by prefix caching: 0 unless ids repeat
    return rec


def latency_record(latencies, prefill_times, decode_times, output_tokens, *, input_len, output_len, batch_size,
                   n: int = 1) -> dict:
    """The measured fields of a latency record (shared with the transformers baseline); n:
    completions per prompt."""
    iters = len(latencies)
    return {
        "input_len": input_len, "output_len": output_len, "batch_size": batch_size, "n": n, "num_iters": iters,
        "avg_latency": sum(latencies) / iters,
        "latencies": list(latencies),
        "percentiles": percentiles(latencies),
        "avg_prefill_time": sum(prefill_times) / iters,
        "prefill_times": list(prefill_times),
        "avg_decode_time_per_token": sum(decode_times) / iters,
        "decode_times_per_token": list(decode_times),
        "output_tokens_per_iter": list(output_tokens),
        "expected_output_tokens_per_iter": batch_size * n * output_len,
    }


def print_latency(rec: dict, file=None) -> None:
    """Print a latency record the way vLLM's benchmark_latency does, plus prefill and decode."""
    file = file or sys.stdout
    print(f"Avg latency: {rec['avg_latency']} seconds", file=file)
    for q in PERCENTILES:
        print(f"{q}% percentile latency: {rec['percentiles'][str(q)]} seconds", file=file)
    print(f"Avg prefill time (time to first token of the whole batch): {rec['avg_prefill_time']} seconds", file=file)
    print(f"Avg decode time per output token (batch of {rec['batch_size'] * rec['n']}): "
          f"{rec['avg_decode_time_per_token'] * 1e3:.3f} ms", file=file)


def main(args: argparse.Namespace, llm=None) -> int:
    """`mambaserve bench latency`: build the engine from the flags (or use `llm`, an engine the
    caller built for several benchmarks; its config is what gets recorded), measure, print, save."""
    from mambaserve.llm import LLM

    if llm is None:
        check_run_flags(args)
        resolve_skip_tokenizer(args)
        overrides = {}
        if args.max_model_len is None:
            overrides["max_model_len"] = args.input_len + args.output_len
        llm = LLM.from_config(engine_config_from_args(args, **overrides))
    config = llm.llm_engine.config
    with gc_heap_frozen():  # as `serve` runs: no full collection walks the engine's start-up objects
        rec = measure_latency(llm, args.input_len, args.output_len, args.batch_size, args.num_iters_warmup,
                              args.num_iters, seed=args.seed, use_tqdm=not args.disable_tqdm, n=args.n)
    print_latency(rec)
    if args.output_json:
        record = {"benchmark": "latency", "environment": environment_info(device=config.resolved_device()),
                  **engine_record(llm), "memory": memory_record(llm), "args": args_record(args), **rec}
        write_json(args.output_json, record)
    return 0
