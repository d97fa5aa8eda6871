"""The engine's command-line flags, mapped onto `EngineConfig`: shared by `mambaserve generate`,
`serve` and the benchmarks, which is why they live beneath both entrypoints/ and benchmarks/.

Flag names are vLLM's, so a command line moves between the two engines unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from mambaserve.config import COMPILATION_MODES, EngineConfig, default_model

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """A token count as vLLM's --max-model-len takes it: an integer, or a number with a suffix,
    k/m/g decimal (25.6k = 25,600) and K/M/G binary (1K = 1,024, whole numbers only). Raises
    argparse.ArgumentTypeError otherwise (argparse then prints one line)."""
    text = str(text).strip()
    unit = _SUFFIX.get(text[-1:]) if text else None
    try:
        if unit is None:
            return int(text)
        number = text[:-1]
        if text[-1].isupper():
            return int(number) * unit
        value = float(number) * unit
        if value == int(value) and number.replace(".", "", 1).isdigit():
            return int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a token count (an integer, or e.g. 32k = 32,000, 32K = 32,768)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the "engine" argument group: one flag per EngineConfig field a user sets."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=default_model(),
                   help="checkpoint directory, Hugging Face model id (read from the local Hugging Face cache, "
                        "downloaded unless HF_HUB_OFFLINE=1), or a config .json with --load-format dummy "
                        "(default: the bundled demo model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or model id (default: the model's)")
    g.add_argument("--revision", default=None, help="branch, tag or commit of a Hugging Face model id (default: main)")
    g.add_argument("--download-dir", default=None,
                   help="Hugging Face cache folder for model ids (default: $HF_HOME/hub)")
    g.add_argument("--tokenizer-mode", default="auto", choices=["auto", "slow", "mistral", "custom"],
                   help="auto: the fast tokenizer; slow: the Python one (mistral and custom are refused)")
    g.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=human_readable_int, default=None,
                   help="tokens of context, prompt and output (e.g. 4096, 32k = 32,000, 32K = 32,768; default: the "
                        "config's)")
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
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps (default on)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (or CPU processes), one process each (default 1)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary; default 20)")
    g.add_argument("--generation-config", default="auto",
                   help="auto: the checkpoint's generation_config.json gives end tokens and default sampling "
                        "parameters; vllm: none; or a folder to read it from")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines in the log")
    g.add_argument("--cpu-num-threads", type=int, default=None,
                   help="torch threads on the CPU (default: $OMP_NUM_THREADS, else 1: steady on shared cores)")
    # vLLM's flags, at the values this engine implements (others are refused with the reason)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only: no pipeline parallelism")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="1 only: one engine per process (run one server per replica)")
    g.add_argument("--swap-space", type=float, default=None,
                   help="accepted for vLLM command lines and has no effect: preempted requests are recomputed, "
                        "never swapped to CPU memory")
    g.add_argument("--trust-remote-code", action="store_true", help="passed to the tokenizer's loading")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model dtype; fp8 / fp8_e4m3: attention KV stored as float8_e4m3fn (half the bytes)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "compressed-tensors"],
                   help="fp8: weights quantized to FP8 at load; compressed-tensors: an FP8 checkpoint of that format "
                        "(default: the checkpoint's quantization_config, else none)")
    # prefix caching (vLLM's flag; the state-checkpoint flags are ours: a hybrid model needs them)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks and Mamba state checkpoints of prompt prefixes seen before (default on)")
    g.add_argument("--mamba-block-size", type=int, default=None,
                   help="tokens between state checkpoints: a prefix is reused up to a multiple of it (default 256, "
                        "rounded up to a multiple of --block-size)")
    g.add_argument("--num-state-checkpoints", type=int, default=None,
                   help="rows of the state-checkpoint pool beside the running state slots (default: the cache "
                        "budget's share for them; 0: no checkpoints)")
    g.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help='speculative decoding, as JSON (vLLM\'s keys): \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or '
                        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'')


def speculative_config_arg(text: str) -> dict:
    """--speculative-config's value: a JSON object (its keys are checked by EngineConfig)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of parsed flags (other flags ignored), `overrides` applied on top.
    Raises ValueError for bad values, as EngineConfig does."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(overrides)
    return EngineConfig(**kw)
