"""The engine's side of structured outputs: one grammar matcher per constrained sequence, the
step's token masks applied to the logits of those sequences only, and each sampled token fed
back to its matcher.

A step with no constrained sequence costs one scan of the batch's sampling params and no host
sync. Otherwise the masks of the constrained rows are filled on host threads in one batched
call into a pinned int32 bitmask (rows, ceil(vocab / 32)), copied to the device in one
non-blocking copy, and applied to those rows of the logits (one kernel on a contiguous run of
rows, decodes come first; a gather, the kernel and a scatter otherwise) before the sampler's
own processing (temperature, top-k/p, ...): masked tokens get -inf, so logprobs report them as
impossible too, as vLLM's do.

When the fill happens. A step scheduled and run in place fills its masks right after its
forward is launched (the fill overlaps the device's forward). A decode step chained ahead by
async scheduling (its forward launched before the host has the previous step's tokens) needs
the grammars after those tokens: `accept` advances the matchers by them as soon as they reach
the host, then starts that step's fill on a host thread (xgrammar's fill releases the GIL; its
accept_token does not, so the accepts stay on the engine thread) while the engine thread
detokenises, checks stops and builds outputs; `apply` only waits for it. So the engine thread's
critical path holds the accepts and the mask's launch, not the fill.

Matchers live as long as their sequence (a weak map): a finished, aborted or preempted sequence
needs no call. Preemption by recompute keeps the matcher as it is: the tokens it accepted are
the sequence's outputs, which are not sampled again. Only one fill runs at a time, and every
method that touches matchers waits for it first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mambaserve.engine.sequence import Sequence
from mambaserve.structured_outputs.grammar import GrammarCompiler

logger = logging.getLogger("mambaserve")


def default_fill_threads() -> int:
    """Threads for xgrammar's batched fill: a quarter of the CPUs this process may use, 1 to 8.
    xgrammar's own default (half the machine's hardware threads) oversubscribes a container
    with a CPU share of a larger host, and its threads then compete with the engine thread."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 4))


def _constrained(seq: Sequence) -> bool:
    return seq.sampling_params.structured_outputs is not None


class StructuredOutputs:
    """Grammar state of the constrained sequences of one engine.

    tokenizer, vocab_size (the logits width), stop_token_ids: as `GrammarCompiler` takes them.
    fill_threads: xgrammar's threads for a batch's masks (default `default_fill_threads()`).
    mask_seconds: host seconds spent filling masks, on whichever thread; host_seconds: the
    engine thread's seconds in `accept` and `apply` (accepting tokens, waiting for or doing a
    fill, launching the mask): what structured outputs add to a step's critical path.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], fill_threads: int | None = None):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.fill_threads = fill_threads or default_fill_threads()
        self.mask_seconds = 0.0
        self.host_seconds = 0.0
        self._matchers: weakref.WeakKeyDictionary[Sequence, object] = weakref.WeakKeyDictionary()
        self._batch = None  # xgrammar's BatchGrammarMatcher (its thread pool), made on first use
        self._host: torch.Tensor | None = None  # pinned (rows, words) bitmask, reused
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy of _host
        self._pool: ThreadPoolExecutor | None = None  # the one thread that fills masks ahead
        # a fill started by `accept` for the step in flight: (its sample_seqs, the rows filled, the fill)
        self._ahead: tuple[list[Sequence], list[int], Future] | None = None

    def add_request(self, seqs: list[Sequence]) -> None:
        """Compile the constraint of `seqs` (a request's n sequences, one SamplingParams) and give
        each sequence its own matcher; no-op without a constraint. Raises ValueError (nothing
        kept) when the constraint does not compile."""
        params = seqs[0].sampling_params.structured_outputs if seqs else None
        if params is None:
            return
        compiled = self.compiler.compile(params)
        xgr = self.compiler.xgr
        for seq in seqs:
            self._matchers[seq] = xgr.GrammarMatcher(compiled)

    @staticmethod
    def constrains(seqs: list[Sequence]) -> bool:
        """Whether any of `seqs` has a structured output (its sampling must wait for its grammar)."""
        return any(_constrained(seq) for seq in seqs)

    def accept(self, new_tokens, fill_ahead: list[Sequence] | None = None) -> set[Sequence]:
        """Advance the matchers of the constrained sequences among `new_tokens` ((sequence, token,
        ...) per sampled sequence) and return the sequences whose constraint their token ended: it
        was the stop token (the text is complete) or, which the masks should prevent, a token the
        grammar does not allow. fill_ahead: the sample_seqs of a step already launched whose masks
        follow these tokens: their fill starts on a host thread before this returns (`apply`
        takes it)."""
        if not self._matchers:  # no constrained sequence alive: nothing to advance, nothing to fill
            return set()
        t0 = time.perf_counter()
        self._wait_ahead()
        closed = set()
        for seq, token, *_ in new_tokens:
            matcher = self._matchers.get(seq)
            if matcher is None:
                continue
            if not matcher.accept_token(token):
                logger.warning("request %s: token %d does not fit its structured output; stopping it",
                               seq.request_id, token)
                closed.add(seq)
            elif matcher.is_terminated():
                closed.add(seq)
        if fill_ahead:
            rows = self._rows(fill_ahead, closed)
            if rows:
                matchers = [self._matchers[fill_ahead[i]] for i in rows]
                self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="mambaserve-grammar")
                self._sync_copy()  # the host buffer is free once the previous copy has read it
                started = threading.Event()
                self._ahead = (fill_ahead, rows, self._pool.submit(self._fill, matchers, started))
                # the fill needs the GIL to start, which this thread would hold for a switch interval
                # (5 ms) while it processes the step: hand it over until xgrammar has it (GIL released)
                started.wait()
        self.host_seconds += time.perf_counter() - t0
        return closed

    def _rows(self, seqs: list[Sequence], skip=()) -> list[int]:
        """Rows of `seqs` to mask: constrained, not finished (a chained step's row of a sequence that
        finished meanwhile: its token is dropped), not ended by the tokens just accepted."""
        return [i for i, seq in enumerate(seqs) if _constrained(seq) and not seq.is_finished and seq not in skip]

    @torch.inference_mode()  # the logits are inference tensors, written in place
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of `logits` (batch, vocab) whose sequence (seqs[i] for row i)
        is constrained and not finished: every token its grammar does not allow next gets -inf.
        The matchers must have accepted every token before these logits'. The masks `accept`
        started filling for these `seqs` (the same list) are taken as they are; a row whose
        sequence finished since then is masked too, harmlessly (its token is dropped)."""
        if self._ahead is None and not self._matchers:  # no constrained sequence alive
            return
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is seqs:
            rows, bitmask = ahead[1], ahead[2].result()
        else:
            if ahead is not None:
                ahead[2].result()  # masks of a step that was dropped: let the fill finish before any other
            rows = self._rows(seqs)
            if rows:
                self._sync_copy()
                bitmask = self._fill([self._matchers[seqs[i]] for i in rows])
        if rows:
            self._mask(logits, rows, bitmask)
        self.host_seconds += time.perf_counter() - t0

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """-inf where bitmask (len(rows), words) int32 on the host bans a token of logits[rows]."""
        xgr = self.compiler.xgr
        device = logits.device
        if device.type == "cuda":
            bitmask = bitmask.to(device, non_blocking=True)  # one copy, from pinned memory
            self._copied = torch.cuda.Event()
            self._copied.record()
        width = min(self.vocab_size, logits.shape[1])
        if rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run (rows ascend): one kernel on a view
            xgr.apply_token_bitmask_inplace(logits[rows[0]: rows[-1] + 1], bitmask, vocab_size=width)
            return
        # xgrammar indexes the bitmask by the logits row: mask a gathered copy of the rows instead
        # of copying a bitmask for the whole batch
        index = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            index = index.pin_memory()
        index = index.to(device, non_blocking=True)
        sub = logits.index_select(0, index)  # (len(rows), vocab)
        xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=width)
        logits.index_copy_(0, index, sub)

    def _sync_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must be done reading the buffer
            self._copied = None

    def _wait_ahead(self) -> None:
        """Let a fill ahead finish (its masks stay for `apply`): matchers may not change under it."""
        if self._ahead is not None:
            self._ahead[2].result()

    def _fill(self, matchers: list, started: threading.Event | None = None) -> torch.Tensor:
        """The next-token bitmasks of `matchers`, one row each, in the reused host buffer (any thread;
        `started` is set just before xgrammar's fill, which runs without the GIL)."""
        t0 = time.perf_counter()
        try:
            xgr = self.compiler.xgr
            n, words = len(matchers), (self.vocab_size + 31) // 32
            if self._host is None or self._host.shape[0] < n:
                self._host = torch.empty((max(n, 2 * (0 if self._host is None else self._host.shape[0])), words),
                                         dtype=torch.int32, pin_memory=torch.cuda.is_available())
            host = self._host[:n]
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
        finally:
            if started is not None:
                started.set()  # also when the above failed: the error comes with the result
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        self.mask_seconds += time.perf_counter() - t0
        return host
