"""Which decode step may be launched before the host has read the current step's tokens.

Async scheduling launches the next decode forward while the previous step's sampled tokens
are still on the device (they feed it there). That is only the same as waiting when the next
step does not depend on those tokens beyond their values: this module decides it, from the
sequences and the scheduler's queues alone (plain Python, no tensors, no model). The engine
loop (`LLMEngine._launch_next`) launches what it returns; the runner runs it.
"""

from __future__ import annotations

from mambaserve.engine.scheduler import ScheduledSequence, Scheduler
from mambaserve.engine.sequence import Sequence


def plan_chained_decode(scheduled: list[ScheduledSequence], path: str, scheduler: Scheduler,
                        max_model_len: int) -> tuple[list[int], list[Sequence]] | None:
    """The decode step that can follow `scheduled` (a step just launched, tokens not yet read):
    (rows of `scheduled` whose sequences continue, those sequences), or None when none can.

    It can when the step was a decode step (path "decode_graph" or "eager", one new token per
    sequence, each at its last token) of every running sequence, nothing waits for admission,
    and no continuing sequence needs penalties, logprobs or min_tokens masking (they read the
    host's token lists; the sampler counts min_tokens one behind for a launched step). A
    sequence that reaches its length limit with this step is left out; one that stops on one
    of its tokens (EOS, a stop string) is found afterwards and its extra token dropped. Each
    continuing sequence gets its KV block for the next token here (`reserve_tokens`), so a
    non-None result has changed the scheduler's block tables.
    """
    if (path not in ("decode_graph", "eager") or scheduler.waiting
            or any(s.num_new_tokens != 1 or s.seq.num_computed_tokens + 1 != s.seq.num_tokens for s in scheduled)):
        return None
    in_step = {id(s.seq) for s in scheduled}
    if any(id(seq) not in in_step for seq in scheduler.running):
        return None  # a running sequence the scheduler left out (a prefill short of budget) goes next
    rows, seqs = [], []
    for i, s in enumerate(scheduled):
        seq, p = s.seq, s.seq.sampling_params
        if seq.is_finished:
            continue
        if p.has_penalties or p.logprobs is not None or seq.num_output_tokens + 1 <= p.min_tokens:
            return None
        if seq.num_output_tokens + 1 >= (p.max_tokens or max_model_len) or seq.num_tokens + 1 >= max_model_len:
            continue  # finishes on this step's token
        rows.append(i)
        seqs.append(seq)
    if not seqs or not all(scheduler.reserve_tokens(seq, seq.num_tokens + 1) for seq in seqs):
        return None
    return rows, seqs
