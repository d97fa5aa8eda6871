"""`mambaserve generate`: complete prompts from the command line and print the completions."""

from __future__ import annotations

import argparse
import sys
import time

from mambaserve.entrypoints.args import (add_engine_args, add_sampling_args, engine_config_from_args,
                                         sampling_params_from_args)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: one example prompt)")
    p.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mambaserve.llm import LLM

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = ["def fibonacci(n):"]
    params = sampling_params_from_args(args)
    llm = LLM.from_config(engine_config_from_args(args))
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
