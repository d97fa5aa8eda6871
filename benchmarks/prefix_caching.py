"""What prefix caching buys and what it costs, with caching on and off in one run, per model.

    python benchmarks/prefix_caching.py --models granite-4.0-tiny-preview bamba-9b --output prefix-caching.json

For each model (benchmarks/configs/<name>.json, dummy weights, bfloat16) two engines are built
side by side in this process, one with prefix caching on and one off (each takes
--gpu-memory-utilization of the GPU), and both run the same three workloads:

(a) multi_turn: conversations sent turn by turn, each turn re-sending the history, one
    conversation at a time by default (--mt-concurrency: TTFT is then the prefill's own time)
    (`datasets.Conversation`): turn 0 carries --mt-prefix-len tokens of history plus a user
    message, so turn 1 sees about 8k tokens of history by default; TTFT (mean, p99) per turn
    index, and throughput. The target: turn 1's mean TTFT at least 5x lower with caching.
(b) prefix_repetition: requests sharing a few long prefixes (a system prompt, tools).
(c) sharegpt-synthetic: the throughput workload with no sharing at all, run --repeats times
    on each engine, on and off alternately; the cost is 1 - median(on) / median(off) of the
    output tokens/s (target: at most 2%).

(a) and (b) are closed loops on the offline engine: at most --concurrency conversations (or
requests) are in flight, and a turn is added the moment the previous one finishes, with its
real generated token ids in the history. TTFT is the engine's own first-token time minus the
arrival time given to add_request, so queueing behind other prefills counts, HTTP does not.
Every run starts from an empty cache (`reset_prefix_cache`), after an untimed warm-up on each
engine. The JSON (--output) holds the model, workload figures, on/off ratios, GPU name and the
commit ($MAMBASERVE_COMMIT, else `git rev-parse HEAD`). --smoke shrinks everything for a CPU
run on the bundled demo model (the test of this script).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the GPU machine runs from a checkout, mambaserve not installed

from mambaserve.benchmarks.common import environment_info, write_json  # noqa: E402
from mambaserve.benchmarks.common import git_commit as _git_commit  # noqa: E402
from mambaserve.benchmarks.datasets import (  # noqa: E402
    Conversation,
    multi_turn_conversations,
    next_turn_prompt,
    prefix_repetition_requests,
    synthetic_requests,
)

MODELS = ["granite-4.0-tiny-preview", "bamba-9b"]
TARGET_TTFT_SPEEDUP = 5.0  # turn 1 of the multi-turn workload
TARGET_COST = 0.02  # throughput lost without sharing
# (name, default, smoke value) of every workload size
SIZES = [
    ("mt_conversations", 8, 3), ("mt_turns", 3, 3), ("mt_prefix_len", 7936, 130), ("mt_user_len", 128, 9),
    ("mt_output_len", 128, 4), ("mt_concurrency", 1, 2),
    ("pr_requests", 128, 6), ("pr_num_prefixes", 8, 2), ("pr_prefix_len", 2048, 140), ("pr_suffix_len", 256, 7),
    ("pr_output_len", 64, 3), ("pr_concurrency", 16, 3),
    ("sharegpt_prompts", 300, 4), ("sharegpt_output_len", 0, 3), ("repeats", 3, 1),
]


def git_commit() -> str | None:
    return _git_commit(REPO)


# ------------------------------------------------------------------ the closed-loop driver
def run_conversations(engine, conversations: list[Conversation], concurrency: int, tag: str) -> dict:
    """Drive `conversations` through `engine` (an LLMEngine), at most `concurrency` in flight,
    each next turn added when its previous one finishes with that turn's generated ids in its
    history (greedy, EOS ignored). Returns the run's figures: per-turn TTFT (ms), throughput,
    cached tokens (RequestOutput.num_cached_tokens) and the engine's prefix-cache counters."""
    import numpy as np

    from mambaserve.sampling_params import SamplingParams

    before = engine.usage()
    pending = deque(range(len(conversations)))
    active: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (conversation, turn, prompt)
    rows = []  # (turn, prompt_len, ttft_s, latency_s, cached, output tokens)

    def start(ci: int, turn: int, prompt: list[int]) -> None:
        rid = f"{tag}-{ci}-{turn}"
        params = SamplingParams(temperature=0.0, max_tokens=conversations[ci].output_len, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, final_only=True)
        active[rid] = (ci, turn, prompt)

    t0 = time.perf_counter()
    while pending and len(active) < concurrency:
        ci = pending.popleft()
        start(ci, 0, conversations[ci].first_prompt())
    while active:
        for out in engine.step():
            if not out.finished:
                continue
            now = time.time()
            ci, turn, prompt = active.pop(out.request_id)
            m = out.metrics
            rows.append((turn, len(prompt), m["first_token_time"] - m["arrival_time"], now - m["arrival_time"],
                         out.num_cached_tokens, len(out.outputs[0].token_ids)))
            conv = conversations[ci]
            if turn + 1 < conv.num_turns:
                start(ci, turn + 1, next_turn_prompt(prompt, out.outputs[0].token_ids, conv.user_turns[turn + 1]))
            elif pending:
                nxt = pending.popleft()
                start(nxt, 0, conversations[nxt].first_prompt())
    seconds = time.perf_counter() - t0
    after = engine.usage()
    prompt_tokens, output_tokens = sum(r[1] for r in rows), sum(r[5] for r in rows)
    per_turn = []
    for t in sorted({r[0] for r in rows}):
        ttft = np.asarray([r[2] for r in rows if r[0] == t]) * 1e3
        per_turn.append({"turn": t, "requests": int(ttft.size),
                         "mean_prompt_len": float(np.mean([r[1] for r in rows if r[0] == t])),
                         "mean_ttft_ms": float(ttft.mean()), "p99_ttft_ms": float(np.percentile(ttft, 99)),
                         "cached_tokens": sum(r[4] for r in rows if r[0] == t)})
    ttft = np.asarray([r[2] for r in rows]) * 1e3
    return {"requests": len(rows), "seconds": seconds, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
            "mean_ttft_ms": float(ttft.mean()), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "mean_e2el_ms": float(np.mean([r[3] for r in rows]) * 1e3),
            "cached_tokens": sum(r[4] for r in rows),
            "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "per_turn": per_turn}


def _cold(llm) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache failed between runs: a request was left running")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# ------------------------------------------------------------------ one model
def bench_model(model: str, args: argparse.Namespace, log) -> dict:
    from mambaserve import LLM
    from mambaserve.benchmarks.throughput import measure_throughput

    path = model if os.path.exists(model) else str(REPO / "benchmarks" / "configs" / f"{model}.json")
    common = {"model": path, "dtype": args.dtype, "load_format": args.load_format, "device": args.device,
              "max_model_len": args.max_model_len, "skip_tokenizer_init": True, "seed": 0,
              "mamba_block_size": args.mamba_block_size, "enforce_eager": args.enforce_eager}
    if args.device != "cpu":
        common["gpu_memory_utilization"] = args.gpu_memory_utilization
    t = time.perf_counter()
    llms = {"on": LLM(enable_prefix_caching=True, **common), "off": LLM(enable_prefix_caching=False, **common)}
    build_seconds = time.perf_counter() - t
    vocab = llms["on"].llm_engine.vocab_size
    s = args
    convs = multi_turn_conversations(s.mt_conversations, s.mt_turns, s.mt_prefix_len, s.mt_user_len, s.mt_output_len,
                                     vocab, seed=1)
    shared = [Conversation([], [r.prompt], r.output_len) for r in prefix_repetition_requests(
        s.pr_requests, s.pr_prefix_len, s.pr_suffix_len, s.pr_num_prefixes, s.pr_output_len, vocab, seed=2)]
    max_len = llms["on"].llm_engine.max_model_len  # a smoke run's short limit leaves out the longest ones
    sharegpt = [r for r in synthetic_requests(4 * s.sharegpt_prompts, vocab, seed=3,
                                              output_len=s.sharegpt_output_len or None)
                if r.prompt_len + r.output_len <= max_len][:s.sharegpt_prompts]
    # full-size warm-up: Triton compiles and autotunes by shape, and whichever engine ran a long
    # prompt first would pay for both
    warm = multi_turn_conversations(2, 2, s.mt_prefix_len, s.mt_user_len, 8, vocab, seed=4)

    rec = {"model": model, "config": os.path.relpath(path, REPO) if path.startswith(str(REPO)) else path,
           "build_seconds": build_seconds, "engines": {}}
    for kind, llm in llms.items():
        e = llm.llm_engine
        sizes = e.pool_sizes
        rec["engines"][kind] = {"compilation_mode": e.config.resolved_compilation_mode(),
                                "num_state_slots": sizes.num_slots, "num_kv_blocks": sizes.num_blocks,
                                "max_num_seqs": sizes.max_num_seqs, "max_model_len": sizes.max_model_len,
                                "mamba_block_size": e.config.cache_config.resolved_mamba_block_size}
        run_conversations(e, warm, 2, "warm")  # kernels compile; the caching paths run once
        measure_throughput(llm, sharegpt[:8], use_tqdm=False)
        _cold(llm)

    for name, items, conc in (("multi_turn", convs, s.mt_concurrency), ("prefix_repetition", shared, s.pr_concurrency)):
        runs = {}
        for kind, llm in llms.items():
            _cold(llm)
            runs[kind] = run_conversations(llm.llm_engine, items, conc, f"{name}-{kind}")
            log(f"[{model}] {name} caching {kind}: mean TTFT {runs[kind]['mean_ttft_ms']:.1f} ms, "
                f"{runs[kind]['output_tokens_per_s']:.0f} output tok/s, {runs[kind]['cached_tokens']} cached tokens")
        on, off = runs["on"], runs["off"]
        rec[name] = {**runs, "ttft_speedup_mean": _ratio(off["mean_ttft_ms"], on["mean_ttft_ms"]),
                     "ttft_speedup_p99": _ratio(off["p99_ttft_ms"], on["p99_ttft_ms"]),
                     "throughput_ratio": _ratio(on["total_tokens_per_s"], off["total_tokens_per_s"]),
                     "hit_rate": _ratio(on["prefix_cache_hits"], on["prefix_cache_queries"])}
    mt = rec["multi_turn"]
    if s.mt_turns > 1:
        t_on, t_off = mt["on"]["per_turn"][1], mt["off"]["per_turn"][1]
        mt["turn1_mean_prompt_len"] = t_on["mean_prompt_len"]
        mt["turn1_ttft_speedup_mean"] = _ratio(t_off["mean_ttft_ms"], t_on["mean_ttft_ms"])
        mt["turn1_ttft_speedup_p99"] = _ratio(t_off["p99_ttft_ms"], t_on["p99_ttft_ms"])
        mt["target_turn1_ttft_speedup"] = TARGET_TTFT_SPEEDUP
        mt["meets_target"] = (mt["turn1_ttft_speedup_mean"] or 0.0) >= TARGET_TTFT_SPEEDUP

    thr = {"on": [], "off": []}
    for r in range(s.repeats):
        for kind in (("on", "off") if r % 2 == 0 else ("off", "on")):  # alternate which goes first
            _cold(llms[kind])
            run = measure_throughput(llms[kind], sharegpt, use_tqdm=False)
            run.pop("step_breakdown", None)
            thr[kind].append(run)
        log(f"[{model}] sharegpt-synthetic repeat {r}: on {thr['on'][-1]['output_tokens_per_second']:.0f}, "
            f"off {thr['off'][-1]['output_tokens_per_second']:.0f} output tok/s")
    med = {k: statistics.median(x["output_tokens_per_second"] for x in v) for k, v in thr.items()}
    cost = 1.0 - med["on"] / med["off"]
    rec["sharegpt_synthetic"] = {"num_prompts": len(sharegpt), "on_runs": thr["on"], "off_runs": thr["off"],
                                 "on_median_output_tokens_per_s": med["on"],
                                 "off_median_output_tokens_per_s": med["off"], "cost": cost,
                                 "target_cost": TARGET_COST, "meets_target": cost <= TARGET_COST}
    log(f"[{model}] cost without sharing: {100 * cost:.2f}% (target <= {100 * TARGET_COST:.0f}%)")
    for llm in llms.values():
        llm.llm_engine.shutdown()
    return rec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=None, help=f"config names or paths (default: {' '.join(MODELS)})")
    p.add_argument("--output", required=True, help="the JSON record")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on the CPU, the bundled demo model")
    p.add_argument("--dtype", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.42, help="per engine (two are alive at once)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--mamba-block-size", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    for name, default, _ in SIZES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {default}")
    args = p.parse_args(argv)
    for name, default, smoke in SIZES:
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)
    if args.smoke:
        from mambaserve.config import default_model

        args.models = args.models or [default_model()]
        defaults = {"dtype": "float32", "load_format": "auto", "device": "cpu", "max_model_len": 1024,
                    "mamba_block_size": 64}
    else:
        args.models = args.models or MODELS
        longest = args.mt_prefix_len + args.mt_turns * (args.mt_user_len + args.mt_output_len)
        defaults = {"dtype": "bfloat16", "load_format": "dummy", "device": "auto",
                    "max_model_len": max(4096, longest + 256)}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    record = {"benchmark": "prefix_caching", "commit": git_commit(),
              "environment": environment_info(device=args.device), "args": vars(args),
              "targets": {"turn1_ttft_speedup": TARGET_TTFT_SPEEDUP, "cost_without_sharing": TARGET_COST},
              "models": []}
    for model in args.models:
        record["models"].append(bench_model(model, args, lambda line: print(line, flush=True)))
        write_json(args.output, record)  # what is measured so far survives a timeout
    write_json(args.output, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
