"""The engine loop: add requests, step, abort. Offline `LLM.generate`, the server and the
benchmarks all drive this one `step()`.

A step reads like a paragraph: schedule, run the model, sample, update the sequences (tokens,
detokenised text, stop conditions), free what finished, and report outputs. With async
scheduling, a decode step is launched one call ahead, before the host has read the tokens it
continues from (they feed it on the device): the device computes while the host updates.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from mambaserve.cache.block_pool import BlockPool
from mambaserve.cache.state_pool import StateSlotPool
from mambaserve.config import EngineConfig
from mambaserve.engine.detokenizer import DecodeState, Detokenizer
from mambaserve.engine.model_runner import ModelRunner, StepLogits
from mambaserve.engine.sampler import PendingSample, Sampler, prompt_logprobs
from mambaserve.engine.scheduler import ScheduledSequence, Scheduler
from mambaserve.engine.sequence import Sequence, SequenceStatus
from mambaserve.outputs import CompletionOutput, RequestOutput
from mambaserve.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve")


class QueueFullError(RuntimeError):
    """add_request found max_queue_len requests already waiting (the server answers 503)."""


@dataclass
class _Request:
    """A user request: its n sequences (one per completion) and shared prompt data."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    decode: list[DecodeState] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    final_only: bool = False


@dataclass
class _Step:
    """A launched step: its batch, its logits, its sampling (maybe still on the device), and
    how the forward ran (decode_graph, piecewise, eager)."""

    scheduled: list[ScheduledSequence]
    result: StepLogits
    sample: PendingSample | None
    path: str
    fed_tokens: int = 0  # tokens of sequences still live when it was processed (the rest are dropped)


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model,
                                                               trust_remote_code=config.trust_remote_code)
            except Exception as e:  # noqa: BLE001 - transformers raises many kinds
                raise ValueError(f"could not load a tokenizer from {config.tokenizer or config.model!r} "
                                 f"(use skip_tokenizer_init=True for token ids only): {e}") from e
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = self._eos_ids()
        # generation_config.json may name more end tokens (a chat model's end of turn beside the
        # end of text): as in vLLM, they stop a request unless ignore_eos, with the token as its
        # stop_reason, and min_tokens masks them too
        self.extra_eos_token_ids = [t for t in self._generation_config_eos_ids() if t not in self.eos_token_ids]
        self.max_model_len = self.runner.max_model_len
        self.slot_pool = StateSlotPool(self.runner.num_slots - 1)  # the last slot is the scratch slot
        self.block_pool = BlockPool(self.runner.num_blocks, config.block_size) if self.runner.has_attention else None
        self.scheduler = Scheduler(
            max_num_seqs=self.runner.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            slot_pool=self.slot_pool, block_pool=self.block_pool,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.sampler = Sampler(self.eos_token_ids + self.extra_eos_token_ids or None)
        self.requests: dict[str, _Request] = {}
        self._seq_owner: dict[str, tuple[_Request, int]] = {}
        self._counter = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0}
        # Where step time goes, by kind of step: "{path}/{decode|prefill|mixed}" -> [steps, seconds,
        # tokens, longest step's seconds]; path is how the forward ran (decode_graph, piecewise,
        # eager). A step's seconds run from scheduling to the sampled tokens on the host (a sync).
        self.step_breakdown: dict[str, list[float]] = {}
        self._inflight: _Step | None = None  # a decode step launched ahead (async scheduling)

    def _eos_ids(self) -> list[int]:
        """The model config's EOS id(s) and the tokenizer's (vLLM stops on the tokenizer's; a
        checkpoint whose two disagree ends its text with the tokenizer's)."""
        eos = getattr(self.runner.model.config, "eos_token_id", None)
        ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        return ids

    def _generation_config_eos_ids(self) -> list[int]:
        """eos_token_id of the checkpoint's generation_config.json (an id or a list), or []."""
        path = os.path.join(self.config.model, "generation_config.json")
        if not os.path.isfile(path):
            return []
        try:
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            logger.warning("ignoring unreadable %s: %s", path, e)
            return []
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            logger.warning("ignoring eos_token_id %r of %s: not token ids", eos, path)
            return []
        return ids

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): pass prompt_token_ids")
        return self.tokenizer(prompt)["input_ids"]

    def add_request(
        self,
        request_id: str | None,
        prompt: str | dict | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request: a text prompt, a list of token ids, or {"prompt_token_ids": [...]}
        (vLLM's TokensPrompt). Returns its request id. final_only: `step` reports the request
        once, when it finishes (offline generation), instead of after every step (streaming). Raises ValueError (engine unchanged) for
        an empty prompt, token ids outside the vocabulary, a prompt that leaves no room within
        max_model_len, or a request id already in use."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        # a private copy, validated again: the caller may change or reuse its object while this
        # request runs (vLLM copies it too), and a field set to nonsense after creation is refused
        params = dataclasses.replace(params)
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._parse_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.detokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine runs with skip_tokenizer_init=True): "
                             "use stop_token_ids")
        vocab = self.runner.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.biased_token_ids()):
            raise ValueError(f"logit_bias and allowed_token_ids must name token ids in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        if self.config.max_queue_len is not None and self.scheduler.num_waiting >= self.config.max_queue_len:
            raise QueueFullError("the request queue is full")
        now = time.time() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                # completion i draws from seed + i, wrapped into the signed 64-bit range
                p = dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Sequence(seq_id, prompt_token_ids=token_ids, sampling_params=p, prompt=text, arrival_time=now))
        # "a" with n=2 has sequences "a#0" and "a#1": refuse a request whose sequence ids are taken
        # before anything is changed (the clean-up below would abort the other request's sequence)
        taken = [seq.request_id for seq in seqs if seq.request_id in self._seq_owner]
        if taken:
            raise ValueError(f"request id {request_id!r} clashes with running sequence ids {taken}")
        req = _Request(request_id, text, list(token_ids), params, seqs, [DecodeState() for _ in seqs], now,
                       final_only=final_only)
        self.requests[request_id] = req
        try:
            for i, seq in enumerate(seqs):
                self._seq_owner[seq.request_id] = (req, i)
                self.scheduler.add(seq)
        except Exception:
            self.abort_request(request_id)  # leave no half-added request behind
            raise
        return request_id

    def _parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and free its slots and blocks. Returns False for an unknown id. The id
        is taken as add_request takes it (str(request_id)): an int id aborts its request."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.request_id)
            self._seq_owner.pop(seq.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of requests that advanced or finished.

        With async scheduling (the default), a decode step may already be running on the
        device when this is called (launched by the previous call); otherwise the scheduler
        picks a batch and it is launched here. Before waiting for that step's tokens, the
        next decode step is launched when it can be known without them (`_launch_next`), so
        the device works while the host updates sequences, detokenises and checks stops.
        """
        t0 = time.perf_counter()
        step = self._inflight
        self._inflight = None
        if step is not None and all(s.seq.is_finished for s in step.scheduled):
            step = None  # every sequence of it finished or was aborted meanwhile: drop it
        if step is None:
            sched = self.scheduler.schedule()
            self.stats["preemptions"] += len(sched.preempted)
            if sched.is_empty:
                return []
            result = self.runner.execute(sched.scheduled)
            sample = self.sampler.launch(result.sample_logits, result.sample_seqs) if result.sample_seqs else None
            step = _Step(sched.scheduled, result, sample, result.path)
        if self.config.async_scheduling:
            self._inflight = self._launch_next(step)
        outputs = self._process(step)
        self._record_step(step, time.perf_counter() - t0)
        return outputs

    def _launch_next(self, step: "_Step") -> "_Step | None":
        """Launch the decode step that follows `step`, whose tokens are still on the device, if
        it does not depend on them beyond their values: `step` was a decode step of every
        running sequence, nothing waits for admission, and every sequence continuing needs no penalties, no logprobs and no
        min_tokens masking (they read the host's token lists), and gets its KV block now. A
        sequence that reaches its length limit with `step` is left out; one that stops on a
        token of `step` (EOS, a stop string) is discovered afterwards and its extra token is
        dropped. Returns the launched step, or None."""
        if (step.path not in ("decode_graph", "eager") or step.sample is None or self.scheduler.waiting
                or any(s.num_new_tokens != 1 or s.seq.num_computed_tokens + 1 != s.seq.num_tokens
                       for s in step.scheduled)):
            return None
        in_step = {id(s.seq) for s in step.scheduled}
        if any(id(seq) not in in_step for seq in self.scheduler.running):
            return None  # a running sequence the scheduler left out (a prefill short of budget) goes next
        rows, seqs = [], []
        for i, s in enumerate(step.scheduled):
            seq, p = s.seq, s.seq.sampling_params
            if seq.is_finished:
                continue
            # the sampler masks min_tokens from the host's count, one behind for the launched step
            if p.has_penalties or p.logprobs is not None or seq.num_output_tokens + 1 <= p.min_tokens:
                return None
            if (seq.num_output_tokens + 1 >= (p.max_tokens or self.max_model_len)
                    or seq.num_tokens + 1 >= self.max_model_len):
                continue  # finishes on step's token
            rows.append(i)
            seqs.append(seq)
        if not seqs or not all(self.scheduler.reserve_tokens(seq, seq.num_tokens + 1) for seq in seqs):
            return None
        tokens = step.sample.token_ids
        result = self.runner.execute_chained_decode(seqs, tokens, None if len(rows) == len(step.scheduled) else rows)
        sample = self.sampler.launch(result.sample_logits, result.sample_seqs)
        return _Step([ScheduledSequence(seq, 1) for seq in seqs], result, sample, result.path)

    def _process(self, step: "_Step") -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them: computed counts, prompt logprobs,
        new tokens, text and stop conditions. Sequences that finished (or were aborted) after
        the step was launched are skipped: what the step computed for them is dropped."""
        result = step.result
        sampled = step.sample.result() if step.sample is not None else None
        live = [s for s in step.scheduled if not s.seq.is_finished]  # an aborted one is finished too
        step.fed_tokens = sum(s.num_new_tokens for s in live)
        touched: dict[str, _Request] = {}
        for s in live:
            s.seq.num_computed_tokens += s.num_new_tokens
            req, _ = self._seq_owner[s.seq.request_id]
            touched[req.request_id] = req
            if s.seq.request_id in result.prompt_logits:
                self._store_prompt_logprobs(s.seq, *result.prompt_logits[s.seq.request_id])
            elif s.seq.sampling_params.prompt_logprobs is not None and s.seq.prompt_logprobs is None:
                s.seq.prompt_logprobs = [None] * s.seq.num_prompt_tokens  # a one-token prompt: [None]
        # prompt tokens computed for the first time (a recompute after preemption is not counted)
        self.stats["prompt_tokens"] += sum(
            max(0, min(s.seq.num_computed_tokens, s.seq.num_prompt_tokens) - (s.seq.num_computed_tokens - s.num_new_tokens))
            for s in live if s.seq.num_preemptions == 0)
        self.stats["steps"] += 1
        if sampled is not None:
            now = time.time()
            for seq, token, lps in zip(result.sample_seqs, sampled.token_ids, sampled.logprobs):
                if seq.is_finished:  # before the step was processed: its token is dropped
                    continue
                req, idx = self._seq_owner[seq.request_id]
                if req.first_token_time is None:
                    req.first_token_time = now
                seq.append_token(token, lps)
                self.stats["generation_tokens"] += 1
                self._update_text_and_stop(req, idx, seq, token)
        # building an output copies every token list: skip it for requests that only want the end
        return [self._output(req) for req in touched.values()
                if not req.final_only or all(seq.is_finished for seq in req.seqs)]

    def _record_step(self, step: "_Step", seconds: float) -> None:
        scheduled = step.scheduled
        # after _process: a decode's computed tokens now pass its prompt; a prefill's may too
        decodes = sum(1 for s in scheduled if s.seq.num_computed_tokens - s.num_new_tokens >= s.seq.num_prompt_tokens)
        kind = "decode" if decodes == len(scheduled) else "prefill" if decodes == 0 else "mixed"
        entry = self.step_breakdown.setdefault(f"{step.path}/{kind}", [0, 0.0, 0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += step.fed_tokens
        entry[3] = max(entry[3], seconds)

    def _store_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        n = seq.num_prompt_tokens
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * n
        nxt = seq.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        for j, d in enumerate(prompt_logprobs(logits, nxt, seq.sampling_params.prompt_logprobs)):
            if self.tokenizer is not None:
                for tok, lp in d.items():
                    lp.decoded_token = self.tokenizer.decode([tok])
            seq.prompt_logprobs[start + 1 + j] = d

    def _update_text_and_stop(self, req: _Request, idx: int, seq: Sequence, token: int) -> None:
        p = seq.sampling_params
        state = req.decode[idx]
        status = None
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids or (not p.ignore_eos and token in self.extra_eos_token_ids):
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        # A stop token's own text is left out of the output, as in vLLM, unless asked for.
        prev_len = len(state.text)
        if self.detokenizer is not None and (status is None or p.include_stop_str_in_output):
            self.detokenizer.step(state, seq.output_token_ids, p.skip_special_tokens)
        if self.detokenizer is not None and seq.output_logprobs and seq.output_logprobs[-1]:
            for tok, lp in seq.output_logprobs[-1].items():
                lp.decoded_token = self.tokenizer.decode([tok])
        # As in vLLM, stop strings count only after min_tokens, and only in text new in this
        # step (plus the overlap a stop string can straddle): one token may add any amount of
        # text, and text from the first min_tokens tokens never stops the request later.
        if status is None and p.stop and self.detokenizer is not None and seq.num_output_tokens > p.min_tokens:
            cut = self._find_stop(state.text, p, prev_len + 1)
            if cut is not None:
                stop, pos = cut
                state.text = state.text[: pos + (len(stop) if p.include_stop_str_in_output else 0)]
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is None and (seq.num_output_tokens >= (p.max_tokens or self.max_model_len)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(seq, status)
            seq.finish_reason = "stop" if status == SequenceStatus.FINISHED_STOPPED else "length"

    @staticmethod
    def _find_stop(text: str, p: SamplingParams, search_from: int):
        """(stop string, index) of the earliest stop string that ends at or after
        text[search_from - 1], or None."""
        best = None
        for stop in p.stop:
            i = text.find(stop, max(0, search_from - len(stop)))
            if i >= 0 and (best is None or i < best[1]):
                best = (stop, i)
        return best

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for i, seq in enumerate(req.seqs):
            lps = seq.output_logprobs if seq.sampling_params.logprobs is not None else None
            cum = None
            if lps is not None:
                cum = float(sum(d[t].logprob for d, t in zip(lps, seq.output_token_ids) if d and t in d))
            outs.append(CompletionOutput(
                index=i, text=req.decode[i].text, token_ids=list(seq.output_token_ids), cumulative_logprob=cum,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = all(s.is_finished for s in req.seqs)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time}
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.seqs[0].prompt_logprobs, outs,
                            finished, metrics)
        if finished:
            self.requests.pop(req.request_id, None)
            for seq in req.seqs:
                self._seq_owner.pop(seq.request_id, None)
        return out
