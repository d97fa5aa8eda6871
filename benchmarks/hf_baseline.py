"""The latency and throughput workloads of `mambaserve bench` through transformers' `generate`.

This is the path a user takes without a serving engine, and the denominator of our speed-up
ratios. It writes records with the same fields as `mambaserve bench latency | throughput`
("environment.engine" is "transformers").

    python benchmarks/hf_baseline.py latency --model benchmarks/configs/bamba-9b.json \
        --input-len 1024 --output-len 128 --batch-size 1 --num-iters-warmup 0 --num-iters 1 --output-json out.json
    python benchmarks/hf_baseline.py throughput --model benchmarks/configs/bamba-9b.json \
        --dataset sharegpt-synthetic --num-prompts 1000 --max-seconds 60 --output-json out.json

--model is a checkpoint directory or a config .json (random weights, built with
`AutoModelForCausalLM.from_config` directly on the device). Latency: each timed iteration runs
`generate` twice on the same random batch, once with max_new_tokens=1 (the prefill time) and
once with max_new_tokens=output_len (the latency); decode time per token is their difference
over output_len - 1. Both force exactly that many tokens (min_new_tokens) and sample at
temperature 1 as our benchmarks do. Throughput: requests in dataset order, in batches of
--hf-max-batch-size, left-padded; each batch generates as many tokens as its longest request
asks for, and only the tokens asked for are counted (vLLM's HF baseline does the same).
--max-seconds caps the run (generate's max_time stops the batch in flight): the record then
counts the work done in that window, the prompts started and the asked-for tokens generated
("truncated": true; "num_requests" counts the requests finished). That window leaves out the
tail of a static batch (steps spent on its longest request alone), so it overstates
transformers' sustained throughput: speed-ups against a truncated run are lower bounds. Out
of memory is recorded in the JSON ("error") and the exit status is 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from mambaserve.benchmarks.common import args_record, environment_info, has_tokenizer, write_json
from mambaserve.benchmarks.datasets import BenchRequest, build_requests, random_token_ids
from mambaserve.benchmarks.latency import latency_record, print_latency
from mambaserve.benchmarks.throughput import add_dataset_args, print_throughput, resolve_dataset, throughput_record

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_hf_model(model: str, dtype: torch.dtype, device: str):
    """A transformers causal LM in eval mode: random weights from a config .json, or a checkpoint."""
    from transformers import AutoModelForCausalLM

    if Path(model).is_file():
        from mambaserve.loader import load_config  # reads the bare configs, non-finite floats included

        with torch.device(device):
            net = AutoModelForCausalLM.from_config(load_config(model), dtype=dtype)
    else:
        net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
    return net.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def _generate(net, input_ids: torch.Tensor, mask: torch.Tensor, n: int, max_time: float | None = None):
    pad = net.config.pad_token_id if net.config.pad_token_id is not None else 0
    return net.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                        temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, use_cache=True, max_time=max_time)


def hf_latency(net, args, device: str) -> dict:
    """Warm up, then time `num_iters` (prefill run, full run) pairs; returns the measured fields."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    vocab = net.config.vocab_size
    ids = torch.tensor([random_token_ids(rng, args.input_len, vocab) for _ in range(args.batch_size)], device=device)
    mask = torch.ones_like(ids)
    _generate(net, ids[:, :16], mask[:, :16], 2)  # first-call setup, not timed
    lat, pre, dec, toks = [], [], [], []
    for i in range(args.num_iters_warmup + args.num_iters):
        _sync(device)
        t0 = time.perf_counter()
        _generate(net, ids, mask, 1)
        _sync(device)
        t1 = time.perf_counter()
        out = _generate(net, ids, mask, args.output_len)
        _sync(device)
        t2 = time.perf_counter()
        if i >= args.num_iters_warmup:
            pre.append(t1 - t0)
            lat.append(t2 - t1)
            dec.append((t2 - t1 - (t1 - t0)) / (args.output_len - 1) if args.output_len > 1 else 0.0)
            toks.append((out.shape[1] - args.input_len) * args.batch_size)
    return latency_record(lat, pre, dec, toks, input_len=args.input_len, output_len=args.output_len,
                          batch_size=args.batch_size)


def _token_ids(req: BenchRequest, tokenizer) -> list[int]:
    return req.prompt if isinstance(req.prompt, list) else tokenizer(req.prompt)["input_ids"]


def hf_throughput(net, requests: list[BenchRequest], args, device: str, tokenizer=None) -> dict:
    """Generate `requests` in order, in left-padded batches; returns the measured fields."""
    pad = net.config.pad_token_id if net.config.pad_token_id is not None else 0
    warm = torch.zeros((1, 8), dtype=torch.long, device=device)
    _generate(net, warm, torch.ones_like(warm), 2)  # first-call setup, not timed
    started, finished, prompt_tokens, output_tokens, expected, generated = 0, 0, 0, 0, 0, 0
    _sync(device)
    start = time.perf_counter()
    while started < len(requests):
        left = args.max_seconds - (time.perf_counter() - start) if args.max_seconds else None
        if left is not None and left <= 0:
            break
        batch = requests[started:started + args.hf_max_batch_size]
        started += len(batch)
        seqs = [_token_ids(r, tokenizer) for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
        # a batch runs as long as its longest request; max_time may cut it short
        out = _generate(net, ids, mask, max(r.output_len for r in batch), max_time=left)
        steps = out.shape[1] - width
        generated += steps * len(batch)
        prompt_tokens += sum(len(s) for s in seqs)
        output_tokens += sum(min(r.output_len, steps) for r in batch)  # only the tokens asked for
        expected += sum(r.output_len for r in batch)
        finished += sum(r.output_len <= steps for r in batch)
    _sync(device)
    elapsed = time.perf_counter() - start
    rec = throughput_record(finished, elapsed, prompt_tokens, output_tokens, expected_output_tokens=expected)
    rec.update({"num_requests_started": started, "num_requests_planned": len(requests),
                "truncated": finished < len(requests), "generated_tokens_incl_padding": generated})
    return rec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench_command", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    thr = sub.add_parser("throughput")
    add_dataset_args(thr)
    thr.add_argument("--hf-max-batch-size", type=int, default=32)
    thr.add_argument("--max-seconds", type=float, default=None, help="start no new batch after this many seconds")
    for p in (lat, thr):
        p.add_argument("--model", required=True, help="checkpoint directory or config .json (random weights)")
        p.add_argument("--tokenizer", default=None, help="for a ShareGPT dataset file")
        p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
        p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None, net=None) -> int:
    """Run one baseline benchmark (on `net` if given, a model the caller loaded for several);
    returns 0, or 3 after recording an out-of-memory error."""
    args = build_parser().parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(args.seed)
    record = {"benchmark": args.bench_command, "environment": environment_info("transformers", device=device),
              "args": args_record(args)}
    status = 0
    try:
        if net is None:
            net = load_hf_model(args.model, DTYPES[args.dtype], device)
        if args.bench_command == "latency":
            rec = hf_latency(net, args, device)
            print_latency(rec)
        else:
            tok_path = args.tokenizer or (args.model if has_tokenizer(args.model) else None)
            tokenizer = None
            if tok_path:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tok_path)
            requests = build_requests(resolve_dataset(args), args.num_prompts, vocab_size=net.config.vocab_size,
                                      tokenizer=tokenizer, input_len=args.input_len, output_len=args.output_len,
                                      range_ratio=args.random_range_ratio, seed=args.seed)
            rec = {"dataset": args.dataset, **hf_throughput(net, requests, args, device, tokenizer)}
            print_throughput(rec)
            if rec["truncated"]:
                print(f"(stopped after --max-seconds: {rec['num_requests']} of {rec['num_requests_planned']} "
                      "requests done)")
        record.update(rec)
    except torch.cuda.OutOfMemoryError as e:
        print(f"out of memory: {e}", file=sys.stderr)
        record["error"] = f"out of memory: {str(e)[:300]}"
        status = 3
        torch.cuda.empty_cache()
    if args.output_json:
        write_json(args.output_json, record)
    return status


if __name__ == "__main__":
    sys.exit(main())
