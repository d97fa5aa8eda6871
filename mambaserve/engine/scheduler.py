"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Plain Python over `Sequence` objects, a `StateSlotPool` and (for models with attention layers)
a `BlockPool`; no tensors, no model. The engine runs the forward pass over the returned batch,
then adds each scheduled chunk to `seq.num_computed_tokens`, appends the sampled tokens and
calls `finish` for the sequences that are done. The scheduler never does that itself.

Policy of `schedule()`, one step at a time, under a budget of `max_num_batched_tokens` tokens:

1. Decodes. Every running sequence with exactly one uncomputed token, in running order
   (= admission order), gets 1 token while the budget lasts.
2. Running prefills. Every running sequence still in a chunked prefill (more than one
   uncomputed token), in running order, gets min(uncomputed, budget left) tokens; with no
   budget left it simply waits for the next step.
   Before a running sequence is scheduled, its block table is grown to cover
   `num_computed_tokens + num_new_tokens` tokens. If the block pool is short, the most recently
   admitted running sequence not yet scheduled in this step (possibly the sequence itself) is
   preempted by recompute: its slot and blocks are freed, `num_computed_tokens` goes back to
   0, it becomes WAITING at the front of the waiting queue and is listed in `preempted`. Its
   outputs so far are kept; later it is prefilled again over prompt + outputs.
3. Admission. If nothing was preempted in this step, waiting sequences are admitted in FIFO
   order while budget, `max_num_seqs`, state slots and KV blocks allow; with prefix caching, one
   whose prefix a running prefill is about to checkpoint is passed over (it keeps its place)
   until the checkpoint exists. An admitted sequence
   gets a state slot and the blocks of its first chunk: min(uncomputed, budget left) tokens
   with chunked prefill; without it, the whole prefill or nothing (a prefill that does not fit
   the budget left waits, and so does everyone behind it). Admission never preempts.

The batch lists decodes first, then chunks of running prefills, then the new admissions. A
sequence is never scheduled twice in one step. Every running sequence holds a state slot;
waiting ones hold neither a slot nor blocks.

Prefix caching (`prefix_cache`, `cache.prefix_cache`): at the start of each `schedule()` the
checkpoints the previous step saved become visible and every running sequence's full, computed
blocks are registered (so a prefix computed in a step is never matched within that step). An
admitted sequence first matches its prefix: its block table starts with the cached blocks
(shared, never written), `num_computed_tokens` with the matched tokens, and its first chunk
copies the checkpoint row into its slot (`load_checkpoint`). A prefill chunk that passes one
of the sequence's `checkpoint_positions` has its forward write the state there into a
checkpoint row (`inner_saves`: Mamba2 layers, when the position is at least
`min_inner_save_offset` tokens into the chunk, for the conv's inputs); otherwise (Mamba-1
layers, or a position right after the chunk's start) the chunk ends there and its step copies
the slot into a checkpoint row (`save_checkpoint`), without chunked prefill too (the rest of
the prompt is the next step's running prefill). Saving inside the chunk spares a prompt the
extra step (a whole pass over the weights) that ending there costs. A sequence asking for
prompt logprobs matches nothing (they need every prompt row's logits). Released blocks keep their hashes (cached).

Assumptions the engine guarantees: each sequence fits the KV pool on its own (so the oldest
running sequence always makes progress and there is no livelock); without chunked prefill,
`max_num_batched_tokens` covers the longest prompt (checked in `add`). The one exception to
"whole or nothing" without chunked prefill is a recompute after preemption longer than the
budget (prompt + outputs): it is chunked, since it could never run otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.prefix_cache import PrefixCache, PrefixCacheStats, PrefixMatch, chunk_end
from mambaserve.cache.state_pool import StateSlotPool
from mambaserve.engine.sequence import Sequence, SequenceStatus

MAX_PASSED_OVER = 32  # waiting sequences a step passes over (a match each); admission then waits with them


@dataclass
class ScheduledSequence:
    """One sequence of a step: it computes the tokens
    all_token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]."""

    seq: Sequence
    num_new_tokens: int
    load_checkpoint: int | None = None  # state row copied into seq.state_slot before the forward
    save_checkpoint: int | None = None  # state row seq.state_slot is copied into after the forward
    # (offset, state row): checkpoints the forward writes inside the chunk, after `offset` of its tokens
    inner_saves: tuple[tuple[int, int], ...] = ()
    spec_token_ids: list[int] = field(default_factory=list)  # drafts it verifies (`spec_decode.SpecDecoder.schedule`)


@dataclass
class SchedulerOutput:
    """The batch of one step.

    scheduled: decodes first (in running order), then prefill chunks.
    preempted: sequences preempted by recompute in this step (now waiting, not in `scheduled`).
    num_batched_tokens: sum of num_new_tokens over `scheduled`.
    """

    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue, running batch and the state/KV resources they hold (policy: module doc).

    block_pool is None when the model has no attention layers; prefix_cache None: no prefix
    caching (it works over the same block_pool).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        slot_pool: StateSlotPool,
        block_pool: BlockPool | None,
        enable_chunked_prefill: bool = True,
        prefix_cache: PrefixCache | None = None,
        min_inner_save_offset: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slot_pool = slot_pool
        self.block_pool = block_pool
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        assert prefix_cache is None or prefix_cache.block_pool is block_pool
        self.prefix_cache = prefix_cache
        # the model's layers write checkpoints inside a chunk at least this far into it
        # (`CacheSpec.min_inner_save_offset`); None: chunks end at checkpoints
        self.min_inner_save_offset = min_inner_save_offset

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache queries and hits in tokens (all zero without prefix caching)."""
        return self.prefix_cache.stats if self.prefix_cache is not None else PrefixCacheStats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block and state checkpoint. Returns False, dropping nothing,
        while any request runs (vLLM's semantics); True without prefix caching."""
        if self.running:
            return False
        return self.prefix_cache is None or self.prefix_cache.reset()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO). Raises ValueError for a request id already in use, or,
        without chunked prefill, for a prompt longer than max_num_batched_tokens."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already queued or running")
        if not self.enable_chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} with chunked prefill off"
            )
        assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.state_slot is None and not seq.block_table
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a waiting or running sequence: free its slot and blocks, status
        FINISHED_ABORTED, finish_reason "abort". Returns it, or None for an unknown id."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the scheduler with a finished status: free its slot and
        blocks, set status and (unless already set) finish_reason."""
        assert status.is_finished, status
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            assert seq.status == SequenceStatus.WAITING, seq
            self.waiting.remove(seq)
        self._release(seq)
        del self._by_id[seq.request_id]
        seq.status = status
        if seq.finish_reason is None:
            seq.finish_reason = status.finish_reason

    def schedule(self) -> SchedulerOutput:
        """Choose the next step's batch (policy: module docstring)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        scheduled_ids: set[int] = set()  # id() of sequences scheduled in this step
        preempted: list[Sequence] = []
        if self.prefix_cache is not None:
            self.prefix_cache.checkpoints.commit()  # the previous step, which saved them, is launched
            for seq in self.running:
                self._register_blocks(seq)

        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                    continue
                remaining = seq.num_uncomputed_tokens
                assert remaining >= 1, f"running {seq} has nothing to compute"
                if (remaining == 1) != decodes:
                    continue
                num_new = self._to_checkpoint(seq, min(remaining, budget))
                while not self._grow_blocks(seq, seq.num_computed_tokens + num_new):
                    victim = next(s for s in reversed(self.running) if id(s) not in scheduled_ids)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    continue
                scheduled.append(self._with_saves(ScheduledSequence(seq, num_new)))
                scheduled_ids.add(id(seq))
                budget -= num_new

        planned: set[bytes] | None = None  # keys of the checkpoints running prefills will save
        i = 0  # waiting[:i] wait for a checkpoint on its way (`PrefixCache.promised`)
        while (
            not preempted
            and i < min(len(self.waiting), MAX_PASSED_OVER)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[i]
            match = self._match(seq)
            if self.prefix_cache is not None and seq.sampling_params.prompt_logprobs is None:
                # a checkpoint of its prefix beyond `match` is on its way: admitted once it exists
                planned = self.prefix_cache.planned_keys(self.running) if planned is None else planned
                if self.prefix_cache.promised(seq.block_hashes, seq.num_tokens, match.num_tokens, planned):
                    i += 1
                    continue
            remaining = seq.num_tokens - match.num_tokens
            if remaining <= budget:
                num_new = remaining
            elif self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
                num_new = budget
            else:
                break
            num_new = self._admit(seq, num_new, match, i)
            if not num_new:
                break
            scheduled.append(self._with_saves(ScheduledSequence(seq, num_new, load_checkpoint=match.checkpoint_row)))
            if planned is not None:  # its positions beyond this chunk (those inside are pending now)
                planned |= self.prefix_cache.planned_keys([seq])
            scheduled_ids.add(id(seq))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    # -- resources ---------------------------------------------------------------------------

    def reserve_tokens(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow a running sequence's block table to cover num_tokens tokens, for a step the
        engine launches without `schedule` (the decode step after one still in flight);
        False (nothing taken) if the blocks are short."""
        assert seq.status == SequenceStatus.RUNNING, seq
        return self._grow_blocks(seq, num_tokens)

    def _grow_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend seq.block_table to cover num_tokens tokens; False (nothing taken) if short."""
        if self.block_pool is None:
            return True
        missing = self.block_pool.blocks_needed(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.block_pool.can_allocate(missing):
            return False
        seq.block_table.extend(self.block_pool.allocate(missing))
        return True

    def _admit(self, seq: Sequence, num_new: int, match: PrefixMatch, index: int = 0) -> int:
        """Move waiting[index] (seq) to running with a slot, its matched prefix (the
        cached blocks, shared) and its first chunk's blocks: num_new tokens, or fewer to end at
        its first checkpoint position. Returns the chunk's tokens; 0 (nothing taken) if the
        slot or the blocks are short. Counts the prefix-cache query."""
        assert seq.num_computed_tokens == 0 and seq.state_slot is None and not seq.block_table
        if self.slot_pool.num_free == 0:
            return 0
        cache = self.prefix_cache
        if cache is not None:
            seq.checkpoint_positions = cache.plan_checkpoints(seq.block_hashes, match.num_tokens, seq.num_prompt_tokens)
            num_new = chunk_end(match.num_tokens, seq.checkpoint_positions, num_new, self.min_inner_save_offset)
        cached = match.blocks or []
        if self.block_pool is not None and not self.block_pool.can_allocate(
            self.block_pool.blocks_needed(match.num_tokens + num_new) - len(cached), reusing=cached
        ):
            seq.checkpoint_positions = []
            return 0
        if cached:
            self.block_pool.touch(cached)
            seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)
        seq.num_computed_tokens = match.num_tokens
        ok = self._grow_blocks(seq, match.num_tokens + num_new)
        assert ok
        seq.state_slot = self.slot_pool.allocate()
        del self.waiting[index]
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if cache is not None:
            cache.remember_boundaries(seq.block_hashes, seq.num_prompt_tokens)
            if seq.num_preemptions == 0:  # vLLM: a re-admission counts apart; num_cached_tokens stays
                cache.stats.queries += seq.num_prompt_tokens
                cache.stats.hits += match.num_tokens
                seq.num_cached_tokens = match.num_tokens
            else:
                cache.stats.preempted_queries += seq.num_tokens
                cache.stats.preempted_hits += match.num_tokens
        return num_new

    # -- prefix caching ----------------------------------------------------------------------

    def _match(self, seq: Sequence) -> PrefixMatch:
        """The cached prefix a waiting sequence can resume from (nothing taken yet)."""
        cache = self.prefix_cache
        if cache is None:
            return PrefixMatch()
        cache.extend_hashes(seq.block_hashes, seq.get_token_ids, seq.num_tokens, seq.cache_salt)  # for checkpoints too
        if seq.sampling_params.prompt_logprobs is not None:
            return PrefixMatch()
        return cache.match(seq.block_hashes, seq.num_tokens)

    def _to_checkpoint(self, seq: Sequence, num_new: int) -> int:
        """num_new, cut so that the chunk ends at the sequence's next checkpoint position that
        the forward cannot save inside the chunk (`chunk_end`)."""
        start, positions = seq.num_computed_tokens, seq.checkpoint_positions
        while positions and positions[0] <= start:
            positions.pop(0)
        return chunk_end(start, positions, num_new, self.min_inner_save_offset)

    def _with_saves(self, s: ScheduledSequence) -> ScheduledSequence:
        """s with the checkpoint rows its step saves into: one for each checkpoint position
        inside the chunk (`inner_saves`) and one at its end (`save_checkpoint`), each taken
        off the sequence's positions; a position with no row to be had is skipped."""
        seq, positions = s.seq, s.seq.checkpoint_positions
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
        inner = []
        while positions and positions[0] <= end:
            p = positions.pop(0)
            row = self.prefix_cache.reserve_checkpoint(seq.block_hashes, p)
            if row is None:
                continue
            if p == end:
                s.save_checkpoint = row
            else:
                inner.append((p - start, row))
        s.inner_saves = tuple(inner)
        return s

    def _register_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are full and computed (their KV is in the cache
        once the steps that wrote them ran: the engine counts a chunk computed after its step)."""
        if self.block_pool is None:
            return
        end = min(seq.num_computed_tokens // self.block_pool.block_size, len(seq.block_table))
        if end > seq.num_registered_blocks:
            self.prefix_cache.extend_hashes(seq.block_hashes, seq.get_token_ids, end * self.block_pool.block_size,
                                            seq.cache_salt)
            self.prefix_cache.register_blocks(seq.block_hashes, seq.block_table, seq.num_registered_blocks, end)
            seq.num_registered_blocks = end

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: release everything, back to the front of the waiting queue."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free the slot and let go of the blocks (computed full ones registered first: they
        stay cached for later requests)."""
        if self.prefix_cache is not None:
            self._register_blocks(seq)
            seq.num_registered_blocks = 0
            seq.checkpoint_positions = []
        if seq.state_slot is not None:
            self.slot_pool.free(seq.state_slot)
            seq.state_slot = None
        if seq.block_table:
            assert self.block_pool is not None
            self.block_pool.free(seq.block_table)
            seq.block_table = []
