"""`mambaserve bench throughput`: offline throughput, as vLLM's benchmark_throughput.

All requests go to one `LLM.generate` call (the engine batches them continuously); each
generates exactly its output length (EOS ignored, temperature 1). A few untimed requests run
first, so that the first use of each kernel (Triton compiles on first call) is not timed. The elapsed time of that
call gives requests/s, total tokens/s (prompt + generated) and output tokens/s; the tokens are
counted from the outputs the engine returned, not taken from the dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from mambaserve.benchmarks.common import (
    add_run_flags,
    args_record,
    check_run_flags,
    engine_record,
    environment_info,
    memory_record,
    resolve_skip_tokenizer,
    write_json,
)
from mambaserve.benchmarks.datasets import (
    MULTI_TURN,
    PREFIX_REPETITION,
    RANDOM,
    SHAREGPT,
    SYNTHETIC,
    BenchRequest,
    build_requests,
)
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args
from mambaserve.engine.gc_heap import gc_heap_frozen

DATASET_NAMES = (SYNTHETIC, RANDOM, SHAREGPT, PREFIX_REPETITION, MULTI_TURN)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags (shared by `bench throughput` and `bench serve`): --dataset-name with
    --dataset-path, and the older --dataset (a name or a ShareGPT file)."""
    parser.add_argument("--dataset-name", default=None, choices=DATASET_NAMES,
                        help=f"'{SYNTHETIC}' (built-in ShareGPT-shaped lengths, random token ids; the default), "
                             f"'{RANDOM}' (random token ids of --random-input-len/--random-output-len), "
                             f"'{SHAREGPT}' (the ShareGPT JSON file of --dataset-path), '{PREFIX_REPETITION}' (random "
                             f"prompts "
                             f"sharing a few prefixes), '{MULTI_TURN}' (bench serve only: conversations sent turn by "
                             f"turn, each re-sending the history)")
    parser.add_argument("--dataset-path", default=None, help="the ShareGPT-format JSON file of --dataset-name sharegpt")
    parser.add_argument("--dataset", default=None,
                        help="the older spelling: a --dataset-name, or a ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests in the run")
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                        help="prompt length of --dataset-name random (default 1024); given without a dataset, it "
                             "means --dataset-name random (as in vLLM)")
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                        help="output length (default 128 for --dataset-name random; overrides the dataset's otherwise)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="--dataset random: lengths uniform in [len*(1-r), len*(1+r)]")
    g = parser.add_argument_group("prefix_repetition dataset (vLLM's flags)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="tokens after it, per request")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="tokens to generate")
    g = parser.add_argument_group("multi_turn dataset (--num-prompts conversations)")
    g.add_argument("--multi-turn-num-turns", type=int, default=4, help="turns of each conversation")
    g.add_argument("--multi-turn-prefix-len", type=int, default=1024,
                   help="tokens of history before the first user message (system prompt, earlier turns)")
    g.add_argument("--multi-turn-user-len", type=int, default=128, help="tokens of each new user message")
    g.add_argument("--multi-turn-output-len", type=int, default=128, help="tokens of each answer")


def dataset_options(args: argparse.Namespace) -> dict:
    """The prefix_repetition keyword arguments of `build_requests` that its flags give."""
    return {"prefix_len": args.prefix_repetition_prefix_len, "suffix_len": args.prefix_repetition_suffix_len,
            "num_prefixes": args.prefix_repetition_num_prefixes,
            "prefix_output_len": args.prefix_repetition_output_len}


def resolve_dataset(args: argparse.Namespace) -> str:
    """What `build_requests` takes (a built-in name or a ShareGPT file) from --dataset-name,
    --dataset-path and the older --dataset; sets args.dataset to it (the record's "dataset").
    Raises ValueError for sharegpt without a file, or a --dataset that is neither name nor file."""
    name, path, old = args.dataset_name, args.dataset_path, args.dataset
    if old is not None and name is None:
        name, path = (old, path) if old in DATASET_NAMES else (SHAREGPT, old)
    name = name or (SHAREGPT if path else RANDOM if args.input_len is not None else SYNTHETIC)
    if args.input_len is None:
        args.input_len = 1024
    if name == SHAREGPT:
        if not path:
            raise ValueError(f"--dataset-name {SHAREGPT} needs --dataset-path FILE (a ShareGPT JSON file); "
                             f"--dataset-name {SYNTHETIC} draws ShareGPT-shaped lengths without one")
        if not os.path.isfile(path):
            raise ValueError(f"the ShareGPT dataset file {path!r} does not exist")
        args.dataset = path
    else:
        args.dataset = name
    return args.dataset


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench throughput`: dataset flags, output, and the shared engine flags."""
    add_dataset_args(parser)
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf", "mii", "vllm-chat"],
                        help="vllm only (this engine): hf is benchmarks/hf_baseline.py; mii and vllm-chat are refused")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--num-warmup-prompts", type=int, default=16,
                        help="untimed requests first (the dataset's first ones, at most 16 output tokens each), so "
                             "that kernel compilation is not timed")
    parser.add_argument("--output-json", default=None, help="write the results record here")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_run_flags(parser)
    add_engine_args(parser)


def _prompt(r: BenchRequest):
    return {"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt


def measure_throughput(llm, requests: list[BenchRequest], use_tqdm: bool = True, num_warmup_prompts: int = 0,
                       n: int = 1) -> dict:
    """Generate all `requests` in one `llm.generate` call, after `num_warmup_prompts` untimed
    ones (the first requests, outputs capped at 16 tokens; the prefix cache is emptied after them);
    returns the measured record fields."""
    from mambaserve.sampling_params import SamplingParams

    num = n

    def params_for(r: BenchRequest, cap: int | None = None) -> SamplingParams:
        k = r.output_len if cap is None else min(cap, r.output_len)
        return SamplingParams(n=num, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=k)

    warm = requests[:max(0, num_warmup_prompts)]
    if warm:
        llm.generate([_prompt(r) for r in warm], [params_for(r, 16) for r in warm], use_tqdm=False)
        llm.reset_prefix_cache()  # the timed run sends these prompts again: no hits from the warm-up
    prompts = [_prompt(r) for r in requests]
    params = [params_for(r) for r in requests]
    engine = llm.llm_engine
    engine.reset_step_breakdown()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rec = throughput_record(len(outs), elapsed, prompt_tokens, output_tokens,
                            expected_output_tokens=n * sum(r.output_len for r in requests))
    rec["step_breakdown"] = {k: dataclasses.asdict(b) for k, b in sorted(engine.usage().step_breakdown.items())}
    return rec


def throughput_record(num_requests: int, elapsed: float, prompt_tokens: int, output_tokens: int,
                      expected_output_tokens: int) -> dict:
    """The measured fields of a throughput record (shared with the transformers baseline)."""
    total = prompt_tokens + output_tokens
    return {
        "num_requests": num_requests, "elapsed_time": elapsed,
        "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens, "total_num_tokens": total,
        "expected_output_tokens": expected_output_tokens,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def print_throughput(rec: dict) -> None:
    print(f"Throughput: {rec['requests_per_second']:.2f} requests/s, {rec['tokens_per_second']:.2f} total tokens/s, "
          f"{rec['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {rec['total_prompt_tokens']}")
    print(f"Total num output tokens:  {rec['total_output_tokens']}")
    for kind, b in rec.get("step_breakdown", {}).items():
        print(f"  steps {kind:24s} {b['steps']:6d} steps {b['seconds']:8.2f} s {b['tokens']:9d} tokens "
              f"({1000 * b['seconds'] / max(b['steps'], 1):.2f} ms a step, longest "
              f"{1000 * b['max_step_seconds']:.1f} ms)")


def main(args: argparse.Namespace, llm=None) -> int:
    """`mambaserve bench throughput`: build the engine from the flags (or use `llm`, built by the
    caller; its config is what gets recorded) and the dataset, measure, print, save."""
    from mambaserve.llm import LLM

    if args.backend != "vllm":
        raise ValueError(f"--backend {args.backend} is not this engine's: --backend vllm runs mambaserve "
                         "(benchmarks/hf_baseline.py measures transformers)")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    resolve_dataset(args)
    if llm is None:
        check_run_flags(args)
        resolve_skip_tokenizer(args)
        llm = LLM.from_config(engine_config_from_args(args))
    config = llm.llm_engine.config
    tokenizer = llm.get_tokenizer()
    requests = build_requests(args.dataset, args.num_prompts, vocab_size=llm.llm_engine.vocab_size,
                              tokenizer=tokenizer, input_len=args.input_len, output_len=args.output_len,
                              range_ratio=args.random_range_ratio, seed=args.seed,
                              **dataset_options(args))
    with gc_heap_frozen():  # as `serve` runs: no full collection walks the engine's start-up objects
        rec = measure_throughput(llm, requests, use_tqdm=not args.disable_tqdm,
                                 num_warmup_prompts=args.num_warmup_prompts, n=args.n)
    print_throughput(rec)
    if args.output_json:
        record = {"benchmark": "throughput", "environment": environment_info(device=config.resolved_device()),
                  **engine_record(llm), "memory": memory_record(llm), "args": args_record(args),
                  "dataset": args.dataset, **rec}
        write_json(args.output_json, record)
    return 0
