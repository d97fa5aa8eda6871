"""`mambaserve bench latency | throughput | serve`: the three benchmarks vLLM ships, same flags.

This module only wires the sub-subcommands; each benchmark (its flags, measurement, report)
lives in `mambaserve/benchmarks/`.
"""

from __future__ import annotations

import argparse

from mambaserve.benchmarks import latency, serve, throughput

_BENCHMARKS = {
    "latency": (latency, "time one batch end to end (vLLM's benchmark_latency), with prefill and decode times"),
    "throughput": (throughput, "offline throughput over a dataset (vLLM's benchmark_throughput)"),
    "serve": (serve, "load-test a running OpenAI-compatible completions server (streaming; TTFT, TPOT, ITL)"),
}


def register(sub) -> None:
    """Add `bench` and its sub-subcommands to the `mambaserve` subparsers."""
    p = sub.add_parser("bench", help="benchmarks: latency, throughput, serve")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in _BENCHMARKS.items():
        bp = bench_sub.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0],
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_cli_args(bp)
        bp.set_defaults(func=module.main)
