"""Speculative decoding on a GPU: what the drafts buy and what a verify step costs.

    python benchmarks/spec_decode.py --parts acceptance cost --output spec-decode.json

(a) acceptance: the bundled demo model (mambaserve/assets/demo-model, trained weights, its
    tokenizer) on code-like and repetitive prompts, n-gram drafts (k = --k, lookup 2..4), one
    request at a time, greedy: the draft acceptance rate, the mean acceptance length (tokens
    per verify step), the tokens per decode step, decode tokens/s with and without
    speculation, and whether the outputs are the same.
(b) cost: dummy weights (benchmarks/configs/<model>.json, bfloat16) cannot accept drafts, so a
    test-only knob forces the acceptance: MAMBASERVE_SPEC_FORCE_ACCEPT=0.7
    (`engine.spec_decode.ForcedAcceptance`: 70% of the k = 4 drafts accepted on average,
    every forward and the rejection sampler still run; a benchmark tool, never for real use).
    At batch 1 and 32, one engine without and one with speculation: the mean decode step and
    verify step (ms, host included, as the engine steps), their ratio, and the end-to-end
    decode tokens/s of each; at batch 1 their ratio is the decode speed-up (target >= 2x).

(c) timeline (with --parts timeline): the same speculating engines as (b), per verify step
    the host time of each part of the step (scheduling with the drafts, the runner's prepare,
    the accepted-state copies, the graph launch call, the wait for the tokens plus the
    rejection sampler, the output processor) and the device time from just before the graph
    launch to its end (CUDA events): what the host adds to a step that does not overlap it.

Decode steps are timed after every request of the batch has its first token. The JSON holds
the model, the GPU name, the commit ($MAMBASERVE_COMMIT when there is no .git) and the figures;
it is written after each measurement, so a timeout keeps what was measured. --smoke shrinks
everything to a CPU run (the test of this script).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the GPU machine runs from a checkout, mambaserve not installed

from mambaserve.benchmarks.common import environment_info, write_json  # noqa: E402
from mambaserve.benchmarks.common import git_commit as _git_commit  # noqa: E402

MODELS = ["granite-4.0-tiny-preview", "bamba-9b"]
TARGET_SPEEDUP = 2.0  # batch-1 decode, 70% of 4 drafts accepted
FORCE_ENV = "MAMBASERVE_SPEC_FORCE_ACCEPT"

CODE_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    '{"id": 1, "name": "alpha", "tags": ["a", "b"]},\n{"id": 2, "name": "beta", "tags": ["a", "b"]},\n{"id": 3,',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Size:\n    def __init__(self, w, h):\n",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, age FROM users WHERE age > 40;\nSELECT name,",
    "The cat sat on the mat. The dog sat on the mat. The bird sat on the",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,",
    "<ul>\n  <li>one</li>\n  <li>two</li>\n  <li>three</li>\n  <li>",
]


def git_commit() -> str | None:
    return _git_commit(REPO)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run_batch(engine, prompts, max_tokens: int, on_decode=None) -> dict:
    """Add the prompts (greedy, EOS ignored), step until each has its first token, then time every
    step until all finish (on_decode(): called once, just before). Returns decode steps, their
    seconds, decode tokens and the outputs."""
    from mambaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outputs, started = {}, set()
    while len(started) < len(ids):
        for o in engine.step():
            if o.outputs[0].token_ids:
                started.add(o.request_id)
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
    first = len(ids)  # one token each before the timer
    if on_decode is not None:
        on_decode()
    steps, times = 0, []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
        times.append(time.perf_counter() - t)
        steps += 1
    tokens = sum(len(outputs[i]) for i in ids) - first
    return {"decode_steps": steps, "decode_seconds": sum(times), "decode_tokens": tokens,
            "outputs": [outputs[i] for i in ids]}


def spec_counts(engine, before) -> dict:
    """The engine's speculative-decoding counters since the snapshot `before` (EngineUsage.spec_decode)."""
    st = engine.usage().spec_decode
    old = before.num_accepted_tokens_per_pos + [0] * len(st.num_accepted_tokens_per_pos)
    return {"num_drafts": st.num_drafts - before.num_drafts,
            "num_draft_tokens": st.num_draft_tokens - before.num_draft_tokens,
            "num_accepted_tokens": st.num_accepted_tokens - before.num_accepted_tokens,
            "num_accepted_tokens_per_pos": [a - b for a, b in zip(st.num_accepted_tokens_per_pos, old)]}


def summarize(plain: dict, spec: dict, counts: dict) -> dict:
    """The figures of a plain run and a speculative run of the same prompts."""
    d, t, a = counts["num_drafts"], counts["num_draft_tokens"], counts["num_accepted_tokens"]
    rate = lambda r: r["decode_tokens"] / r["decode_seconds"] if r["decode_seconds"] else 0.0  # noqa: E731
    step_ms = lambda r: 1e3 * r["decode_seconds"] / max(r["decode_steps"], 1)  # noqa: E731
    return {
        "acceptance_rate": a / t if t else 0.0, "mean_acceptance_length": 1 + a / d if d else 0.0,
        "tokens_per_step_plain": plain["decode_tokens"] / max(plain["decode_steps"], 1),
        "tokens_per_step_spec": spec["decode_tokens"] / max(spec["decode_steps"], 1),
        "decode_step_ms": step_ms(plain), "verify_step_ms": step_ms(spec),
        "verify_over_decode_step": step_ms(spec) / step_ms(plain) if plain["decode_steps"] else None,
        "decode_tok_s_plain": rate(plain), "decode_tok_s_spec": rate(spec),
        "decode_speedup": rate(spec) / rate(plain) if rate(plain) else None,
        "outputs_equal": plain["outputs"] == spec["outputs"], **counts}


def bench_acceptance(args, log) -> dict:
    from mambaserve import LLM
    from mambaserve.config import default_model

    common = {"model": args.demo_model or default_model(), "device": args.device, "seed": 0,
              "enforce_eager": args.enforce_eager}
    if args.device != "cpu":
        common["gpu_memory_utilization"] = 0.2
    prompts = CODE_PROMPTS[: args.num_prompts]
    plain_llm, spec_llm = LLM(**common), LLM(speculative_config=ngram(args.k), **common)
    runs = {}
    for name, llm in (("plain", plain_llm), ("spec", spec_llm)):
        run_batch(llm.llm_engine, prompts[:1], 8)  # warm-up
        before = llm.llm_engine.usage().spec_decode  # count the timed part only
        parts = [run_batch(llm.llm_engine, [p], args.max_tokens) for p in prompts]  # one request at a time
        runs[name] = {k: sum(r[k] for r in parts) for k in ("decode_steps", "decode_seconds", "decode_tokens")}
        runs[name]["outputs"] = [r["outputs"][0] for r in parts]
    rec = {"model": "demo-model", "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
           **summarize(runs["plain"], runs["spec"], spec_counts(spec_llm.llm_engine, before))}
    log(f"[acceptance demo-model k={args.k}] acceptance {rec['acceptance_rate']:.1%}, "
        f"{rec['mean_acceptance_length']:.2f} tokens/verify step, {rec['tokens_per_step_spec']:.2f} tokens/step, "
        f"decode {rec['decode_tok_s_plain']:.0f} -> {rec['decode_tok_s_spec']:.0f} tok/s "
        f"({rec['decode_speedup']:.2f}x), outputs equal: {rec['outputs_equal']}")
    return rec


def engine_kwargs(model: str, args) -> dict:
    """The LLM arguments of the cost and timeline parts: a config of benchmarks/configs/ (or a path)."""
    path = model if os.path.exists(model) else str(REPO / "benchmarks" / "configs" / f"{model}.json")
    common = {"model": path, "dtype": args.dtype, "load_format": args.load_format, "device": args.device,
              "skip_tokenizer_init": True, "seed": 0, "max_model_len": args.input_len + args.output_len + 64,
              "enforce_eager": args.enforce_eager}
    if args.device != "cpu":
        common["gpu_memory_utilization"] = args.gpu_memory_utilization
    return common


def bench_cost(model: str, args, log, records: list, save) -> None:
    from mambaserve import LLM

    common = engine_kwargs(model, args)
    plain_llm = LLM(**common)
    os.environ[FORCE_ENV] = str(args.accept)
    try:
        spec_llm = LLM(speculative_config=ngram(4), **common)
    finally:
        del os.environ[FORCE_ENV]
    vocab = plain_llm.llm_engine.vocab_size
    rng = random.Random(0)
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
                   for _ in range(batch)]
        runs = {}
        for name, llm in (("plain", plain_llm), ("spec", spec_llm)):
            run_batch(llm.llm_engine, prompts, 16)  # warm-up at this batch size
            before = llm.llm_engine.usage().spec_decode
            runs[name] = run_batch(llm.llm_engine, prompts, args.output_len)
        rec = {"model": model, "batch_size": batch, "input_len": args.input_len, "output_len": args.output_len,
               "k": 4, "forced_accept_fraction": args.accept,
               **summarize(runs["plain"], runs["spec"], spec_counts(spec_llm.llm_engine, before))}
        rec.pop("outputs_equal")  # forced acceptance emits what the target did not choose
        records.append(rec)
        save()
        log(f"[cost {model} bs{batch}] decode step {rec['decode_step_ms']:.2f} ms, verify step "
            f"{rec['verify_step_ms']:.2f} ms ({rec['verify_over_decode_step']:.2f}x), "
            f"{rec['tokens_per_step_spec']:.2f} tokens/step, decode {rec['decode_tok_s_plain']:.0f} -> "
            f"{rec['decode_tok_s_spec']:.0f} tok/s ({rec['decode_speedup']:.2f}x)")


def bench_timeline(model: str, args, log, records: list, save) -> None:
    """Per verify step: host milliseconds of each part and the graph's device time (module docstring, (c))."""
    import torch

    from mambaserve import LLM

    common = engine_kwargs(model, args)
    os.environ[FORCE_ENV] = str(args.accept)
    try:
        llm = LLM(speculative_config=ngram(4), **common)
    finally:
        del os.environ[FORCE_ENV]
    eng = llm.llm_engine
    host: dict[str, float] = {}
    events: list = []
    on = [False]

    def timed(name, fn):
        def wrapper(*a, **kw):
            if not on[0]:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host[name] = host.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    for obj, attr, name in ((eng.spec, "schedule", "schedule"), (eng.runner, "prepare", "prepare"),
                            (eng.runner, "_copy_states", "state_copies"), (eng.spec, "verify", "wait_and_verify"),
                            (eng.output_processor, "process", "output_processor"), (eng, "step", "step"),
                            (eng.runner, "run", "runner_run"), (eng, "_update", "update")):
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    for graphs in getattr(eng.runner, "verify_graphs", {}).values():  # staging the inputs + the launch
        graphs.run = timed("verify_graph_run", graphs.run)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        if not on[0] or not cuda:
            return replay(graph)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        replay(graph)
        host["graph_launch"] = host.get("graph_launch", 0.0) + time.perf_counter() - t
        b.record()
        events.append((a, b))

    torch.cuda.CUDAGraph.replay = timed_replay
    vocab, rng = eng.vocab_size, random.Random(0)
    try:
        for batch in args.batch_sizes:
            prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
                       for _ in range(batch)]
            run_batch(eng, prompts, 16)  # warm-up
            host.clear()
            events.clear()
            run = run_batch(eng, prompts, args.output_len, on_decode=lambda: on.__setitem__(0, True))
            on[0] = False
            if cuda:
                torch.cuda.synchronize()
            steps = max(run["decode_steps"], 1)
            device_ms = sum(a.elapsed_time(b) for a, b in events) / max(len(events), 1)
            rec = {"model": model, "batch_size": batch, "steps": run["decode_steps"],
                   "step_ms": 1e3 * run["decode_seconds"] / steps, "graph_replays": len(events),
                   "graph_device_ms": device_ms if events else None,
                   "host_ms": {k: 1e3 * v / steps for k, v in host.items()}}
            records.append(rec)
            save()
            parts = ", ".join(f"{k} {v:.3f}" for k, v in rec["host_ms"].items())
            log(f"[timeline {model} bs{batch}] step {rec['step_ms']:.3f} ms, graph on the device "
                f"{device_ms:.3f} ms ({len(events)} replays of {steps} steps); host ms per step: {parts}")
    finally:
        torch.cuda.CUDAGraph.replay = replay


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["acceptance", "cost"], choices=["acceptance", "cost", "timeline"])
    p.add_argument("--models", nargs="+", default=MODELS, help="config names or paths for the cost part")
    p.add_argument("--output", required=True, help="the JSON record")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the test of this script)")
    p.add_argument("--demo-model", default=None, help="the acceptance part's model (default: the bundled demo)")
    p.add_argument("--k", type=int, default=4, help="drafts per step of the acceptance part")
    p.add_argument("--num-prompts", type=int, default=len(CODE_PROMPTS))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--accept", type=float, default=0.7, help="forced acceptance of the cost part")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.42, help="per engine (two are alive at once)")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.num_prompts, args.max_tokens = "cpu", "float32", 2, 12
        args.batch_sizes, args.input_len, args.output_len = [1, 2], 9, 12
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    record = {"benchmark": "spec_decode", "commit": git_commit(), "environment": environment_info(device=args.device),
              "args": vars(args), "target_decode_speedup_bs1": TARGET_SPEEDUP, "acceptance": None, "cost": [],
              "timeline": []}

    def save():
        write_json(args.output, record)

    log = lambda line: print(line, flush=True)  # noqa: E731
    if "acceptance" in args.parts:
        record["acceptance"] = bench_acceptance(args, log)
        save()
    if "cost" in args.parts:
        for model in args.models:
            bench_cost(model, args, log, record["cost"], save)
    if "timeline" in args.parts:
        for model in args.models:
            bench_timeline(model, args, log, record["timeline"], save)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
