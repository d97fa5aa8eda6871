"""What the engine tells its log: one start-up summary (what was loaded and how the caches were
sized) and, every `interval` seconds while there is work, a stats line (throughput, queue,
state-slot and KV-block use), as vLLM's logging stat logger prints them.

Reads the engine's read API only (`LLMEngine.pool_sizes`, `memory`, `usage()`); plain Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mambaserve.engine.stats import EngineUsage, SpecDecodeStats, format_prefix_cache_hit_rate, format_spec_decode

logger = logging.getLogger("mambaserve")

STATS_INTERVAL_S = 10.0  # vLLM's default interval


def log_startup_summary(engine) -> None:
    """One INFO line per topic: the model (path, architecture, dtypes, device), the sizes
    (max_model_len, max_num_seqs, max_num_batched_tokens), the pools and their memory, and the
    load and graph-capture times."""
    runner, sizes, mem, gib, mib = engine.runner, engine.pool_sizes, engine.memory, 2**30, 2**20
    arch = (getattr(runner.model.config, "architectures", None) or [type(runner.model).__name__])[0]
    cfg = engine.config
    logger.info("model %s (%s): dtype %s, SSM state %s, device %s, tensor_parallel_size %d", cfg.model, arch,
                str(engine.dtype).replace("torch.", ""), str(engine.mamba_ssm_cache_dtype).replace("torch.", ""),
                engine.device, cfg.tensor_parallel_size)
    logger.info("max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d", sizes.max_model_len,
                sizes.max_num_seqs, sizes.max_num_batched_tokens)
    kv = (f"{sizes.num_blocks} KV blocks of {cfg.block_size} tokens ({mem.kv_cache_bytes / mib:.1f} MiB)"
          if runner.has_attention else "no KV cache (no attention layers)")
    every = cfg.cache_config.resolved_mamba_block_size
    checkpoints = (f", {sizes.num_checkpoints} prefix-cache state checkpoints every {every} tokens "
                   f"({mem.state_checkpoint_bytes / mib:.1f} MiB)" if sizes.num_checkpoints else "")
    logger.info("caches: %d state slots (%.1f MiB)%s, %s; weights %.2f GiB", sizes.num_slots,
                mem.state_cache_bytes / mib, checkpoints, kv, mem.weights_bytes / gib)
    capture = runner.graph_capture_seconds
    logger.info("loaded in %.1f s; compilation mode %s%s%s", runner.load_seconds, runner.compilation_mode,
                f", graphs captured in {capture:.1f} s" if capture is not None else "",
                f"; {runner.cpu_threads} CPU thread(s)" if engine.device.type == "cpu" else "")
    if engine.device.type == "cpu":
        logger.info("CPU cache budget cpu_cache_bytes=%d (gpu_memory_utilization applies on GPUs only)",
                    cfg.cpu_cache_bytes)
    if cfg.swap_space is not None:
        logger.info("swap_space=%g GiB has no effect: a preempted request is recomputed, never swapped", cfg.swap_space)


class StatLogger:
    """The periodic stats line: call `maybe_log(engine.usage)` after every step (cheap); every
    `interval` seconds it logs the prompt and generation throughput since the last line, the
    running and waiting sequences, the state-slot and KV-block use and, once the prefix cache
    has been looked up, its hit rate over the period (tokens served / tokens looked up), and,
    once speculative decoding has drafted, its acceptance over the period. Idle periods (no tokens,
    nothing queued) after a line of zeros are not logged again."""

    def __init__(self, interval: float = STATS_INTERVAL_S):
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = self._last_gen = 0
        self._last_queries = self._last_hits = 0  # prefix-cache tokens looked up / served
        self._last_spec = SpecDecodeStats()
        self._idle_logged = False

    def maybe_log(self, read_usage: Callable[[], EngineUsage], now: float | None = None) -> str | None:
        """Log (and return) the stats line if `interval` has passed (only then is `read_usage`,
        `LLMEngine.usage`, called); None otherwise."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return None
        usage = read_usage()
        prompt, gen = usage.prompt_tokens - self._last_prompt, usage.generation_tokens - self._last_gen
        idle = prompt == 0 and gen == 0 and usage.num_running == 0 and usage.num_waiting == 0
        self._last_time, self._last_prompt, self._last_gen = now, usage.prompt_tokens, usage.generation_tokens
        queries, hits = usage.prefix_cache_queries - self._last_queries, usage.prefix_cache_hits - self._last_hits
        self._last_queries, self._last_hits = usage.prefix_cache_queries, usage.prefix_cache_hits
        if idle and self._idle_logged:
            return None
        self._idle_logged = idle
        kv = (f", KV blocks {usage.num_blocks_used}/{usage.num_blocks_total} "
              f"({100 * usage.num_blocks_used / usage.num_blocks_total:.1f}%)" if usage.num_blocks_total else "")
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{gen / elapsed:.1f} tokens/s, Running: {usage.num_running} reqs, Waiting: {usage.num_waiting} reqs, "
                f"State slots: {usage.num_slots_used}/{usage.num_slots_total} "
                f"({100 * usage.num_slots_used / max(usage.num_slots_total, 1):.1f}%){kv}, "
                f"Preemptions: {usage.preemptions}")
        if usage.prefix_cache_queries:  # caching on and used at least once
            line += ", " + format_prefix_cache_hit_rate(queries, hits)
        if usage.spec_decode.num_drafts:  # speculative decoding on and drafting
            line += ", " + format_spec_decode(usage.spec_decode, self._last_spec)
            self._last_spec = usage.spec_decode
        logger.info(line)
        return line
