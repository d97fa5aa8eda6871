"""The engine's command-line flags, mapped onto `EngineConfig`: shared by `mambaserve generate`,
`serve` and the benchmarks, which is why they live beneath both entrypoints/ and benchmarks/.

Flag names are vLLM's, so a command line moves between the two engines unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses

from mambaserve.config import COMPILATION_MODES, EngineConfig, default_model


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the "engine" argument group: one flag per EngineConfig field a user sets."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=default_model(),
                   help="checkpoint directory, or a config .json with --load-format dummy (default: the bundled "
                        "demo model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most running requests (default: 1024 on GPUs of 70 GiB or more, else 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--cpu-cache-bytes", type=int, default=1 << 30, help="cache budget on the CPU, in bytes")
    g.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before the host has read the previous one's tokens (default on)")
    g.add_argument("--compilation-mode", default=None, choices=COMPILATION_MODES)
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None)
    g.add_argument("--skip-tokenizer-init", action="store_true")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (or CPU processes), one process each (default 1)")
    # vLLM's flags, at the values this engine implements (others are refused with the reason)
    g.add_argument("--trust-remote-code", action="store_true", help="passed to the tokenizer's loading")
    g.add_argument("--kv-cache-dtype", default="auto", help="auto only: the model dtype")
    g.add_argument("--quantization", "-q", default=None, help="none supported yet")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="not implemented: only --no-enable-prefix-caching")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of parsed flags (other flags ignored), `overrides` applied on top.
    Raises ValueError for bad values, as EngineConfig does."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(overrides)
    return EngineConfig(**kw)
