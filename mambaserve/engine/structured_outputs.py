"""The engine's side of structured outputs: one grammar matcher per constrained sequence, the
step's token masks applied to the logits of those sequences only, and each sampled token fed
back to its matcher.

A step with no constrained sequence costs one scan of the batch's sampling params. Otherwise,
after the forward is launched (so that on a GPU the host work overlaps it; a forward chained
ahead by async scheduling is sampled once the host has processed the step before), the masks of the
constrained rows are filled on host threads in one batched call into a pinned int32 bitmask
(rows, ceil(vocab / 32)), copied to the device without blocking, and applied to those rows of
the logits before the sampler's own processing (temperature, top-k/p, ...): masked tokens get
-inf, so logprobs report them as impossible too, as vLLM's do.

Matchers live as long as their sequence (a weak map): a finished, aborted or preempted sequence
needs no call. Preemption by recompute keeps the matcher as it is: the tokens it accepted are
the sequence's outputs, which are not sampled again.
"""

from __future__ import annotations

import logging
import weakref

import torch

from mambaserve.engine.sequence import Sequence
from mambaserve.structured_outputs.grammar import GrammarCompiler

logger = logging.getLogger("mambaserve")


class StructuredOutputs:
    """Grammar state of the constrained sequences of one engine.

    tokenizer, vocab_size (the logits width), stop_token_ids: as `GrammarCompiler` takes them.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._matchers: weakref.WeakKeyDictionary[Sequence, object] = weakref.WeakKeyDictionary()
        self._batch = None  # xgrammar's BatchGrammarMatcher (its thread pool), made on first use
        self._host: torch.Tensor | None = None  # pinned (rows, words) bitmask, reused
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy of _host

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
        return any(seq.sampling_params.structured_outputs is not None for seq in seqs)

    @torch.inference_mode()  # the logits are inference tensors, written in place
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of `logits` (batch, vocab) whose sequence (seqs[i] for row i)
        is constrained and not finished: every token its grammar does not allow next gets -inf.
        The matchers must have accepted every token before these logits' (the engine samples a
        chained step with constrained rows only after processing the step before it)."""
        # a sequence that finished meanwhile (a chained step's row) is skipped: its token is dropped
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.structured_outputs is not None
                and not seq.is_finished]
        if not rows:
            return
        matchers = [self._matchers[seqs[i]] for i in rows]
        bitmask = self._fill(matchers)  # (len(rows), words) int32 on the host
        xgr = self.compiler.xgr
        device = logits.device
        if device.type == "cuda":
            bitmask = bitmask.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        width = min(self.vocab_size, logits.shape[1])
        if rows == list(range(rows[0], rows[0] + len(rows))):
            xgr.apply_token_bitmask_inplace(logits[rows[0]: rows[0] + len(rows)], bitmask, vocab_size=width)
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

    def _fill(self, matchers: list) -> torch.Tensor:
        """The next-token bitmasks of `matchers`, one row each, in the reused host buffer."""
        xgr = self.compiler.xgr
        n, words = len(matchers), (self.vocab_size + 31) // 32
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must be done reading the buffer
            self._copied = None
        if self._host is None or self._host.shape[0] < n:
            self._host = torch.empty((max(n, 2 * (0 if self._host is None else self._host.shape[0])), words),
                                     dtype=torch.int32, pin_memory=torch.cuda.is_available())
        host = self._host[:n]
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, host)
        return host

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance `seq`'s matcher (if it has one) by its sampled token. Returns False when the
        constraint ends the sequence: the token was its stop token (the text is complete) or,
        which the masks should prevent, a token the grammar does not allow."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return True
        if not matcher.accept_token(token):
            logger.warning("request %s: token %d does not fit its structured output; stopping it",
                           seq.request_id, token)
            return False
        return not matcher.is_terminated()
