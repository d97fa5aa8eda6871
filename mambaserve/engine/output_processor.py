"""Output processing: from a step's sampled tokens to text, stop decisions and `RequestOutput`s.

It holds each live request's state (its sequences, their detokenised text, its timing), appends
the sampled tokens, detokenises them incrementally, decides which sequences stop (EOS and
generation-config end tokens, stop token ids, stop strings, length limits, a structured output
completed), feeds each constrained sequence's token to its grammar matcher, fills logprob records
and their decoded tokens, and builds the outputs. It decides but does not act: the
engine hands the finished sequences to the scheduler. It knows nothing of scheduling or models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mambaserve.engine.detokenizer import DecodeState, Detokenizer
from mambaserve.engine.input_processor import ProcessedRequest
from mambaserve.engine.sampler import prompt_logprobs
from mambaserve.engine.sequence import Sequence, SequenceStatus
from mambaserve.engine.structured_outputs import StructuredOutputs
from mambaserve.outputs import CompletionOutput, RequestOutput
from mambaserve.sampling_params import Logprob, SamplingParams


@dataclass
class RequestState:
    """A live request: its n sequences (one per completion), their text so far, and timing
    (time.time() of arrival and of its first sampled token). final_only: reported once, when
    it finishes, instead of after every step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    decode: list[DecodeState] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    final_only: bool = False


class OutputProcessor:
    """Per-request output state and the stop rules.

    tokenizer: None for token ids only (no text, no stop strings). eos_token_ids stop a
    request silently; extra_eos_token_ids (generation_config.json's) and a request's
    stop_token_ids stop it with the token as stop_reason. max_model_len caps prompt + output.
    structured_outputs: the engine's grammar matchers; a constrained request's constraint is
    compiled when it is added; the engine advances the matchers by each step's tokens
    (`StructuredOutputs.accept`) and a token that completes (or breaks) the constraint stops
    the sequence here.
    """

    def __init__(self, tokenizer, eos_token_ids: list[int], extra_eos_token_ids: list[int], max_model_len: int,
                 structured_outputs: StructuredOutputs):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.extra_eos_token_ids = extra_eos_token_ids
        self.max_model_len = max_model_len
        self.structured_outputs = structured_outputs
        self.requests: dict[str, RequestState] = {}
        self._seq_owner: dict[str, tuple[RequestState, int]] = {}  # sequence id -> (request, completion index)
        self.num_appended = 0  # tokens the last `process` appended (kept): its dropped ones not counted

    # ------------------------------------------------------------------ the request table
    def add(self, req: ProcessedRequest, final_only: bool) -> RequestState:
        """Start tracking a request. Raises ValueError (nothing changed) when one of its
        sequence ids is taken: "a" with n=2 has sequences "a#0" and "a#1", which a request
        named "a#0" would clash with, or its structured output does not compile."""
        assert req.request_id not in self.requests, req.request_id
        taken = [seq.request_id for seq in req.seqs if seq.request_id in self._seq_owner]
        if taken:
            raise ValueError(f"request id {req.request_id!r} clashes with running sequence ids {taken}")
        self.structured_outputs.add_request(req.seqs)  # compiles the constraint, if any (ValueError)
        decode = [DecodeState.after_prompt(req.prompt_token_ids) for _ in req.seqs]  # the prompt's tail as context
        state = RequestState(req.request_id, req.prompt, req.prompt_token_ids, req.params, req.seqs, decode,
                             req.arrival_time, final_only=final_only)
        self.requests[req.request_id] = state
        for i, seq in enumerate(req.seqs):
            self._seq_owner[seq.request_id] = (state, i)
        return state

    def remove(self, request_id: str) -> RequestState | None:
        """Stop tracking a request; returns it, or None for an unknown id."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self._seq_owner.pop(seq.request_id, None)
        return state

    # ------------------------------------------------------------------ a step's results
    def process(self, live, prompt_logits: dict[str, tuple[int, torch.Tensor]],
                new_tokens: list[tuple[Sequence, int, dict[int, Logprob] | None]], closed=frozenset()
                ) -> tuple[list[tuple[Sequence, SequenceStatus]], list[RequestState]]:
        """Apply a step. live: its ScheduledSequences still unfinished (computed counts already
        advanced); prompt_logits: StepLogits.prompt_logits; new_tokens: (sequence, token,
        logprobs or None) of each sampled live sequence (speculative decoding: a sequence's
        accepted drafts then its next token, in order; each repeat first counts one more
        computed token, and the tokens after one that finishes it are dropped); closed: the sequences whose structured
        output their new token ended (`StructuredOutputs.accept` already fed the tokens).
        Returns the sequences that finish with their status (for the scheduler) and the
        requests the step touched."""
        touched: dict[str, RequestState] = {}
        for s in live:
            seq = s.seq
            req = self._seq_owner[seq.request_id][0]
            touched[req.request_id] = req
            if seq.request_id in prompt_logits:
                self._store_prompt_logprobs(seq, *prompt_logits[seq.request_id])
            elif seq.sampling_params.prompt_logprobs is not None and seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens  # a one-token prompt: [None]
        finished, seen, done, appended = [], set(), set(), 0
        now = time.time()
        for seq, token, lps in new_tokens:
            if id(seq) in done:
                continue  # speculative decoding: a token after the one that finished it is dropped
            if id(seq) in seen:
                seq.num_computed_tokens += 1  # a repeat follows an accepted draft, now computed
            seen.add(id(seq))
            req, idx = self._seq_owner[seq.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            seq.append_token(token, lps)
            appended += 1
            status = self._update_text_and_stop(req.decode[idx], seq, token, seq not in closed)
            if status is not None:
                finished.append((seq, status))
                done.add(id(seq))
        self.num_appended = appended
        return finished, list(touched.values())

    def outputs(self, touched: list[RequestState]) -> list[RequestOutput]:
        """The outputs of the touched requests; a finished request is reported and forgotten.
        Building an output copies every token list: a final_only request is skipped until it ends."""
        return [self._output(req) for req in touched
                if not req.final_only or all(seq.is_finished for seq in req.seqs)]

    def _store_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Logprob records of the prompt tokens after position `start`; logits: (n, vocab)."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens
        nxt = seq.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        for j, d in enumerate(prompt_logprobs(logits, nxt, seq.sampling_params.prompt_logprobs)):
            if self.detokenizer is not None:
                self.detokenizer.label_logprobs(d, seq.prompt_token_ids[max(0, start + 1 + j - 8):start + 1 + j])
            seq.prompt_logprobs[start + 1 + j] = d

    def _update_text_and_stop(self, state: DecodeState, seq: Sequence, token: int,
                              grammar_open: bool = True) -> SequenceStatus | None:
        """Detokenise `seq`'s new token and decide whether it stops there (its stop_reason is
        set here); returns the finished status, or None to go on. grammar_open: False when the
        token ended the sequence's structured output."""
        p = seq.sampling_params
        status = None
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids or (not p.ignore_eos and token in self.extra_eos_token_ids):
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        if status is None and not grammar_open:  # its stop token ended the constraint (or a stray token broke it)
            status = SequenceStatus.FINISHED_STOPPED
        # A stop token's own text is left out of the output, as in vLLM, unless asked for.
        prev_len = len(state.text)
        if self.detokenizer is not None and (status is None or p.include_stop_str_in_output):
            self.detokenizer.step(state, seq.output_token_ids, p.skip_special_tokens)
        if self.detokenizer is not None and seq.output_logprobs and seq.output_logprobs[-1]:
            before = seq.output_token_ids[-9:-1]  # the tokens before this one, the prompt's if few
            before = seq.prompt_token_ids[-8 + len(before):] + before if len(before) < 8 else before
            self.detokenizer.label_logprobs(seq.output_logprobs[-1], before)
        # As in vLLM, stop strings count only after min_tokens, and only in text new in this
        # step (plus the overlap a stop string can straddle): one token may add any amount of
        # text, and text from the first min_tokens tokens never stops the request later.
        if status is None and p.stop and self.detokenizer is not None and seq.num_output_tokens > p.min_tokens:
            cut = find_stop(state.text, p.stop, prev_len + 1)
            if cut is not None:
                stop, pos = cut
                state.text = state.text[: pos + (len(stop) if p.include_stop_str_in_output else 0)]
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is None and (seq.num_output_tokens >= (p.max_tokens or self.max_model_len)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None and self.detokenizer is not None and not isinstance(seq.stop_reason, str):
            # the text is final: an incomplete character held back is decoded as it is; a stop
            # or end token's own text stays out unless asked for (a stop string's cut is done)
            keep = status == SequenceStatus.FINISHED_LENGTH or p.include_stop_str_in_output
            ids = seq.output_token_ids if keep else seq.output_token_ids[:-1]
            self.detokenizer.step(state, ids, p.skip_special_tokens, final=True)
        return status

    def _output(self, req: RequestState) -> RequestOutput:
        outs = []
        for i, seq in enumerate(req.seqs):
            lps = seq.output_logprobs if seq.sampling_params.logprobs is not None else None
            cum = None
            if lps is not None:
                cum = float(sum(d[t].logprob for d, t in zip(lps, seq.output_token_ids) if d and t in d))
            text, p = req.decode[i].text, seq.sampling_params
            if p.stop and not p.include_stop_str_in_output and not seq.is_finished:
                # as vLLM: the tail a stop string could still start in is held back, so that a
                # streamed text only grows (a stop found later would cut it)
                text = text[:max(0, len(text) - (max(map(len, p.stop)) - 1))]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(seq.output_token_ids), cumulative_logprob=cum,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = all(s.is_finished for s in req.seqs)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time}
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.seqs[0].prompt_logprobs, outs,
                            finished, metrics, num_cached_tokens=req.seqs[0].num_cached_tokens)
        if finished:
            self.remove(req.request_id)
        return out


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[str, int] | None:
    """(stop string, index) of the earliest stop string that ends at or after
    text[search_from - 1], or None."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, search_from - len(stop)))
        if i >= 0 and (best is None or i < best[1]):
            best = (stop, i)
    return best
