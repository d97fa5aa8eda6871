"""Throughput cost of structured outputs: one batch of requests with none constrained, a fraction
constrained by a JSON schema, and all constrained, in one process, alternating, on one engine; then
the same batch on a second engine without async scheduling (what the overlap is worth).

    python benchmarks/structured_outputs.py --model benchmarks/configs/granite-4.0-tiny-preview.json \\
        --load-format dummy --dtype bfloat16 --output-json results.json

Every request generates exactly --output-len tokens (EOS ignored; the schema is a list that must
hold more items than fit, so a constrained request never completes early), so every run produces
the same tokens and a cost is the ratio of elapsed times, minus one: the median of --repeats runs
of each kind, the kinds alternating within a repeat so that drift hits them alike. The constrained
runs pay for the grammar: masks filled on host threads (`structured_output_mask_s`, the engine's
own figure, wherever the fill ran) and the engine thread's time on it (`structured_output_host_s`:
accepting tokens, waiting for or doing fills, launching the masks: the part on the critical path).

The two engines live side by side, so on a GPU each gets half of --gpu-memory-utilization; neither
is changed after it is built. Dummy-weight configs have no tokenizer: unless --tokenizer names one,
a byte-level BPE with the model's vocabulary size is trained on the Python standard library's
sources (no network needed), so that mask work is that of a realistic vocabulary. The record
(JSON) holds the model, GPU, commit (env MAMBASERVE_COMMIT, else git), date, the flags and each
run's numbers; the target is a cost under 10% at the given fraction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mambaserve.benchmarks.common import environment_info, has_tokenizer, write_json  # noqa: E402
from mambaserve.benchmarks.common import git_commit as _git_commit  # noqa: E402
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args  # noqa: E402

TARGET_COST = 0.10
# a list of records that cannot be complete within any benchmark's output length
SCHEMA = {"type": "array", "minItems": 100000, "items": {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                   "kind": {"enum": ["alpha", "beta", "gamma", "delta"]}, "score": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                   "active": {"type": "boolean"}},
    "required": ["id", "name", "kind", "score", "tags", "active"]}}


def build_tokenizer(vocab_size: int, corpus_dir: str, out_dir: str, max_bytes: int = 16 << 20) -> str:
    """A transformers tokenizer (byte-level BPE, `<|endoftext|>` at id 0) of at most
    vocab_size tokens, trained on the .py files under corpus_dir; returns its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    for path in sorted(Path(corpus_dir).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text)
        if size > max_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return out_dir


def commit() -> str | None:
    return _git_commit(Path(__file__).resolve().parent)


def run_batch(llm, prompts, params) -> dict:
    """One timed generate over the batch: seconds, tokens, and the grammar's host seconds (from
    the engine's usage counters, before and after)."""
    engine = llm.llm_engine
    before = engine.usage()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = engine.usage()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    reasons = sorted({c.finish_reason for o in outs for c in o.outputs})
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(outs) / elapsed, "finish_reasons": reasons,
            "mask_fill_seconds": after.structured_output_mask_s - before.structured_output_mask_s,
            "mask_host_seconds": after.structured_output_host_s - before.structured_output_host_s}


def median_run(runs: list[dict]) -> dict:
    """The run of median seconds, with every run's seconds beside it."""
    mid = statistics.median(x["seconds"] for x in runs)
    rec = dict(min(runs, key=lambda x: abs(x["seconds"] - mid)))
    rec["all_seconds"] = [x["seconds"] for x in runs]
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--constrained-fraction", type=float, default=0.25)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each kind (the median is reported)")
    p.add_argument("--tokenizer-corpus", default=sysconfig.get_paths()["stdlib"],
                   help="directory of .py files to train the stand-in tokenizer on (default: the stdlib)")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args(argv)
    if not 0 < args.constrained_fraction <= 1:
        p.error("--constrained-fraction must be in (0, 1]")

    import torch

    from mambaserve import LLM, SamplingParams, StructuredOutputsParams
    from mambaserve.loader import load_config

    tmp = tempfile.TemporaryDirectory(prefix="mambaserve-so-bench-")
    if args.tokenizer is None and not has_tokenizer(args.model):
        vocab = load_config(args.model).vocab_size
        t = time.perf_counter()
        args.tokenizer = build_tokenizer(vocab, args.tokenizer_corpus, tmp.name)
        print(f"trained a {vocab}-token stand-in tokenizer in {time.perf_counter() - t:.1f} s", flush=True)
    config = engine_config_from_args(args)
    if config.resolved_device() != "cpu":  # two engines side by side: each takes half the share
        config = dataclasses.replace(config, gpu_memory_utilization=config.gpu_memory_utilization / 2)
    llm = LLM.from_config(dataclasses.replace(config, async_scheduling=True))
    sync_llm = LLM.from_config(dataclasses.replace(config, async_scheduling=False))
    tokenizer_size = len(llm.get_tokenizer())
    vocab = llm.llm_engine.vocab_size

    g = torch.Generator().manual_seed(0)
    high = min(vocab, tokenizer_size)
    prompts = [{"prompt_token_ids": torch.randint(1, high, (args.input_len,), generator=g).tolist()}
               for _ in range(args.num_prompts)]
    num_constrained = round(args.num_prompts * args.constrained_fraction)
    stride = max(1, args.num_prompts // max(1, num_constrained))
    constrained_rows = set(range(0, args.num_prompts, stride)[:num_constrained])  # spread over the batch
    plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    json_params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    batches = {"none_constrained": [plain] * args.num_prompts,
               "constrained": [json_params if i in constrained_rows else plain for i in range(args.num_prompts)],
               "all_constrained": [json_params] * args.num_prompts}
    kinds = [(name, llm, params) for name, params in batches.items()]
    kinds += [(name + "_sync", sync_llm, batches[name]) for name in ("none_constrained", "constrained")]

    # warm-up: kernels compile, the grammar compiles, xgrammar reads the vocabulary
    t = time.perf_counter()
    warm = [SamplingParams(max_tokens=16, ignore_eos=True,
                           structured_outputs=json_params.structured_outputs if i % 2 else None) for i in range(8)]
    for engine in (llm, sync_llm):
        engine.generate(prompts[:8], warm, use_tqdm=False)
    warmup_seconds = time.perf_counter() - t

    runs = {name: [] for name, _, _ in kinds}
    for r in range(args.repeats):
        for name, engine, params in kinds:
            runs[name].append(run_batch(engine, prompts, params))
        print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]['output_tokens_per_s']:.0f} tok/s" for k, v in runs.items()),
              flush=True)

    med = {name: median_run(v) for name, v in runs.items()}

    def cost(kind: str, base: str = "none_constrained") -> float:
        return med[kind]["seconds"] / med[base]["seconds"] - 1.0

    env = environment_info(device=args.device)
    record = {
        "benchmark": "structured_outputs_throughput",
        "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
        "commit": commit(), "environment": env,
        "args": {k: v for k, v in vars(args).items() if not (k == "tokenizer" and v == tmp.name)},
        "gpu_memory_utilization_per_engine": config.gpu_memory_utilization,
        "pool_sizes": dataclasses.asdict(llm.llm_engine.pool_sizes),
        "tokenizer_size": tokenizer_size, "vocab_size": vocab, "schema": SCHEMA,
        "num_prompts": args.num_prompts, "num_constrained": len(constrained_rows),
        "warmup_seconds": warmup_seconds, **med,
        "cost": cost("constrained"), "cost_all_constrained": cost("all_constrained"),
        "cost_sync": cost("constrained_sync", "none_constrained_sync"),
        "cost_of_sync_steps": cost("none_constrained_sync"),
        "target_cost": TARGET_COST, "meets_target": cost("constrained") < TARGET_COST,
    }
    c, a = med["constrained"], med["all_constrained"]
    print(f"{env['gpu']}: {len(constrained_rows)}/{args.num_prompts} constrained {c['output_tokens_per_s']:.0f} tok/s, "
          f"all {a['output_tokens_per_s']:.0f} tok/s, none {med['none_constrained']['output_tokens_per_s']:.0f} tok/s: "
          f"cost {100 * record['cost']:.1f}% (target < {100 * TARGET_COST:.0f}%), all constrained "
          f"{100 * record['cost_all_constrained']:.1f}%; without async scheduling {100 * record['cost_sync']:.1f}% "
          f"(and {100 * record['cost_of_sync_steps']:.1f}% slower unconstrained)", flush=True)
    print(f"masks: filled {c['mask_fill_seconds']:.2f} s, engine thread {c['mask_host_seconds']:.2f} s of "
          f"{c['seconds']:.2f} s ({a['mask_fill_seconds']:.2f} s / {a['mask_host_seconds']:.2f} s of "
          f"{a['seconds']:.2f} s all constrained)", flush=True)
    if args.output_json:
        write_json(args.output_json, record)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
