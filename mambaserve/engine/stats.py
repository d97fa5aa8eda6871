"""The engine's counters and the read-only records it hands out (usage, memory).

`EngineStats` is written by the engine loop only; `EngineUsage` and `MemoryUsage` are frozen
snapshots that the server's metrics, the benchmarks and `generate` read instead of the
engine's scheduler, pools or runner. Plain Python: no tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes the engine holds for good: the weights (each shared tensor once), the running
    state slots (conv + SSM; the scratch slot and speculative decoding's verify rows included),
    the KV blocks and prefix caching's state checkpoints (rows of the same tensors as the slots,
    0 with caching off)."""

    weights_bytes: int
    state_cache_bytes: int
    kv_cache_bytes: int
    state_checkpoint_bytes: int = 0


@dataclass
class StepKindStats:
    """Steps of one kind ("{path}/{decode|prefill|mixed}"): how many, their seconds (from
    scheduling to the sampled tokens on the host), the tokens they fed to the model, and the
    longest one's seconds."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    max_step_seconds: float = 0.0


@dataclass
class SpecDecodeStats:
    """vLLM's counters: drafts (verifying sequence-steps), draft tokens proposed, drafts
    accepted, and accepted drafts per position (index j: the (j + 1)-th draft of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_proposed:
            self.num_accepted_tokens_per_pos.extend([0] * (num_proposed - len(self.num_accepted_tokens_per_pos)))
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def copy(self) -> SpecDecodeStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))


@dataclass(frozen=True)
class EngineUsage:
    """A snapshot of the engine's load and counters.

    num_running / num_waiting: sequences (a request with n > 1 has n). num_slots_used /
    num_slots_total: state slots held by sequences / handed out at most (the scratch slot not
    counted). num_blocks_used / num_blocks_total: KV blocks (0 / 0 without attention layers).
    prompt_tokens: prompt tokens computed for the first time (a recompute after preemption is
    not counted again); prompt_tokens_seen / prompt_tokens_cached: each sequence's whole prompt
    and the part of it its first admission found cached, counted once at its first prefill step
    (vLLM's vllm:prompt_tokens and vllm:prompt_tokens_cached: n x the prompt for n > 1);
    generation_tokens: tokens sampled and kept; steps: steps processed;
    preemptions: sequences preempted by recompute. step_breakdown: per kind of step (a copy).
    structured_output_mask_s: host seconds spent filling grammar masks, on whichever thread;
    structured_output_host_s: the engine thread's seconds on structured outputs (accepting
    tokens, waiting for or doing fills, launching the masks): their share of the critical path.
    prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the prefix cache at
    admission / served from it (`Scheduler.prefix_cache_stats`; both only grow, 0 with caching off).
    spec_decode: speculative decoding's counters (a copy; all zero without it).
    """

    num_running: int
    num_waiting: int
    num_slots_used: int
    num_slots_total: int
    num_blocks_used: int
    num_blocks_total: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    preemptions: int
    step_breakdown: dict[str, StepKindStats]
    structured_output_mask_s: float = 0.0
    structured_output_host_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())
    prompt_tokens_seen: int = 0
    prompt_tokens_cached: int = 0


@dataclass
class EngineStats:
    """Counters of the engine loop (EngineUsage's fields of the same names)."""

    prompt_tokens: int = 0
    prompt_tokens_seen: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    step_breakdown: dict[str, StepKindStats] = field(default_factory=dict)
    spec_decode: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())

    def count_step(self, live) -> None:
        """Count a processed step. live: its ScheduledSequences still unfinished, with their
        num_computed_tokens already advanced by the step."""
        self.steps += 1
        for s in live:
            seq = s.seq
            # a verify step's drafts are generated tokens, counted as accepted (one here)
            before = seq.num_computed_tokens - (1 if s.spec_token_ids else s.num_new_tokens)
            # a recompute after preemption counts only the prompt tokens never computed before
            # (a sequence preempted in the middle of its prefill computes the rest for the first time)
            start = max(before, seq.num_prompt_tokens_counted)
            end = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if end > start:
                if seq.num_prompt_tokens_counted == 0:  # its first prefill step (>= 1 token is computed)
                    self.prompt_tokens_seen += seq.num_prompt_tokens
                    self.prompt_tokens_cached += seq.num_cached_tokens
                self.prompt_tokens += end - start
                seq.num_prompt_tokens_counted = end

    def record_step(self, path: str, scheduled, fed_tokens: int, seconds: float) -> None:
        """Add a step to its kind's entry. path: how its forward ran; scheduled: its batch,
        after processing (a decode's computed tokens now pass its prompt; a prefill's may too)."""
        decodes = sum(1 for s in scheduled if s.spec_token_ids  # verify steps are decodes
                      or s.seq.num_computed_tokens - s.num_new_tokens >= s.seq.num_prompt_tokens)
        kind = "decode" if decodes == len(scheduled) else "prefill" if decodes == 0 else "mixed"
        entry = self.step_breakdown.setdefault(f"{path}/{kind}", StepKindStats())
        entry.steps += 1
        entry.seconds += seconds
        entry.tokens += fed_tokens
        entry.max_step_seconds = max(entry.max_step_seconds, seconds)

    def breakdown_copy(self) -> dict[str, StepKindStats]:
        return {k: dataclasses.replace(v) for k, v in self.step_breakdown.items()}

    def usage(self, scheduler, slot_pool, block_pool, structured_outputs) -> EngineUsage:
        """These counters with the queues' lengths, the pools' use (block_pool None: no
        attention layers, 0 / 0 blocks) and the grammar masks' host seconds, as one frozen snapshot."""
        return EngineUsage(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_slots_used=slot_pool.num_used, num_slots_total=slot_pool.num_slots,
            num_blocks_used=block_pool.num_used if block_pool is not None else 0,
            num_blocks_total=block_pool.num_blocks if block_pool is not None else 0,
            prompt_tokens=self.prompt_tokens, prompt_tokens_seen=self.prompt_tokens_seen,
            prompt_tokens_cached=self.prompt_tokens_cached, generation_tokens=self.generation_tokens,
            steps=self.steps, preemptions=self.preemptions, step_breakdown=self.breakdown_copy(),
            structured_output_mask_s=structured_outputs.mask_seconds,
            structured_output_host_s=structured_outputs.host_seconds,
            prefix_cache_queries=scheduler.prefix_cache_stats.queries,
            prefix_cache_hits=scheduler.prefix_cache_stats.hits, spec_decode=self.spec_decode.copy())


def format_prefix_cache_hit_rate(queries: int, hits: int) -> str:
    """The prefix-cache part of a stats line, as vLLM words it: "Prefix cache hit rate: 42.1%".
    queries, hits: prompt tokens looked up / served from the cache over the period the line
    covers (differences of `EngineUsage.prefix_cache_queries` / `prefix_cache_hits`); a period
    without queries reads 0.0%."""
    return f"Prefix cache hit rate: {100.0 * hits / queries if queries else 0.0:.1f}%"


def format_spec_decode(now: SpecDecodeStats, before: SpecDecodeStats) -> str:
    """The speculative-decoding part of a stats line over a period (the difference of two
    snapshots), as vLLM reports it: draft acceptance rate (accepted / drafted tokens), mean
    acceptance length (tokens emitted per verifying step: 1 + accepted / drafts) and the
    acceptance rate of each draft position."""
    drafts = now.num_drafts - before.num_drafts
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    old = before.num_accepted_tokens_per_pos + [0] * len(now.num_accepted_tokens_per_pos)
    per_pos = ", ".join(f"{(a - b) / drafts:.3f}" if drafts else "0.000"
                        for a, b in zip(now.num_accepted_tokens_per_pos, old))
    return (f"Spec decode: draft acceptance rate {100.0 * accepted / drafted if drafted else 0.0:.1f}%, "
            f"mean acceptance length {1 + accepted / drafts if drafts else 0.0:.2f}, "
            f"accepted {accepted} of {drafted} draft tokens, per-position acceptance rate {per_pos or '-'}")
