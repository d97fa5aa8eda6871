"""What the model runner settles before it loads a model: the CPU threads it computes with and
whether the requested max_model_len is allowed. Plain functions over the config and environment."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("mambaserve")


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for a CPU engine and return the count: `requested`, else
    $OMP_NUM_THREADS when set (torch read it already), else 1. Why 1: on a 2-core machine shared
    with other work (load 4-8), the Quick start's 64 tokens took 1.4-2.7 s (load 4) and 6 s
    (load 8) with one thread, 160-165 s with torch's default of a thread per core: every op
    waits for its slowest thread, and with busy cores one of them is always descheduled. When
    the machine is idle two threads gain 0.2-0.3 s over one, and a default-thread run still
    fell to 11.8 s once in ten."""
    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = requested or 1
    torch.set_num_threads(n)
    return n


def check_max_model_len(max_model_len: int | None, model_config) -> None:
    """Refuse a max_model_len past the model's max_position_embeddings (ValueError), as vLLM
    does, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: positions past what the model was trained on
    may give wrong outputs. A model without that field (pure Mamba) has no limit."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if max_model_len is None or not limit or max_model_len <= limit:
        return
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true"):
        logger.warning("max_model_len=%d is above the model's max_position_embeddings=%d "
                       "(allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN): outputs past it may be wrong", max_model_len, limit)
        return
    raise ValueError(f"max_model_len={max_model_len} is longer than the model's max_position_embeddings={limit}; "
                     "set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it (outputs past the model's positions may be "
                     "wrong)")
