"""`mambaserve bench latency | throughput | serve` and benchmarks/hf_baseline.py, on the CPU.

Each command runs in-process through the CLI's main on a tiny checkpoint (float32, token-id
prompts, tiny lengths); its JSON has the documented fields and its numbers agree with each
other: tokens counted equal tokens asked for, rates equal counts over elapsed time,
percentiles are ordered. `bench serve` runs against a fake streaming server on loopback.
"""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

import mambaserve
from mambaserve.benchmarks.datasets import (
    MAX_PROMPT_LEN,
    MAX_TOTAL_LEN,
    build_requests,
    random_requests,
    sharegpt_requests,
    sharegpt_synthetic_lengths,
)
from mambaserve.entrypoints.cli import main
from tests.entrypoints.fake_openai_server import FakeOpenAIServer
from tests.models.tiny import CONFIGS, checkpoint

NAME = "granite-moe"
VOCAB = CONFIGS[NAME]["vocab_size"]
ENV_FIELDS = {"gpu", "engine", "engine_version", "torch_version", "triton_version", "transformers_version", "timestamp"}
LATENCY_FIELDS = {"input_len", "output_len", "batch_size", "num_iters", "avg_latency", "latencies", "percentiles",
                  "avg_prefill_time", "prefill_times", "avg_decode_time_per_token", "decode_times_per_token",
                  "output_tokens_per_iter", "expected_output_tokens_per_iter"}
THROUGHPUT_FIELDS = {"dataset", "num_requests", "elapsed_time", "total_prompt_tokens", "total_output_tokens",
                     "total_num_tokens", "expected_output_tokens", "requests_per_second", "tokens_per_second",
                     "output_tokens_per_second"}
SERVE_FIELDS = {"base_url", "endpoint", "model", "dataset", "num_prompts", "duration", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput", "errors"} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
ENGINE = ["--model", None, "--dtype", "float32", "--device", "cpu", "--disable-tqdm"]


def engine_flags():
    flags = list(ENGINE)
    flags[1] = checkpoint(NAME)
    return flags


def read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def check_common(rec, benchmark, engine="mambaserve"):
    assert rec["benchmark"] == benchmark
    env = rec["environment"]
    assert ENV_FIELDS <= set(env)
    assert env["gpu"] == "cpu" and env["engine"] == engine
    if engine == "mambaserve":
        assert env["engine_version"] == mambaserve.__version__


def check_latency(rec, input_len, output_len, batch_size, num_iters, prefill_in_batch=True, n=1):
    assert LATENCY_FIELDS <= set(rec)
    assert (rec["input_len"], rec["output_len"], rec["batch_size"], rec["n"]) == (input_len, output_len, batch_size, n)
    lat = rec["latencies"]
    assert len(lat) == len(rec["prefill_times"]) == len(rec["decode_times_per_token"]) == num_iters
    assert rec["avg_latency"] == pytest.approx(sum(lat) / num_iters)
    assert rec["avg_prefill_time"] == pytest.approx(np.mean(rec["prefill_times"]))
    ps = [rec["percentiles"][q] for q in ("10", "25", "50", "75", "90", "99")]
    assert min(lat) <= ps[0] and ps == sorted(ps) and ps[-1] <= max(lat)
    assert rec["percentiles"]["50"] == pytest.approx(float(np.median(lat)))
    assert rec["output_tokens_per_iter"] == [batch_size * n * output_len] * num_iters
    assert rec["expected_output_tokens_per_iter"] == batch_size * n * output_len
    for latency, prefill, decode in zip(lat, rec["prefill_times"], rec["decode_times_per_token"]):
        # ours times the prefill inside the batch; the baseline in a run of its own (noise may invert them)
        assert prefill > 0 and (not prefill_in_batch or (prefill <= latency and decode >= 0))
        assert prefill + decode * (output_len - 1) == pytest.approx(latency, rel=1e-6, abs=1e-9)


def check_throughput(rec, num_requests, prompt_tokens, output_tokens):
    assert THROUGHPUT_FIELDS <= set(rec)
    assert rec["num_requests"] == num_requests
    assert rec["total_prompt_tokens"] == prompt_tokens
    assert rec["total_output_tokens"] == rec["expected_output_tokens"] == output_tokens
    assert rec["total_num_tokens"] == prompt_tokens + output_tokens
    t = rec["elapsed_time"]
    assert t > 0
    assert rec["requests_per_second"] == pytest.approx(num_requests / t)
    assert rec["tokens_per_second"] == pytest.approx((prompt_tokens + output_tokens) / t)
    assert rec["output_tokens_per_second"] == pytest.approx(output_tokens / t)
    if rec["environment"]["engine"] == "mambaserve":  # ours: the steps' breakdown covers every token fed
        steps = rec["step_breakdown"]
        assert steps and set(k.split("/")[1] for k in steps) <= {"decode", "prefill", "mixed"}
        # each prompt token is fed once, each output token but the last is fed back
        assert sum(b["tokens"] for b in steps.values()) == prompt_tokens + output_tokens - num_requests
        assert 0 < sum(b["seconds"] for b in steps.values()) <= t


# ------------------------------------------------------------------ datasets
def test_sharegpt_synthetic_lengths_are_seeded_capped_and_shaped():
    pairs = sharegpt_synthetic_lengths(4000, seed=3)
    assert pairs == sharegpt_synthetic_lengths(4000, seed=3) and pairs != sharegpt_synthetic_lengths(4000, seed=4)
    ins, outs = np.array(pairs).T
    assert ins.min() >= 4 and outs.min() >= 4 and ins.max() <= MAX_PROMPT_LEN and (ins + outs).max() <= MAX_TOTAL_LEN
    # the documented shape: means ~220 / ~200, medians well below the means (heavy right tails)
    assert 195 < ins.mean() < 245 and 180 < outs.mean() < 220
    assert np.median(ins) < 0.8 * ins.mean() and np.median(outs) < 0.8 * outs.mean()


def test_random_requests_respect_the_range_ratio():
    reqs = random_requests(50, input_len=20, output_len=10, range_ratio=0.5, vocab_size=VOCAB, seed=1)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len and 0 <= min(r.prompt) and max(r.prompt) < VOCAB for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1
    with pytest.raises(ValueError):
        random_requests(1, 20, 10, 1.0, VOCAB)


class _WordTokenizer:
    def __call__(self, text, **kw):
        return {"input_ids": list(range(len(text.split())))}


def test_sharegpt_file_first_human_turn_and_gpt_reply(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "1 2 3 4 5 6"}]},
        {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "p q r s"},
                           {"from": "gpt", "value": "u v w x y z z"}, {"from": "human", "value": "ignored"}]},
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d"}]},
        {"conversations": [{"from": "human", "value": "no reply at all"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), 2, _WordTokenizer(), seed=0)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [("a b c d e", 5, 6), ("p q r s", 4, 7)]
    assert [r.output_len for r in sharegpt_requests(str(path), 2, _WordTokenizer(), output_len=9)] == [9, 9]
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(str(path), 3, _WordTokenizer())
    with pytest.raises(ValueError, match="tokenizer"):
        build_requests(str(path), 2, vocab_size=VOCAB)


# ------------------------------------------------------------------ latency / throughput
def test_bench_latency_prompts_never_hit_the_prefix_cache(tmp_path):
    """Prefix caching is on by default: iterations that repeated their prompts would time a cache
    hit (a checkpoint every 256 tokens), not the prompt."""
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", *engine_flags(), "--input-len", "300", "--output-len", "2", "--batch-size", "1",
                 "--num-iters-warmup", "1", "--num-iters", "2", "--enable-prefix-caching",
                 "--output-json", str(out)]) == 0
    assert read(out)["cached_tokens"] == [0, 0]


def test_bench_latency_n_completions_per_prompt(tmp_path):
    """vLLM's `bench latency --n`: each prompt of the batch generates n sequences (the flag was
    refused as unrecognized)."""
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", *engine_flags(), "--input-len", "4", "--output-len", "3", "--batch-size", "2",
                 "--n", "3", "--num-iters-warmup", "0", "--num-iters", "2", "--output-json", str(out)]) == 0
    check_latency(read(out), 4, 3, 2, 2, n=3)


def test_bench_latency(tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", *engine_flags(), "--input-len", "5", "--output-len", "3", "--batch-size", "2",
               "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for line in ("Avg latency:", "99% percentile latency:", "decode time per output token"):
        assert line in printed
    rec = read(out)
    check_common(rec, "latency")
    check_latency(rec, 5, 3, 2, 3)
    assert rec["compilation_mode"] == "eager"
    assert rec["engine_resolved"]["max_model_len"] == 5 + 3  # latency sizes the engine to the workload
    mem = rec["memory"]  # what the engine holds: the weights' bytes are the checkpoint's parameters'
    assert mem["weights_bytes"] > 0 and mem["state_cache_bytes"] > 0 and mem["kv_cache_bytes"] > 0
    assert "peak_gpu_allocated_bytes" not in mem  # a CPU run
    args = rec["args"]
    assert args["input_len"] == 5 and args["num_iters_warmup"] == 1 and args["dtype"] == "float32"
    assert args["skip_tokenizer_init"] is True  # the tiny checkpoint has no tokenizer
    for flag in ("enforce_eager", "max_num_seqs", "max_num_batched_tokens", "load_format", "seed", "block_size"):
        assert flag in args


@pytest.mark.parametrize("dataset", ["random", "sharegpt-synthetic"])
def test_bench_throughput(tmp_path, capsys, dataset):
    out = tmp_path / "throughput.json"
    shape = ["--input-len", "6", "--output-len", "3", "--random-range-ratio",
             "0.5"] if dataset == "random" else ["--output-len", "2"]
    rc = main(["bench", "throughput", *engine_flags(), "--dataset", dataset, "--num-prompts", "5", *shape,
               "--num-warmup-prompts", "1", "--seed", "7", "--output-json", str(out)])
    assert rc == 0
    assert "Throughput:" in capsys.readouterr().out
    rec = read(out)
    check_common(rec, "throughput")
    assert rec["dataset"] == dataset
    expected = build_requests(dataset, 5, vocab_size=VOCAB, input_len=6, output_len=3 if dataset == "random" else 2,
                              range_ratio=0.5, seed=7)
    check_throughput(rec, 5, sum(r.prompt_len for r in expected), sum(r.output_len for r in expected))


def test_bench_rejects_bad_flags(capsys):
    assert main(["bench", "latency", *engine_flags(), "--num-iters", "0"]) == 2
    assert main(["bench", "throughput", *engine_flags(), "--dataset", "random", "--random-range-ratio", "1.5"]) == 2
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------------------ serve
def test_bench_serve_against_a_streaming_server(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with FakeOpenAIServer(vocab_size=VOCAB) as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url, "--dataset", "random", "--input-len", "4",
                   "--output-len", "5", "--random-range-ratio", "0.4", "--num-prompts", "8", "--request-rate", "400",
                   "--max-concurrency", "3", "--seed", "1", "--model", checkpoint(NAME), "--save-detailed",
                   "--disable-tqdm", "--output-json", str(out)])
        bodies = srv.bodies[1:]  # the first is the untimed test request
        max_in_flight = srv.max_in_flight
    assert rc == 0
    assert "Mean TTFT (ms):" in capsys.readouterr().out
    rec = read(out)
    check_common(rec, "serve")
    assert SERVE_FIELDS <= set(rec)
    assert rec["completed"] == 8 and rec["failed"] == 0 and rec["errors"] == []
    assert max_in_flight <= 3
    # the prompts were token ids below the model's vocabulary (read from its config), streamed
    assert all(b["stream"] and all(0 <= t < VOCAB for t in b["prompt"]) for b in bodies)
    assert rec["output_token_count_source"] == "usage"
    assert rec["total_output_tokens"] == sum(b["max_tokens"] for b in bodies) == sum(rec["output_lens"])
    assert rec["total_input_tokens"] == sum(len(b["prompt"]) for b in bodies) == sum(rec["input_lens"])
    assert sorted(rec["output_lens"]) == sorted(b["max_tokens"] for b in bodies)
    for n, itl, ttft, e2el in zip(rec["output_lens"], rec["itls"], rec["ttfts"], rec["e2els"]):
        assert len(itl) == n - 1 and 0 < ttft <= e2el and ttft + sum(itl) <= e2el + 1e-9
    d = rec["duration"]
    assert rec["request_throughput"] == pytest.approx(8 / d)
    assert rec["output_throughput"] == pytest.approx(rec["total_output_tokens"] / d)
    assert rec["total_token_throughput"] == pytest.approx((rec["total_input_tokens"] + rec["total_output_tokens"]) / d)
    assert rec["mean_ttft_ms"] == pytest.approx(1e3 * np.mean(rec["ttfts"]))
    assert rec["p99_itl_ms"] == pytest.approx(1e3 * np.percentile([x for i in rec["itls"] for x in i], 99))
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < rec[f"median_{m}_ms"] <= rec[f"p99_{m}_ms"]
    assert rec["args"]["request_rate"] == 400.0 and rec["args"]["max_concurrency"] == 3


def test_bench_serve_without_usage_counts_chunks_and_finds_the_model(tmp_path):
    out = tmp_path / "serve.json"
    with FakeOpenAIServer(send_usage=False, vocab_size=50) as srv:
        rc = main(["bench", "serve", "--host", "127.0.0.1", "--port", srv.base_url.rsplit(":", 1)[1],
                   "--dataset", "sharegpt-synthetic", "--output-len", "3", "--num-prompts", "4", "--vocab-size", "50",
                   "--disable-tqdm", "--output-json", str(out)])
        bodies = srv.bodies[1:]
    assert rc == 0
    rec = read(out)
    assert rec["model"] == "fake-model" and all(b["model"] == "fake-model" for b in bodies)
    assert rec["request_rate"] == "inf"  # strict JSON: no Infinity literal
    assert rec["output_token_count_source"] == "chunks"
    assert rec["completed"] == 4 and rec["total_output_tokens"] == 12
    assert math.isclose(rec["mean_tpot_ms"] * 2 + rec["mean_ttft_ms"], rec["mean_e2el_ms"], rel_tol=1e-6)


def test_bench_serve_sharegpt_file_sends_text_and_counts_with_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from mambaserve.config import default_model

    data = [{"conversations": [{"from": "human", "value": f"def f{i}(x): return x + {i} " * 2},
                               {"from": "gpt", "value": "print(f(1)) " * (i + 2)}]} for i in range(6)]
    path, out = tmp_path / "sharegpt.json", tmp_path / "serve.json"
    path.write_text(json.dumps(data))
    with FakeOpenAIServer(send_usage=False) as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url, "--model", "m", "--tokenizer", default_model(),
                   "--dataset", str(path), "--num-prompts", "4", "--disable-tqdm", "--save-detailed",
                   "--output-json", str(out)])
        bodies = srv.bodies[1:]
    assert rc == 0
    rec = read(out)
    tok = AutoTokenizer.from_pretrained(default_model())
    assert all(isinstance(b["prompt"], str) for b in bodies)
    assert rec["total_input_tokens"] == sum(len(tok(b["prompt"])["input_ids"]) for b in bodies)
    assert rec["output_token_count_source"] == "tokenizer"
    streamed = [" ".join(f"w{i}" for i in range(b["max_tokens"])) for b in bodies]
    assert rec["total_output_tokens"] == sum(len(tok(" " + t, add_special_tokens=False)["input_ids"]) for t in streamed)


def test_bench_serve_reports_a_server_that_fails(capsys):
    with FakeOpenAIServer() as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url, "--endpoint", "/v1/nothing-here", "--model", "m",
                   "--dataset", "random", "--input-len", "2", "--output-len", "2", "--num-prompts", "2",
                   "--disable-tqdm"])
    assert rc == 2
    assert "HTTP 404" in capsys.readouterr().err


# ------------------------------------------------------------------ benchmarks/ scripts
def _script(name):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_baseline_writes_the_same_fields(tmp_path):
    hf = _script("hf_baseline")
    common = ["--model", checkpoint(NAME), "--dtype", "float32", "--device", "cpu"]
    lat, thr = tmp_path / "lat.json", tmp_path / "thr.json"
    assert hf.main(["latency", *common, "--input-len", "5", "--output-len", "3", "--batch-size", "2",
                    "--num-iters-warmup", "0", "--num-iters", "2", "--output-json", str(lat)]) == 0
    rec = read(lat)
    check_common(rec, "latency", engine="transformers")
    check_latency(rec, 5, 3, 2, 2, prefill_in_batch=False)
    assert hf.main(["throughput", *common, "--dataset", "random", "--input-len", "6", "--output-len", "3",
                    "--random-range-ratio", "0.5", "--num-prompts", "5", "--hf-max-batch-size", "2",
                    "--output-json", str(thr)]) == 0
    rec = read(thr)
    check_common(rec, "throughput", engine="transformers")
    expected = build_requests("random", 5, vocab_size=VOCAB, input_len=6, output_len=3, range_ratio=0.5, seed=0)
    check_throughput(rec, 5, sum(r.prompt_len for r in expected), sum(r.output_len for r in expected))
    assert rec["truncated"] is False and rec["generated_tokens_incl_padding"] >= rec["total_output_tokens"]


def test_bench_models_plan_and_summary():
    run = _script("bench_models")
    names = run.expected_runs(run.MODELS, run.PARTS)
    # per model: graphs 3 latency + throughput, transformers the same, eager 3 latency
    assert len(names) == len(set(names)) == 3 * 11
    lat = {"avg_latency": 0.5, "avg_decode_time_per_token": 0.002}
    runs = {"bamba-9b__mambaserve-graphed__latency-in1024-out128-bs1": lat,
            "bamba-9b__transformers__latency-in1024-out128-bs1": {"avg_latency": 6.0,
                                                                  "avg_decode_time_per_token": 0.04},
            "bamba-9b__mambaserve-graphed__throughput-sharegpt-synthetic": {"tokens_per_second": 12000.0,
                                                                           "output_tokens_per_second": 6000.0},
            "bamba-9b__transformers__throughput-sharegpt-synthetic": {"tokens_per_second": 400.0, "truncated": True,
                                                                     "output_tokens_per_second": 200.0,
                                                                     "elapsed_time": 20.2},
            "bamba-9b__transformers__latency-in31500-out128-bs1": {"skipped": "out of memory"}}
    table = run.summary_table(runs, ["bamba-9b"]).splitlines()
    assert "| 12.0x |" in table[2] and "0.500 s (2.00 ms/tok)" in table[2]
    assert "OOM (skipped)" in table[3] and "| 30.0x |" in table[5] and "20-s window" in table[5]
    assert any("12,000 total tokens/s (target >= 11,000): met" in line for line in table)
    assert any("in1024-out128-bs1: 12.0x transformers (target >= 10x): met" in line for line in table)


def test_throughput_warmup_prompts_are_not_served_from_the_prefix_cache():
    # the warm-up sends the first prompts, which the timed run sends again: a cache kept from the
    # warm-up would serve them and flatter the figure
    from mambaserve.benchmarks.datasets import BenchRequest
    from mambaserve.benchmarks.throughput import measure_throughput

    llm = mambaserve.LLM(checkpoint("granite-moe"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                         max_num_seqs=4, block_size=4, mamba_block_size=8, max_model_len=64)
    rng = np.random.default_rng(3)
    reqs = [BenchRequest(rng.integers(1, VOCAB, size=30).tolist(), 30, 2) for _ in range(3)]
    measure_throughput(llm, reqs, use_tqdm=False, num_warmup_prompts=2)
    usage = llm.llm_engine.usage()
    assert usage.prefix_cache_queries > 0 and usage.prefix_cache_hits == 0
    llm.generate([{"prompt_token_ids": reqs[0].prompt}], mambaserve.SamplingParams(max_tokens=1))
    assert llm.llm_engine.usage().prefix_cache_hits == 24  # the cache works: a repeat resumes at 24
