"""Speculative decoding in the engine loop: proposing drafts before a step, verifying them
after it, and carrying each verifying sequence's accepted state into its slot.

Per step (`LLMEngine`, through `schedule`): `propose` gives every running decode its drafts
(`seq.spec_token_ids`, at most k, cut so that the 1 + k tokens it may emit stay within
max_tokens and max_model_len); the scheduler schedules as without them; `extend` then gives
the scheduled decodes with drafts 1 + k tokens (so plain decodes and prefill chunks come
first, and the drafts get the budget they leave); the runner's forward writes the state
after each of them into scratch state rows (`layers.verify`) and returns k + 1 rows of logits;
`verify` runs the rejection sampler (`engine.rejection_sampler`), returns the emitted tokens
(the accepted drafts and one more) as new-token entries for the output processor, which
truncates them at a stop, and remembers, per sequence, the state row of its last accepted
position; `take_state_loads` hands those (row, slot) copies to the next step, which runs
them before its forward (after the scheduler has run: a sequence preempted or finished
meanwhile is skipped). A checkpoint of prefix caching is only ever saved from a slot, which
then holds an exact state: the verify forward never writes the slot.

No drafts for a sequence with penalties, min_tokens still to reach, a structured output or
fewer than two tokens to go: its verify rows' distributions would depend on the drafts
before them. Such sequences decode one token a step as before (logged once per reason).

Async scheduling does not chain decode steps while speculative decoding is on: drafts are
proposed from the host's tokens, which a chained step runs ahead of.
"""

from __future__ import annotations

import logging
import os
import weakref

import numpy as np

from mambaserve.config import EngineConfig
from mambaserve.engine.rejection_sampler import verify_drafts
from mambaserve.engine.scheduler import Scheduler, SchedulerOutput
from mambaserve.engine.sequence import Sequence, SequenceStatus
from mambaserve.engine.stats import SpecDecodeStats

logger = logging.getLogger("mambaserve")


class NgramProposer:
    """Prompt lookup: for n from prompt_lookup_max down to prompt_lookup_min, the last n tokens
    of the sequence are looked up among its earlier tokens; the latest earlier match followed by
    k tokens proposes them (none such: the earliest match, the longest continuation there is).
    A repeating pattern thus drafts whole periods, not the stub after its last repeat.

    Host cost per call: one comparison over the sequence (where its last token recurs), then
    only over those candidates for each longer suffix, so a 32k-token sequence costs about what
    one n-gram's sliding window did (`SpecDecoder` also keeps each sequence's tokens as an
    array, grown by what it gained, instead of converting the list every step)."""

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int):
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to k drafts continuing token_ids (a list, or an int64 array: not copied); []
        when no n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        top = min(self.n_max, total - 1)
        if top < self.n_min:
            return []
        # ends[j]: every e <= total - 1 with tokens[e - j : e] equal to the last j tokens (the
        # n-grams before the final one, by where they end)
        ends = [None, np.flatnonzero(tokens[: total - 1] == tokens[total - 1]) + 1]
        for j in range(2, top + 1):
            e = ends[-1]
            e = e[e >= j]
            ends.append(e[tokens[e - j] == tokens[total - j]])
        for n in range(top, self.n_min - 1, -1):
            e = ends[n]
            if len(e):
                full = e[e + k <= total]  # matches followed by k tokens
                start = int(full[-1] if len(full) else e[0])
                return tokens[start : start + k].tolist()
        return []


class _TokenArray:
    """A sequence's token ids as an int64 array, grown by the tokens it gained since the last
    call (a sequence's tokens are only ever appended)."""

    def __init__(self):
        self.buf, self.n = np.empty(0, dtype=np.int64), 0

    def of(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if total < self.n:  # not expected: rebuilt
            self.n = 0
        if total > len(self.buf):
            grown = np.empty(max(total, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n : total] = seq.get_token_ids(self.n, total)
            self.n = total
        return self.buf[:total]


FORCE_ACCEPT_ENV = "MAMBASERVE_SPEC_FORCE_ACCEPT"


class SpecDecoder:
    """The engine's speculative decoding (module docstring): n-gram drafts (`NgramProposer`) or a
    draft model's (`draft_proposer.DraftModelProposer`), per config.speculative_config. runner:
    the target's ModelRunner (its vocabulary and max_model_len); sampler: the engine's; constrains:
    the structured outputs' test for a grammar-constrained sequence; stats: the counters it
    adds to (the engine's `EngineStats.spec_decode`); accept_fraction: a benchmark tool only
    (`ForcedAcceptance`; default: $MAMBASERVE_SPEC_FORCE_ACCEPT, unset in normal use)."""

    def __init__(self, config: EngineConfig, runner, sampler, constrains, stats: SpecDecodeStats | None = None,
                 accept_fraction: float | None = None):
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.proposer = self.drafter = None
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
        else:
            from mambaserve.engine.draft_proposer import DraftModelProposer

            self.drafter = DraftModelProposer(spec, config, runner.vocab_size, runner.max_model_len)
        self.sampler, self.constrains, self.max_model_len = sampler, constrains, runner.max_model_len
        self.max_num_verify_seqs = runner.max_num_verify_seqs
        self.stats = stats if stats is not None else SpecDecodeStats()
        if accept_fraction is None and os.environ.get(FORCE_ACCEPT_ENV):
            accept_fraction = float(os.environ[FORCE_ACCEPT_ENV])
        self.forced = None if accept_fraction is None else ForcedAcceptance(accept_fraction)
        self._pending: list[tuple[Sequence, int, int]] = []  # (sequence, its slot, state row to load)
        self._told: set[str] = set()  # reasons for no drafts already logged
        self._tokens: weakref.WeakKeyDictionary[Sequence, _TokenArray] = weakref.WeakKeyDictionary()  # n-gram

    def max_drafts(self, seq: Sequence) -> int:
        """How many drafts seq may verify in its next step (0: none; module docstring)."""
        p = seq.sampling_params
        if seq.num_uncomputed_tokens != 1:
            return 0
        why = "penalties" if p.has_penalties else "min_tokens" if seq.num_output_tokens < p.min_tokens else \
            "a structured output" if self.constrains([seq]) else None
        if why is not None:
            if why not in self._told:  # once per engine and reason: the request is served, not sped up
                self._told.add(why)
                logger.info("speculative decoding proposes no drafts for requests with %s (request %s); they "
                            "decode one token a step", why, seq.request_id)
            return 0
        return max(0, min(self.k, (p.max_tokens or self.max_model_len) - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def schedule(self, scheduler: Scheduler) -> SchedulerOutput:
        """The step's batch: drafts proposed, the scheduler's batch, the drafts added to it."""
        self.propose(scheduler.running)
        sched = scheduler.schedule()
        self.extend(sched, scheduler)
        return sched

    def extend(self, sched: SchedulerOutput, scheduler: Scheduler) -> None:
        """Give the scheduled decodes with drafts their 1 + k tokens: k cut to the step budget the
        scheduler left, at most `max_num_verify_seqs` of them, each only if its KV blocks for
        them can be had (`Scheduler.reserve_tokens`, which never preempts); the others stay
        plain decodes. A decode with a checkpoint to save gets none."""
        left = scheduler.max_num_batched_tokens - sched.num_batched_tokens
        num_verify = 0
        for s in sched.scheduled:
            seq = s.seq
            drafts = seq.spec_token_ids[:left]
            if (not drafts or num_verify == self.max_num_verify_seqs or s.num_new_tokens != 1
                    or seq.num_computed_tokens == 0 or seq.num_computed_tokens + 1 != seq.num_tokens
                    or s.load_checkpoint is not None or s.save_checkpoint is not None or s.inner_saves):
                continue
            if not scheduler.reserve_tokens(seq, seq.num_tokens + len(drafts)):
                continue
            s.num_new_tokens += len(drafts)
            s.spec_token_ids = list(drafts)
            left -= len(drafts)
            num_verify += 1
        sched.num_batched_tokens = scheduler.max_num_batched_tokens - left

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's drafts for the next step."""
        wanted = []
        for seq in running:
            k = self.max_drafts(seq)
            seq.spec_token_ids = []
            if k:
                wanted.append((seq, k))
        if self.drafter is not None and self.forced is None:
            drafts = self.drafter.propose(wanted)
            for seq, _ in wanted:
                seq.spec_token_ids = drafts.get(id(seq), [])
            return
        for seq, k in wanted:
            seq.spec_token_ids = self._propose(seq, k)

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        if self.forced is not None:
            return [seq.last_token_id] * k  # any values: the forced acceptance ignores them
        tokens = self._tokens.get(seq)
        if tokens is None:
            tokens = self._tokens[seq] = _TokenArray()
        return self.proposer.propose(tokens.of(seq), k)

    def verify(self, result) -> list[tuple[Sequence, int, dict | None]]:
        """The new-token entries of a step's verifying sequences (`StepLogits.verify`), in
        order, a sequence's accepted drafts then its next token; aborted ones are skipped.
        Counts the metrics and remembers each sequence's accepted state row."""
        seqs = [s.seq for s in result.verify]
        drafts = [s.spec_token_ids for s in result.verify]
        emitted = verify_drafts(self.sampler, result.verify_logits, seqs, drafts)
        if self.forced is not None:
            emitted = self.forced(drafts, emitted)
        entries = []
        for seq, d, rows, (tokens, lps) in zip(seqs, drafts, result.verify_state_rows, emitted):
            self.stats.record(len(d), len(tokens) - 1)
            if seq.is_finished:
                continue
            self._pending.append((seq, seq.state_slot, rows[len(tokens) - 1]))
            entries.extend((seq, t, lp) for t, lp in zip(tokens, lps))
        return entries

    def take_state_loads(self) -> list[tuple[int, int]]:
        """(state row, slot) copies of the accepted states, for the next forward: only of the
        sequences still running in the slot they verified in."""
        pending, self._pending = self._pending, []
        return [(row, slot) for seq, slot, row in pending
                if seq.status == SequenceStatus.RUNNING and seq.state_slot == slot]


class ForcedAcceptance:
    """Benchmark tool only ($MAMBASERVE_SPEC_FORCE_ACCEPT=fraction): each verifying sequence
    accepts its first drafts whatever the target says, `fraction` of all drafts on average (a
    running remainder carries the fractions between sequences), then emits the target's token
    at that position. A dummy-weight model accepts nothing; this shows the cost side of
    speculative decoding at a chosen acceptance (every forward and the rejection sampler still
    run). The outputs are not the model's: never for real use."""

    def __init__(self, fraction: float):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{FORCE_ACCEPT_ENV} must be a fraction in [0, 1], got {fraction}")
        self.fraction, self._carry = fraction, 0.0

    def __call__(self, drafts: list[list[int]], emitted: list[tuple[list[int], list]]) -> list[tuple[list[int], list]]:
        """emitted: `verify_drafts`' result for these drafts; returns it with the forced counts."""
        out = []
        for d, (tokens, _) in zip(drafts, emitted):
            self._carry += self.fraction * len(d)
            a = min(len(d), int(self._carry + 1e-9))
            self._carry -= a
            out.append((list(d[:a]) + [tokens[-1]], [None] * (a + 1)))
        return out
