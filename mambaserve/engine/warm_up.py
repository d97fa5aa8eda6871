"""Start-up forwards that compile, before the first request, the kernel variants a request
could otherwise meet first in the middle of its step (each a Triton compile, about 1 s on an
H200, inside that request's time to first token)."""

from __future__ import annotations

import logging
import time

import torch

from mambaserve.forward_context import ForwardContext
from mambaserve.layers.attention import Attention
from mambaserve.ops.attention import variant_batches

logger = logging.getLogger("mambaserve")


def warm_up_attention(runner) -> list[tuple[int, int]]:
    """Run `runner`'s model (a `ModelRunner`, caches allocated) once on each batch of
    `ops.attention.variant_batches`, so that every paged-attention kernel variant a step can
    choose is compiled. Attention runs outside the piecewise CUDA graphs: without this, a prompt
    resumed from a long cached prefix (a few new tokens: short tiles, a split context) compiled
    its variant in its first step (1.1 s on an H200, the second request of a 31,500-token prompt).
    Each batch is one sequence in the scratch state slot over KV blocks 0.. of the still empty
    pool: nothing a request reads. Returns the (query_len, seq_len) batches run (none without
    attention layers)."""
    groups = {m.num_heads // m.num_kv_heads for m in runner.model.modules() if isinstance(m, Attention)}
    if not runner.has_attention or not groups:
        return []
    max_q = min(runner.max_num_batched_tokens, runner.max_model_len)
    batches = sorted({b for g in groups for b in variant_batches(g, max_q, runner.max_model_len)
                      if -(-b[1] // runner.block_size) <= runner.num_blocks})
    t0 = time.perf_counter()
    with torch.inference_mode():
        for q, seq_len in batches:
            ctx = ForwardContext.build(
                query_lens=[q], seq_lens=[seq_len], state_indices=[runner.scratch_slot],
                has_initial_state=[seq_len > q], block_tables=[list(range(-(-seq_len // runner.block_size)))],
                block_size=runner.block_size, device=runner.device, mamba_caches=runner.caches.mamba,
                kv_caches=runner.caches.kv)
            ids = torch.randint(0, runner.vocab_size, (q,), device=runner.device)
            runner.model(ids, torch.arange(seq_len - q, seq_len, device=runner.device), ctx)
    logger.info("ran the attention kernel variants (%d warm-up batches) in %.1f s", len(batches),
                time.perf_counter() - t0)
    return batches
