"""The scheduler tests' fake model and engine step: plain helpers shared by test_scheduler.py and
test_scheduler_prefix.py (no fixtures, no tests)."""

from mambaserve.engine.scheduler import Scheduler, SchedulerOutput
from mambaserve.engine.sequence import SequenceStatus

VOCAB = 50
STOP_TOKEN = 0


def next_token(tokens):
    """The fake model: a deterministic function of the whole context, so that an output never
    depends on scheduling (batching, chunking, preemption)."""
    h = 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % (2**31)
    return h % VOCAB


def expected_outputs(prompt, max_tokens, stop_token=None):
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == stop_token:
            break
    return out


def engine_update(sched: Scheduler, out: SchedulerOutput, stop_token=None):
    """What the engine does after the forward: advance, sample, finish."""
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            t = next_token(seq.all_token_ids)
            seq.append_token(t)
            if t == stop_token:
                sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
