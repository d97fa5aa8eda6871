"""The benchmarks behind `mambaserve bench latency | throughput | serve`.

`latency` and `throughput` drive the offline `LLM.generate` (the engine's one `step()` loop);
`serve` is an HTTP client for any OpenAI-compatible completions server. `datasets` builds the
request lists they share (random token ids, a ShareGPT-shaped synthetic set, a ShareGPT file)
and `common` the results record (environment, flags, percentiles). `benchmarks/hf_baseline.py`
at the repository root runs the same workloads through transformers' `generate`.
"""
