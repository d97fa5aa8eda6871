"""The engine loop: add requests, step, abort. Offline `LLM.generate`, the server and the
benchmarks all drive this one `step()`.

A step reads like a paragraph: schedule, run the model, sample, update the sequences, report
outputs. The jobs around it live beside it: `InputProcessor` turns prompts into validated
sequences, `OutputProcessor` turns sampled tokens into text, stop decisions and outputs,
`ModelRunner` runs the forward, `Scheduler` picks the batch. With async scheduling, a decode
step is launched one call ahead, before the host has read the tokens it continues from (they
feed it on the device; `chaining.plan_chained_decode` decides when it may): the device
computes while the host updates.

What the entrypoints, metrics and benchmarks may read is the read API at the end of the class
(limits, pool sizes, memory, `usage()`); the attributes behind it are the engine's own.

With tensor_parallel_size > 1 this process is rank 0: `TensorParallelExecutor` starts the
other ranks, the runner sends them each step, and everything else here is unchanged (one
scheduler, one set of pools, the sampling on rank 0). `shutdown()` stops the other ranks; it
also runs when the engine is collected or the interpreter exits.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass

import torch

from mambaserve.cache.budget import PoolSizes
from mambaserve.cache.pools import make_cache_pools
from mambaserve.config import EngineConfig
from mambaserve.distributed import SINGLE
from mambaserve.engine.chaining import plan_chained_decode
from mambaserve.engine.input_processor import InputProcessor
from mambaserve.engine.input_processor import QueueFullError as QueueFullError  # re-exported: raised by add_request
from mambaserve.engine.model_runner import ModelRunner, StepLogits
from mambaserve.engine.output_processor import OutputProcessor
from mambaserve.engine.sampler import PendingSample, Sampler
from mambaserve.engine.scheduler import ScheduledSequence, Scheduler
from mambaserve.engine.spec_decode import SpecDecoder
from mambaserve.engine.stat_logger import StatLogger, log_startup_summary
from mambaserve.engine.stats import EngineStats, EngineUsage
from mambaserve.engine.structured_outputs import StructuredOutputs
from mambaserve.outputs import RequestOutput
from mambaserve.sampling_params import SamplingParams


@dataclass
class _Step:
    """A launched step: its batch, its logits (and how the forward ran: result.path), and its
    sampling (maybe still on the device)."""

    scheduled: list[ScheduledSequence]
    result: StepLogits
    sample: PendingSample | None
    fed_tokens: int = 0  # tokens of sequences still live when it was processed (the rest are dropped)


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig):
        self.config = config
        torch.manual_seed(config.seed)
        self._executor = None
        if config.tensor_parallel_size > 1:
            from mambaserve.engine.executor import TensorParallelExecutor

            self._executor = TensorParallelExecutor(config)
            weakref.finalize(self, self._executor.shutdown)
        try:
            self.runner = ModelRunner(config, self._executor.group if self._executor else SINGLE)
            self.input_processor = InputProcessor(config, self.runner.model.config, self.runner.vocab_size,
                                                  self.runner.max_model_len)
        except BaseException:
            if self._executor is not None:
                self._executor.abort()  # the other ranks failed alike, or wait in a step: end them
            raise
        runner = self.runner
        tok, eos, extra_eos = (self.input_processor.tokenizer, self.input_processor.eos_token_ids,
                               self.input_processor.extra_eos_token_ids)
        # grammar matchers of constrained sequences: masks applied here, tokens fed by the output processor
        self.structured_outputs = StructuredOutputs(tok, runner.vocab_size, eos + extra_eos)
        self.output_processor = OutputProcessor(tok, eos, extra_eos, runner.max_model_len, self.structured_outputs)
        pools = make_cache_pools(  # checkpoint rows follow the slots in the state tensors
            num_slots=runner.num_slots, num_blocks=runner.num_blocks if runner.has_attention else None,
            block_size=config.block_size, num_checkpoints=runner.num_checkpoints,
            enable_prefix_caching=config.enable_prefix_caching,
            mamba_block_size=config.cache_config.resolved_mamba_block_size, has_state=bool(runner.spec.mamba))
        self.slot_pool, self.block_pool = pools.slots, pools.blocks
        self.scheduler = Scheduler(
            max_num_seqs=runner.max_num_seqs, max_num_batched_tokens=runner.max_num_batched_tokens,
            slot_pool=self.slot_pool, block_pool=self.block_pool, enable_chunked_prefill=config.enable_chunked_prefill,
            prefix_cache=pools.prefix_cache, min_inner_save_offset=runner.spec.min_inner_save_offset)
        self.sampler = Sampler(eos + extra_eos or None)
        self.stats = EngineStats()
        self.spec = None if config.speculative_config is None else SpecDecoder(
            config, runner, self.sampler, self.structured_outputs.constrains, self.stats.spec_decode)
        self._counter = itertools.count()
        self._inflight: _Step | None = None  # a decode step launched ahead (async scheduling)
        self._stat_logger = None if config.disable_log_stats else StatLogger()
        log_startup_summary(self)

    # ------------------------------------------------------------------ requests
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
        once, when it finishes (offline generation), instead of after every step (streaming).
        Raises ValueError (engine unchanged) for a request id already in use, for what
        `InputProcessor.process` refuses (an empty prompt, token ids outside the vocabulary, a
        prompt that leaves no room within max_model_len, ...) and for n above max_queue_len;
        QueueFullError when the waiting sequences plus this request's n would pass
        max_queue_len (each of the n sequences counts)."""
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.time() if arrival_time is None else arrival_time
        req = self.input_processor.process(request_id, prompt, params, now)
        self.input_processor.check_queue_room(req, self.scheduler.num_waiting)
        self.output_processor.add(req, final_only)
        try:
            for seq in req.seqs:
                self.scheduler.add(seq)
        except Exception:
            self.abort_request(request_id)  # leave no half-added request behind
            raise
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and free its slots and blocks. Returns False for an unknown id. The id
        is taken as add_request takes it (str(request_id)): an int id aborts its request."""
        req = self.output_processor.remove(str(request_id))
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def shutdown(self, timeout: float = 30.0) -> None:
        """End the engine on the other tensor-parallel ranks (nothing at tensor_parallel_size
        1); it cannot step afterwards. Called again, or at exit, it does nothing."""
        if self._executor is not None:
            self._executor.shutdown(timeout)

    @property
    def num_requests(self) -> int:
        """Requests added and not yet reported finished (or aborted)."""
        return len(self.output_processor.requests)

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, as add_request tokenizes it. Raises ValueError without a tokenizer."""
        return self.input_processor.tokenize(prompt)

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
        step = self._take_inflight() or self._schedule_and_run()  # schedule, run, launch the sampling
        if step is None:
            return []
        if self.config.async_scheduling and self.spec is None:  # drafts need the host's tokens: no chaining
            self._inflight = self._launch_next(step)  # the next decode, before this step's tokens are read
        outputs = self._update(step)  # wait for the tokens: update sequences, stop, build outputs
        self.stats.record_step(step.result.path, step.scheduled, step.fed_tokens, time.perf_counter() - t0)
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self.usage)
        return outputs

    def _take_inflight(self) -> _Step | None:
        """The decode step the previous call launched ahead, unless every sequence of it finished or was
        aborted meanwhile (then it is dropped); one launched unsampled (constrained rows) is sampled now."""
        step, self._inflight = self._inflight, None
        if step is None or all(s.seq.is_finished for s in step.scheduled):
            return None
        step.sample = step.sample or self._sample(step.result)
        return step

    def _schedule_and_run(self) -> _Step | None:
        """Schedule a batch, run its forward and launch its sampling (None: nothing to run)."""
        sched = self.scheduler.schedule() if self.spec is None else self.spec.schedule(self.scheduler)  # + drafts
        self.stats.preemptions += len(sched.preempted)
        if sched.is_empty:
            return None
        try:
            result = self.runner.execute(sched.scheduled, self.spec.take_state_loads() if self.spec else ())
        except BaseException:  # the checkpoint rows it was to save are unwritten: no prompt may resume from them
            if self.scheduler.prefix_cache is not None:
                self.scheduler.prefix_cache.checkpoints.discard_pending()
            raise
        return _Step(sched.scheduled, result, self._sample(result))

    def _sample(self, result: StepLogits) -> PendingSample | None:
        """Enqueue the sampling of a forward's logits, constrained rows masked first; None: nothing to sample."""
        if not result.sample_seqs:
            return None
        self.structured_outputs.apply(result.sample_logits, result.sample_seqs)
        return self.sampler.launch(result.sample_logits, result.sample_seqs)

    def _launch_next(self, step: _Step) -> _Step | None:
        """Launch the decode step that follows `step`, whose tokens are still on the device, when
        `plan_chained_decode` allows it. With a constrained sequence among them only the forward
        is launched: its masks need the grammars after `step`'s tokens (filled while `_update`
        processes them; `_take_inflight` samples it). Returns the launched step, or None."""
        plan = None if step.sample is None else plan_chained_decode(step.scheduled, step.result.path, self.scheduler,
                                                                     self.max_model_len)
        if plan is None:
            return None
        rows, seqs = plan
        chained = self.runner.execute_chained_decode(seqs, step.sample.token_ids,
                                                     None if len(rows) == len(step.scheduled) else rows)
        sample = None if self.structured_outputs.constrains(seqs) else self._sample(chained)
        return _Step([ScheduledSequence(seq, 1) for seq in seqs], chained, sample)

    def _update(self, step: _Step) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them: computed counts, prompt logprobs,
        new tokens, text and stop conditions. Sequences that finished (or were aborted) after
        the step was launched are skipped: what the step computed for them is dropped."""
        sampled = step.sample.result() if step.sample is not None else None
        live = [s for s in step.scheduled if not s.seq.is_finished]  # an aborted one is finished too
        step.fed_tokens = sum(s.num_new_tokens for s in live)
        for s in live:  # a verifying sequence's drafts count as each is accepted (OutputProcessor.process)
            s.seq.num_computed_tokens += 1 if s.spec_token_ids else s.num_new_tokens
        self.stats.count_step(live)
        new_tokens = [] if sampled is None else [
            (seq, token, lps) for seq, token, lps in zip(step.result.sample_seqs, sampled.token_ids, sampled.logprobs)
            if not seq.is_finished]  # finished before the step was processed: its token is dropped
        new_tokens += self.spec.verify(step.result) if step.result.verify else []
        ahead = self._inflight.result.sample_seqs if self._inflight and self._inflight.sample is None else None
        # the grammars take the tokens first: the masks of the step in flight fill meanwhile, off this thread
        closed = self.structured_outputs.accept(new_tokens, fill_ahead=ahead)
        finished, touched = self.output_processor.process(live, step.result.prompt_logits, new_tokens, closed)
        self.stats.generation_tokens += self.output_processor.num_appended
        for seq, status in finished:
            self.scheduler.finish(seq, status)
        return self.output_processor.outputs(touched)

    # ------------------------------------------------------------------ the read API
    tokenizer = property(lambda self: self.input_processor.tokenizer,
                         doc="The transformers tokenizer, or None (skip_tokenizer_init).")

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a request silently (the model config's and the tokenizer's)."""
        return list(self.input_processor.eos_token_ids)

    grammar_compiler = property(lambda self: self.structured_outputs.compiler,  # its cache is the engine's
                                doc="The engine's thread-safe GrammarCompiler (structured outputs).")

    vocab_size = property(lambda self: self.runner.vocab_size, doc="The logits' width (int).")

    max_model_len = property(lambda self: self.runner.max_model_len,
                             doc="Longest prompt plus output, in tokens, as resolved against the cache budget.")

    @property
    def pool_sizes(self) -> PoolSizes:
        """State slots (scratch slot included), KV blocks, max_num_seqs, max_num_batched_tokens,
        max_model_len, as `cache.budget.size_pools` resolved them."""
        return self.runner.sizes

    memory = property(lambda self: self.runner.memory,
                      doc="Bytes of the weights, the state slots and the KV blocks (MemoryUsage).")

    device = property(lambda self: self.runner.device, doc="The model's torch.device.")

    dtype = property(lambda self: self.runner.dtype,
                     doc="The model's (and the conv state's and KV cache's) dtype.")

    mamba_ssm_cache_dtype = property(lambda self: self.runner.ssm_dtype, doc="The SSM states' torch.dtype.")

    def usage(self) -> EngineUsage:
        """A snapshot of queue lengths, pool use and counters (cheap: call it every step)."""
        return self.stats.usage(self.scheduler, self.slot_pool, self.block_pool, self.structured_outputs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and state checkpoint (vLLM's); False, forgetting nothing, while any runs."""
        return self.scheduler.reset_prefix_cache()

    def reset_step_breakdown(self) -> None:
        """Forget the per-kind step times (a benchmark times only its measured part)."""
        self.stats.step_breakdown.clear()
