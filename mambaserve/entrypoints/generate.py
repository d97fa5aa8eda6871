"""`mambaserve generate`: complete prompts from the command line and print the completions."""

from __future__ import annotations

import argparse
import sys
import time

from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args
from mambaserve.engine.gc_heap import gc_heap_frozen
from mambaserve.sampling_params import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: one example prompt)")
    p.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )


def run(args: argparse.Namespace) -> int:
    from mambaserve.llm import LLM

    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            sys.exit(f"mambaserve generate: cannot read --prompts-file {args.prompts_file!r}: {e.strerror}")
    if not prompts:
        prompts = ["def fibonacci(n):"]
    params = sampling_params_from_args(args)
    llm = LLM.from_config(engine_config_from_args(args))
    with gc_heap_frozen():  # its entry's full collection stays out of the timed part
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
        elapsed = time.perf_counter() - start
    n_tokens = 0
    for out in outputs:
        for c in out.outputs:
            n_tokens += len(c.token_ids)
            if len(prompts) > 1 or len(out.outputs) > 1:
                print(f"=== prompt: {out.prompt!r} (completion {c.index}, {c.finish_reason})")
            print((out.prompt or "") + c.text)
    from mambaserve.benchmarks.common import format_memory, memory_record

    print(f"[{n_tokens} tokens in {elapsed:.2f} s, {n_tokens / max(elapsed, 1e-9):.1f} tokens/s; "
          f"{format_memory(memory_record(llm))}]", file=sys.stderr)
    return 0
