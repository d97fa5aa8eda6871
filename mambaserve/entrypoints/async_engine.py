"""The engine behind the server: one background thread owns the `LLMEngine` and is the only
code that calls it; asyncio handlers talk to it through a thread-safe command queue and get
outputs back through per-request asyncio queues.

    handler --submit--> command queue --> loop thread: add_request / abort_request / step()
    handler <--(index, RequestOutput)-- RequestStream queue <--call_soon_threadsafe--

One HTTP request may carry several prompts: they become one engine request each, admitted
together (all or none) and streamed through one `RequestStream`. Each output is cumulative (a
choice's whole text, tokens and logprobs so far), so a stream keeps only the newest unread one
per prompt: a client that reads slowly gets fewer, larger deltas, and what waits for it is
bounded by its output. One that falls more than `max_backlog_tokens` generated tokens behind
is dropped (its requests aborted, an error in its stream). Engine errors never end the
loop: a rejected request gets its error (400 for bad input, 503 for a full queue), and a step
that raises fails the requests in flight, which are aborted so that their slots and blocks are
freed, and the loop goes on. The loop knows nothing about HTTP or OpenAI formats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

from mambaserve.engine.llm_engine import LLMEngine, QueueFullError
from mambaserve.entrypoints.metrics import ServerMetrics
from mambaserve.outputs import RequestOutput
from mambaserve.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve.server")

# Generated tokens a reader may leave unread before its stream is dropped: far more than a reading
# client ever has waiting (about n per step), far less than a big n x max_tokens request makes.
DEFAULT_MAX_BACKLOG_TOKENS = 16384


class EngineError(Exception):
    """A request the engine rejected or could not finish. `status` is the HTTP status to
    answer with: 400 invalid input, 503 queue full or shutting down, 500 engine failure."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class EngineInput:
    """One prompt of a submission: its token ids, sampling parameters and cache salt (None: none)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class RequestStream:
    """The outputs of one submission as an async iterator of (prompt index, RequestOutput)
    pairs, the newest of each prompt since the last read (outputs are cumulative: nothing is
    lost); it ends when every prompt's request has finished and raises `EngineError` if the
    engine fails them or the reader falls more than `max_backlog_tokens` generated tokens behind
    (then the requests are aborted). `abort()` (idempotent, from the event loop) aborts whatever
    has not finished."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], max_backlog_tokens: int | None = None):
        self._engine = engine
        self.request_ids = request_ids
        self.max_backlog_tokens = max_backlog_tokens
        self._ack: asyncio.Future = asyncio.get_running_loop().create_future()
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> newest unread output
        self._read_tokens: dict[int, int] = {}  # prompt index -> generated tokens in the last output read
        self._error: EngineError | None = None
        self._wakeup = asyncio.Event()
        self._unfinished = set(range(len(request_ids)))
        self._closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def backlog_tokens(self) -> int:
        """Generated tokens waiting for the reader (in the unread outputs, beyond what it read)."""
        return sum(_num_tokens(out) - self._read_tokens.get(i, 0) for i, out in self._latest.items())

    def _put(self, item) -> None:  # runs on the event loop
        if not self._ack.done():  # the engine's answer to the submission comes first
            self._ack.set_result(item)
            return
        if isinstance(item, EngineError):
            self._error = item
            self._latest.clear()
        elif self._error is None and not self._closed:
            index, out = item
            self._latest[index] = out  # replaces an unread older one of the same prompt
            limit = self.max_backlog_tokens
            if limit is not None and not out.finished and self.backlog_tokens > limit:
                backlog = self.backlog_tokens
                self.abort()
                self._closed = False  # the reader still gets the error
                self._error = EngineError(f"the client read its stream too slowly: {backlog} generated tokens "
                                          f"were waiting for it (limit {limit}); the request was aborted", 429)
                self._latest.clear()
        self._wakeup.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while True:
            if self._error is not None and not self._closed:
                self._closed = True
                raise self._error
            if self._closed:
                raise StopAsyncIteration
            if self._latest:
                index = next(iter(self._latest))
                out = self._latest.pop(index)
                self._read_tokens[index] = _num_tokens(out)
                if out.finished:
                    self._unfinished.discard(index)
                return index, out
            if not self._unfinished:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    def abort(self) -> None:
        """Abort the prompts' requests that have not finished (frees their slots and blocks)."""
        if self._unfinished and not self._closed:
            self._closed = True
            self._engine._command(("abort", self))
        self._wakeup.set()


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


class AsyncEngine:
    """Runs an `LLMEngine` in one background thread for asyncio code.

    Constant facts about the engine (max_model_len, vocab size, model path) are copied here
    at construction so that handlers need not touch the engine itself. max_backlog_tokens: the
    most generated tokens a stream's reader may fall behind before it is dropped (None: no
    limit). `start(loop)` starts the thread; `submit` admits prompts; `abort_all` ends every
    request in flight with an error; `stop` aborts and joins the thread.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_backlog_tokens: int | None = DEFAULT_MAX_BACKLOG_TOKENS):
        self.engine = engine
        self.metrics = metrics
        self.max_backlog_tokens = max_backlog_tokens
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.model_path = engine.config.model
        self.prefix_caching = engine.config.enable_prefix_caching  # usage reports cached_tokens then
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._lock = threading.Lock()
        # loop thread only: engine request id -> (stream, prompt index, per-request timing)
        self._live: dict[str, tuple[RequestStream, int, _Timing]] = {}

    # ------------------------------------------------------------------ event-loop side
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the loop thread; outputs are delivered on `loop` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="mambaserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and accepting requests."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    async def submit(self, base_id: str, inputs: list[EngineInput], arrival_time: float | None = None) -> RequestStream:
        """Admit one engine request per input (all or none) and return their stream.

        Raises EngineError: 400 for input the engine rejects, 503 when its queue is full or
        the server is shutting down. If the caller is cancelled while waiting, the requests
        are aborted."""
        ids = [base_id if len(inputs) == 1 else f"{base_id}-{i}" for i in range(len(inputs))]
        stream = RequestStream(self, ids, self.max_backlog_tokens)
        with self._lock:  # no "add" may follow the "stop" in the queue: it would wait forever
            if not self.is_running:
                raise EngineError("the server is shutting down", 503)
            self._command(("add", stream, inputs, time.time() if arrival_time is None else arrival_time))
        try:
            ack = await asyncio.shield(stream._ack)
        except asyncio.CancelledError:
            stream.abort()
            raise
        if isinstance(ack, EngineError):
            stream._closed = True
            raise ack
        return stream

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` run on the loop thread: False while requests run. Raises
        EngineError(503) when the loop is not running."""
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            if not self.is_running:
                raise EngineError("the server is shutting down", 503)
            self._command(("reset_prefix_cache", done))
        return await done

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Stop accepting requests and end every request in flight with an EngineError(503)."""
        with self._lock:
            self._accepting = False
            self._command(("abort_all", reason))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the loop thread and wait for it (idempotent)."""
        with self._lock:
            self._accepting = False
            if self._thread is None:
                return
            self._command(("stop", "the server is shutting down"))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.0f s", timeout)

    def _command(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    # ------------------------------------------------------------------ loop thread
    def _deliver(self, stream: RequestStream, item) -> None:
        try:
            self._loop.call_soon_threadsafe(stream._put, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        engine = self.engine
        if self.metrics is not None:
            self.metrics.update_engine(engine.usage())
        stopping = False
        while not stopping:
            try:
                # Block for a command only when there is nothing to step.
                cmds = [self._commands.get()] if not engine.has_unfinished_requests() else []
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd[0] == "stop":
                        stopping = True
                        self._fail_all(EngineError(cmd[1], 503))
                    else:
                        self._handle(cmd)
                if engine.has_unfinished_requests() and not stopping:
                    self._step()
                if self.metrics is not None:
                    self.metrics.update_engine(engine.usage())
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("engine loop error; failing the requests in flight")
                self._fail_all(EngineError("internal engine error", 500))

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, inputs, arrival = cmd
            self._add(stream, inputs, arrival)
        elif kind == "abort":
            for rid in cmd[1].request_ids:
                if self._live.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
                    if self.metrics is not None:
                        self.metrics.aborted.inc()
        elif kind == "abort_all":
            self._fail_all(EngineError(cmd[1], 503))
        elif kind == "reset_prefix_cache":
            self._reply(cmd[1], self.engine.reset_prefix_cache())

    def _reply(self, future: asyncio.Future, value) -> None:
        def put():
            if not future.done():  # its awaiter may have been cancelled
                future.set_result(value)
        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:  # the event loop is closed
            pass

    def _add(self, stream: RequestStream, inputs: list[EngineInput], arrival: float) -> None:
        if not self._accepting:
            self._deliver(stream, EngineError("the server is shutting down", 503))
            return
        limit = self.engine.config.max_queue_len
        total = sum(inp.params.n for inp in inputs)
        if limit is not None and len(inputs) > 1 and total > limit:  # could never be queued
            self._deliver(stream, EngineError(f"{len(inputs)} prompts x n = {total} sequences exceed max_queue_len="
                                              f"{limit} waiting sequences", 400))
            return
        added = []
        try:
            for rid, inp in zip(stream.request_ids, inputs):
                prompt = {"prompt_token_ids": inp.prompt_token_ids}
                if inp.cache_salt is not None:
                    prompt["cache_salt"] = inp.cache_salt
                self.engine.add_request(rid, prompt, inp.params, arrival)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - every rejection goes back to its request
            for rid in added:
                self.engine.abort_request(rid)
            if isinstance(e, ValueError):
                err = EngineError(str(e), 400)
            elif isinstance(e, QueueFullError):
                err = EngineError(f"{e}; retry later", 503)
            else:
                logger.exception("add_request failed")
                err = EngineError("internal engine error", 500)
            self._deliver(stream, err)
            return
        for i, rid in enumerate(added):
            self._live[rid] = (stream, i, _Timing(arrival))
        self._deliver(stream, True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001
            # The failing request is unknown: fail (and so free) everything in flight.
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_all(EngineError("internal engine error", 500))
            return
        now = time.time()
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            stream, index, timing = entry
            self._observe(timing, out, now)
            if out.finished:
                del self._live[out.request_id]
            self._deliver(stream, (index, _snapshot(out)))

    def _observe(self, timing: _Timing, out: RequestOutput, now: float) -> None:
        """Latency and size metrics of an output. Each of a request's n completions counts as one
        request, as vLLM counts them (its own first token, finish reason, end-to-end latency and
        sizes), so that request_success_total adds up with the histograms' counts."""
        if self.metrics is None:
            return
        num = sum(len(c.token_ids) for c in out.outputs)
        if num > timing.num_tokens:
            if timing.num_tokens:
                per_seq = max(1, (num - timing.num_tokens) // max(1, len(out.outputs)))
                self.metrics.observe_token_gap(now - timing.last, per_seq)
            timing.num_tokens, timing.last = num, now
        for c in out.outputs:
            if c.token_ids and c.index not in timing.started:
                timing.started.add(c.index)
                self.metrics.observe_first_token(now - timing.arrival)
            if c.finish_reason is not None and c.index not in timing.finished:
                timing.finished.add(c.index)
                self.metrics.observe_finished(now - timing.arrival, c.finish_reason, len(out.prompt_token_ids),
                                              len(c.token_ids))

    def _fail_all(self, err: EngineError) -> None:
        """Abort every request in flight and send `err` to its stream (once per stream)."""
        told = set()
        for rid, (stream, _, _) in list(self._live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request(%r) failed", rid)
            if self.metrics is not None:
                self.metrics.aborted.inc()
            if id(stream) not in told:
                told.add(id(stream))
                self._deliver(stream, err)
        self._live.clear()


@dataclass
class _Timing:
    arrival: float
    last: float = 0.0
    num_tokens: int = 0
    started: set[int] = dataclasses.field(default_factory=set)  # completions with a first token
    finished: set[int] = dataclasses.field(default_factory=set)  # completions counted as finished


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the event loop may read while the engine goes on appending to its lists."""
    outputs = [dataclasses.replace(c, logprobs=list(c.logprobs) if c.logprobs is not None else None)
               for c in out.outputs]
    prompt_lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    return dataclasses.replace(out, outputs=outputs, prompt_logprobs=prompt_lps)
