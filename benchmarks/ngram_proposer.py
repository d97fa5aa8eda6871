"""Host time of n-gram prompt lookup (speculative decoding's `ngram` method) per sequence and
step, at 1k / 8k / 32k tokens of context, side by side in one run:

- `engine`: the engine's path, `NgramProposer.propose` over the sequence's `_TokenArray`
  (an int64 array grown by the step's new tokens);
- `list`: the same proposer handed the token list (converted to an array every call);
- `sliding_window`: the lookup as the engine did it before (one boolean sliding window of the
  whole context per n tried), over the array;
- `earlier_engine`: the engine's path before, that lookup over `seq.all_token_ids` converted
  to an array every step.

Two cases per length: no n-gram recurs (every n from prompt_lookup_max down to
prompt_lookup_min is tried), and the last 5-gram recurs (the first n tried hits). CPU only
(the proposer runs on the host whatever the device); the JSON names the CPU and the commit.

    python benchmarks/ngram_proposer.py --output benchmarks/results/host/ngram-proposer.json
"""

import argparse
import os
import platform
import random
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
from mambaserve.benchmarks.common import write_json  # noqa: E402
from mambaserve.engine.sequence import Sequence  # noqa: E402
from mambaserve.engine.spec_decode import NgramProposer, _TokenArray  # noqa: E402
from mambaserve.sampling_params import SamplingParams  # noqa: E402


def sliding_window(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """The earlier lookup: for each n, every window of the context compared with the suffix."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= total]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def time_us(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def time_case(proposer: NgramProposer, tokens: list[int], args) -> dict[str, float]:
    """Microseconds per call of each path (module docstring), after checking they agree."""
    seq = Sequence("r", prompt_token_ids=tokens[:-1], sampling_params=SamplingParams(max_tokens=8))
    seq.output_token_ids.append(tokens[-1])
    arr, as_array = _TokenArray(), np.asarray(tokens, dtype=np.int64)
    k, hi, lo = args.k, args.lookup_max, args.lookup_min
    assert proposer.propose(arr.of(seq), k) == proposer.propose(tokens, k) == sliding_window(as_array, k, hi, lo)
    return {
        "engine": time_us(lambda: proposer.propose(arr.of(seq), k), args.reps),
        "list": time_us(lambda: proposer.propose(tokens, k), args.reps),
        "sliding_window": time_us(lambda: sliding_window(as_array, k, hi, lo), args.reps),
        "earlier_engine": time_us(lambda: sliding_window(np.asarray(seq.all_token_ids, dtype=np.int64), k, hi, lo),
                                  args.reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", help="write the JSON record here")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--lookup-min", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(0)
    proposer = NgramProposer(args.lookup_max, args.lookup_min)
    rows = []
    for length in (1024, 8192, 32768):
        base = [rng.randrange(3, 49_000) for _ in range(length)]
        for case, tokens in (("no n-gram recurs", base), ("the last 5-gram recurs", base + base[100:105])):
            us = time_case(proposer, tokens, args)
            row = {"context_tokens": len(tokens), "case": case, "us_per_call": {n: round(v, 1) for n, v in us.items()},
                   "earlier_engine_over_engine": round(us["earlier_engine"] / us["engine"], 1)}
            rows.append(row)
            print(f"{len(tokens):>6} tokens, {case:<23} engine {us['engine']:7.1f} us   list {us['list']:7.1f} us   "
                  f"sliding window {us['sliding_window']:7.1f} us   earlier engine {us['earlier_engine']:7.1f} us "
                  f"({row['earlier_engine_over_engine']:.0f}x)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"benchmark": "ngram proposer host time per sequence and step", "cpu": cpu_name(),
              "commit": os.environ.get("MAMBASERVE_COMMIT", commit), "k": args.k,
              "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min, "rows": rows}
    if args.output:
        write_json(args.output, record)


if __name__ == "__main__":
    main()
