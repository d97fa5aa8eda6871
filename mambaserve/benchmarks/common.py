"""What every benchmark record shares: the environment, the flags, percentiles, the JSON file.

A record is a flat dict of the measured numbers plus "environment" (GPU, versions, time) and
"args" (every flag as parsed), so results from different runs and engines line up. Knows
nothing about how the numbers were measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path

PERCENTILES = (10, 25, 50, 75, 90, 99)

# files whose presence means a checkpoint directory carries its own tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def environment_info(engine: str = "mambaserve", device: str | None = None) -> dict:
    """GPU name (or "cpu" when device is "cpu" or there is none), engine name and version
    ("mambaserve", or "transformers" for the baseline), torch/triton/transformers/Python versions."""
    import torch

    import mambaserve

    on_gpu = torch.cuda.is_available() and device != "cpu"
    info = {
        "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
        "num_gpus": torch.cuda.device_count() if on_gpu else 0,
        "engine": engine,
        "engine_version": mambaserve.__version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "triton_version": _version_of("triton"),
        "transformers_version": _version_of("transformers"),
        "python_version": platform.python_version(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if engine == "transformers":
        info["engine_version"] = info["transformers_version"]
    return info


def git_commit(repo: str | os.PathLike) -> str | None:
    """The measured commit, for a result's JSON: $MAMBASERVE_COMMIT (a checkout copied without
    .git, as on the GPU machine), else `git rev-parse HEAD` in repo; None when neither answers."""
    if os.environ.get("MAMBASERVE_COMMIT"):
        return os.environ["MAMBASERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, text=True, capture_output=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: record that it was not there
        return None


def engine_record(llm) -> dict:
    """The engine as it resolved itself: compilation mode, config, and the pool sizes it chose."""
    import dataclasses

    engine = llm.llm_engine
    sizes = engine.pool_sizes
    return {
        "compilation_mode": engine.config.resolved_compilation_mode(),
        "engine_config": dataclasses.asdict(engine.config),
        "engine_resolved": {
            "max_model_len": sizes.max_model_len, "max_num_seqs": sizes.max_num_seqs,
            "max_num_batched_tokens": sizes.max_num_batched_tokens, "num_state_slots": sizes.num_slots,
            "num_kv_blocks": sizes.num_blocks, "dtype": engine.dtype,
            "mamba_ssm_cache_dtype": engine.mamba_ssm_cache_dtype},
    }


def memory_record(llm) -> dict:
    """What the engine holds (weights, state and KV caches, in bytes) and, on a GPU, the peak
    of allocated device memory so far in this process (torch's counter: weights, caches, CUDA
    graph pools and the largest step's activations)."""
    import dataclasses

    import torch

    engine = llm.llm_engine
    rec = dataclasses.asdict(engine.memory)
    if engine.device.type == "cuda":
        rec["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.device)
        rec["gpu_total_bytes"] = torch.cuda.get_device_properties(engine.device).total_memory
    return rec


def format_memory(rec: dict) -> str:
    """One line for humans: 'peak GPU memory 21.4 GiB (weights 13.6, state caches 2.1, KV 4.0 GiB)'."""
    gib = 2**30
    checkpoints = rec.get("state_checkpoint_bytes", 0)
    parts = (f"weights {rec.get('weights_bytes', 0) / gib:.2f}, state caches "
             f"{rec.get('state_cache_bytes', 0) / gib:.2f}, "
             + (f"prefix-cache state checkpoints {checkpoints / gib:.2f}, " if checkpoints else "")
             + f"KV cache {rec.get('kv_cache_bytes', 0) / gib:.2f} GiB")
    if "peak_gpu_allocated_bytes" in rec:
        return f"peak GPU memory {rec['peak_gpu_allocated_bytes'] / gib:.2f} GiB ({parts})"
    return f"engine memory: {parts}"


def args_record(args: argparse.Namespace) -> dict:
    """Every parsed flag, JSON-safe (the CLI's dispatch function left out)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def percentiles(values: list[float], qs=PERCENTILES) -> dict[str, float]:
    """{"10": p10, "25": p25, ...} of `values` (linear interpolation, as numpy's default)."""
    import numpy as np

    if not values:
        return {str(q): float("nan") for q in qs}
    return {str(q): float(v) for q, v in zip(qs, np.percentile(np.asarray(values, dtype=np.float64), qs))}


def write_json(path: str | os.PathLike, record: dict) -> None:
    """Write `record` as indented JSON, creating parent folders; atomic (rename) so a killed
    run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_json_safe(record), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _json_safe(x):
    """Non-finite floats as strings ("inf", "nan"): strict JSON has no Infinity or NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's offline-benchmark switches: --disable-detokenize (honoured: token ids only, the
    tokenizer is not loaded), --profile and --use-beam-search (refused by `check_run_flags`)."""
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="do not detokenize outputs (token ids only: the tokenizer is not loaded)")
    parser.add_argument("--profile", action="store_true", help="not implemented: use benchmarks/profile_step.py")
    parser.add_argument("--use-beam-search", action="store_true", help="not implemented: no beam search")


def check_run_flags(args: argparse.Namespace) -> None:
    """Refuse what `add_run_flags` cannot honour (ValueError) and apply --disable-detokenize."""
    if args.profile:
        raise ValueError("--profile is not implemented here: benchmarks/profile_step.py profiles engine steps")
    if args.use_beam_search:
        raise ValueError("--use-beam-search is not supported: the engine has no beam search")
    if args.disable_detokenize:
        args.skip_tokenizer_init = True


def has_tokenizer(model: str) -> bool:
    """Whether `model` is a checkpoint directory that carries tokenizer files."""
    p = Path(model)
    return p.is_dir() and any((p / name).is_file() for name in _TOKENIZER_FILES)


def resolve_skip_tokenizer(args: argparse.Namespace) -> None:
    """Benchmarks feed token ids: skip the tokenizer where there is none to load (dummy
    weights or a checkpoint without tokenizer files) unless --tokenizer names one."""
    if getattr(args, "tokenizer", None):
        return
    if args.load_format == "dummy" or not has_tokenizer(args.model):
        args.skip_tokenizer_init = True
