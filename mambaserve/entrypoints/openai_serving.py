"""OpenAI completions and chat completions over the `AsyncEngine`: from a parsed request to
engine inputs (tokenising, checking lengths and parameters before anything is queued), and
from engine outputs to OpenAI responses or server-sent-event chunks.

Streaming and non-streaming share one rule for text: a completion's text is sent as it grows,
except that while stop strings are set the last `len(longest stop) - 1` characters are held
back (the engine cuts the text at a stop string once it is complete, and a cut must never
remove text already sent). So the streamed deltas always add up to the non-streamed text.

This module knows the HTTP request models but not FastAPI: errors are raised as `ApiError`
and the server turns them into responses.

Structured outputs (response_format, structured_outputs, guided_*) and the constraint of
tool_choice="required" or a named function become one `StructuredOutputsParams`
(`constraints.py`), compiled here, in the tokenizing thread, so a schema that does not compile is
a 400 before anything is queued (the engine's compile is then a cache hit). Tool calls in a reply
are found by `tool_parsers.py`; streamed, they are sent as OpenAI sends them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import re
import threading
import time
import uuid

from mambaserve.chat import render_chat
from mambaserve.entrypoints.async_engine import AsyncEngine, EngineError, EngineInput, RequestStream
from mambaserve.entrypoints.constraints import ConstraintError, structured_outputs_of
from mambaserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SamplingRequest,
    TokenizeRequest,
)
from mambaserve.entrypoints.protocol_responses import DetokenizeResponse, TokenizeResponse
from mambaserve.entrypoints.serving_chat import ChatServing
from mambaserve.entrypoints.serving_common import ApiError, Job
from mambaserve.entrypoints.serving_completions import CompletionServing
from mambaserve.entrypoints.tool_parsers import ToolCallParser
from mambaserve.sampling_params import SamplingParams

__all__ = ["ApiError", "OpenAIServing"]

logger = logging.getLogger("mambaserve.server")

# Sequences (prompts x n) one HTTP request may start.
MAX_SEQUENCES_PER_REQUEST = 1024
# Generation requests with more prompt text than this (characters) are tokenized in a lane of
# their own: at about 1 MB/s of tokenizing, 64 KiB takes tens of milliseconds, 4 MiB seconds.
LARGE_PROMPT_CHARS = 64 * 1024


def _text_size(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters of prompt text a request has to tokenize (token-id prompts count 0)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
                   for m in req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))



def _max_or_none(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _continuous(req: SamplingRequest) -> bool:
    """vLLM's rule: usage in every chunk needs include_usage and continuous_usage_stats."""
    o = req.stream_options
    return bool(o and o.include_usage and o.continuous_usage_stats)


def _constraint_param(req: SamplingRequest) -> str:
    """The field a constraint that does not compile came from (for the error's param)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name, None) is not None:
            return name
    return "tool_choice"



class OpenAIServing(CompletionServing, ChatServing):
    """Completions and chat completions for one served model."""

    def __init__(self, engine: AsyncEngine, served_model_name: str | list[str], *,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 structured_outputs_config: dict | None = None, response_role: str = "assistant",
                 log_requests: bool = False, default_sampling: dict | None = None):
        """served_model_name: the name (or names: any is accepted, the first is the default)
        clients send. response_role: the role of chat replies. log_requests: log each request
        at INFO. default_sampling: {SamplingParams field: value} for fields a request leaves
        unset (the checkpoint's generation_config, as vLLM)."""
        self.engine = engine
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.model_names, self.model_name = names, names[0]
        self.response_role, self.log_requests = response_role, log_requests
        self.default_sampling = dict(default_sampling or {})
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if tool_call_parser is not None:
            ToolCallParser(tool_call_parser)  # ValueError for an unknown one
        self.auto_tool_parser = tool_call_parser if enable_auto_tool_choice else None
        self.structured_defaults = dict(structured_outputs_config or {})
        # thread-safe: constraints are compiled in the tokenizing thread (400 for a bad one)
        self.grammar = engine.engine.grammar_compiler
        tok = engine.engine.tokenizer
        # A private copy for the event loop (logprob labels, echoed prompts); each tokenizing
        # thread below takes its own copy of it, as the engine thread has its own.
        self.tokenizer = copy.deepcopy(tok) if tok is not None else None
        self._local = threading.local()
        # Tokenizing and templating run in threads, not on the event loop: a 4 MB prompt takes
        # seconds, which would stall every stream (the tokenizer releases the GIL). Three lanes,
        # so that no request waits behind another kind: generation requests with small prompts
        # (two threads), those with prompts over LARGE_PROMPT_CHARS (one thread: a burst of big
        # ones queues there), and /tokenize and /detokenize (one thread: a flood of them, which
        # need no API key by default, delays only themselves).
        self._lanes = {name: concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix=f"mambaserve-{name}",
                                                                   initializer=self._init_thread)
                       for name, n in (("prepare", 2), ("prepare-large", 1), ("tokenize", 1))}

    def _init_thread(self) -> None:
        self._local.tokenizer = copy.deepcopy(self.tokenizer)

    def _tok(self):
        """The calling thread's tokenizer (a tokenizing lane's own copy; else the event loop's)."""
        return getattr(self._local, "tokenizer", self.tokenizer)

    async def _in_lane(self, lane: str, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._lanes[lane], fn, *args)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Job:
        """`prepare_completion` or `prepare_chat` of `req`, in a tokenizing thread: the large-prompt
        lane when its text is over LARGE_PROMPT_CHARS characters."""
        fn = self.prepare_chat if isinstance(req, ChatCompletionRequest) else self.prepare_completion
        return await self._in_lane("prepare-large" if _text_size(req) > LARGE_PROMPT_CHARS else "prepare", fn, req)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """POST /tokenize: the token ids a prompt (or chat messages, rendered as /v1/chat/completions
        renders them) would be sent to the model as. Raises ApiError (400, 404)."""
        def work():
            self.check_model(req.model)
            special = req.add_special_tokens
            if req.messages is None:
                ids = self._tokenize(req.prompt, add_special_tokens=special is not False)
            else:
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                text = self._render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                    req.chat_template_kwargs, tools=tools)
                ids = self._tokenize(text, add_special_tokens=bool(special))
            strs = self._tok().convert_ids_to_tokens(ids) if req.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                    token_strs=strs)
        return await self._in_lane("tokenize", work)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize: the text of token ids. Raises ApiError (400 for ids outside the
        vocabulary or no tokenizer, 404)."""
        def work():
            self.check_model(req.model)
            if self._tok() is None:
                raise ApiError(400, "this server has no tokenizer (started with --skip-tokenizer-init)")
            if any(t < 0 or t >= self.engine.vocab_size for t in req.tokens):
                raise ApiError(400, f"token ids must be in [0, {self.engine.vocab_size})", param="tokens")
            return DetokenizeResponse(prompt=self._tok().decode(req.tokens))
        return await self._in_lane("tokenize", work)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ validation
    def check_model(self, name: str | None) -> None:
        """404 unless `name` is the served model's name (None means the served model)."""
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok() is None:
            raise ApiError(400, "this server has no tokenizer (started with --skip-tokenizer-init): "
                                "send token ids", param="prompt")
        return self._tok()(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if any(t < 0 or t >= self.engine.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {self.engine.vocab_size})", param=param)
        asked = len(ids) + (max_tokens or 1)
        if asked > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{asked} tokens ({len(ids)} in the prompt, {max_tokens or 1} in the completion). "
                                "Please reduce the length of the prompt or completion.",
                           param=param, code="context_length_exceeded")

    def _sampling_params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(t): b for t, b in req.logit_bias.items()}
            except ValueError:
                raise ApiError(400, "logit_bias keys must be token ids (integers as strings)",
                               param="logit_bias") from None
        vocab = self.engine.vocab_size  # checked here too, so that the error names its field
        for name, ids in (("logit_bias", logit_bias or ()), ("allowed_token_ids", req.allowed_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise ApiError(400, f"{name} must name token ids in [0, {vocab})", param=name)
        limit = self.engine.engine.input_processor.max_logprobs  # the engine's max_logprobs (vLLM's rule)
        for name, asked in (("top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs", logprobs),
                            ("prompt_logprobs", req.prompt_logprobs)):
            if asked is not None and asked > limit:
                raise ApiError(400, f"{name}={asked} is more than the server's max_logprobs={limit}", param=name)
        d = self.default_sampling

        def pick(name, default):
            value = getattr(req, name)
            return d.get(name, default) if value is None else value

        try:
            return SamplingParams(
                n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0), seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0),
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=logit_bias,
                allowed_token_ids=req.allowed_token_ids, structured_outputs=self._constraint(req),
            )
        except ValueError as e:
            m = re.search(r"SamplingParams\.(\w+)", str(e))
            raise ApiError(400, str(e).replace("SamplingParams.", ""), param=m.group(1) if m else None) from None

    def _constraint(self, req: SamplingRequest):
        """The request's one structured-output constraint (or None), compiled once here so that
        one that does not compile is a 400. Raises ApiError."""
        try:
            params = structured_outputs_of(req, self.structured_defaults)
            if params is not None:
                self.grammar.compile(params)
        except ConstraintError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise ApiError(400, str(e), param=_constraint_param(req)) from None
        return params

    def prepare_completion(self, req: CompletionRequest) -> Job:
        """Validate a completion request and tokenize its prompts. Raises ApiError."""
        arrival = time.time()
        self.check_model(req.model)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of is not supported (only best_of == n)", param="best_of")
        p = req.prompt
        if isinstance(p, str):
            items = [p]
        elif not p:
            raise ApiError(400, "the prompt is empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if len(items) * req.n > MAX_SEQUENCES_PER_REQUEST:
            raise ApiError(400, f"at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n) per request",
                           param="prompt")
        drop = req.max_tokens == 0
        max_tokens = 1 if drop else req.max_tokens
        prompts = []
        for item in items:
            ids = self._tokenize(item, req.add_special_tokens) if isinstance(item, str) else list(item)
            self._check_prompt(ids, max_tokens, "prompt")
            prompts.append((item if isinstance(item, str) else None, ids))
        if max_tokens is None:  # null: generation_config's max_new_tokens as for chat (vLLM's), else up to the context
            max_tokens = self.default_sampling.get("max_tokens")
        echo_top = req.logprobs if req.echo and req.logprobs is not None else None
        params = self._sampling_params(req, max_tokens, req.logprobs, _max_or_none(echo_top, req.prompt_logprobs))
        return Job(f"cmpl-{uuid.uuid4().hex}", int(time.time()), prompts, params, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage), echo=req.echo,
                    drop_output=drop, num_top=req.logprobs, arrival=arrival, prompt_top=req.prompt_logprobs,
                    continuous_usage=_continuous(req), model=req.model or self.model_name, cache_salt=req.cache_salt)

    def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        """Validate a chat request and render its messages with the chat template. Raises ApiError."""
        arrival = time.time()
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.n > MAX_SEQUENCES_PER_REQUEST:
            raise ApiError(400, f"n must be <= {MAX_SEQUENCES_PER_REQUEST}", param="n")
        tools = self._tool_parser(req)
        tool_defs = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = self._render(req.messages, req.add_generation_prompt, req.continue_final_message,
                            req.chat_template_kwargs, tools=tool_defs, documents=req.documents)
        ids = self._tokenize(text, add_special_tokens=req.add_special_tokens)
        max_tokens = req.max_completion_tokens or req.max_tokens
        self._check_prompt(ids, max_tokens, "messages")
        if max_tokens is None and "max_tokens" in self.default_sampling:  # generation_config's max_new_tokens
            max_tokens = min(self.default_sampling["max_tokens"], self.engine.max_model_len - len(ids))
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, num_top, req.prompt_logprobs)
        return Job(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), [(text, ids)], params, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage), num_top=num_top,
                    arrival=arrival, prompt_top=req.prompt_logprobs, continuous_usage=_continuous(req), tools=tools,
                   model=req.model or self.model_name, cache_salt=req.cache_salt)

    def _tool_parser(self, req: ChatCompletionRequest) -> ToolCallParser | None:
        """How the reply's tool calls are found: by the server's parser for tool_choice "auto" (the
        default with tools, as in vLLM), as a list of calls for "required", as the arguments of
        the named function; None for "none" or no tools. Raises ApiError: "auto" needs
        --enable-auto-tool-choice (vLLM's rule)."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if not req.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return ToolCallParser("named", choice.function.name)
        if choice == "required":
            return ToolCallParser("required")
        if self.auto_tool_parser is None:
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set (or send tool_choice "none", "required" or a named function)', param="tool_choice")
        return ToolCallParser(self.auto_tool_parser, max_calls=None if req.parallel_tool_calls else 1)

    def _render(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                chat_template_kwargs: dict | None, tools: list | None = None, documents: list | None = None) -> str:
        """Chat messages (pydantic ChatMessage) to prompt text with the chat template. Raises ApiError."""
        if self._tok() is None:
            raise ApiError(400, "this server has no tokenizer (started with --skip-tokenizer-init)")
        if not getattr(self._tok(), "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
        try:
            return render_chat(self._tok(), [m.model_dump(exclude_none=True) for m in messages],
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs, tools=tools, documents=documents)
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise ApiError(400, str(e), param=param) from None

    async def submit(self, job: Job) -> RequestStream:
        """Queue a job's prompts in the engine. Raises ApiError (400, 503) if it refuses them."""
        if self.log_requests:
            logger.info("request %s: %d prompt(s) of %s tokens, %s", job.request_id, len(job.prompts),
                        "/".join(str(len(ids)) for _, ids in job.prompts), job.params)
        try:
            inputs = [EngineInput(ids, job.params, job.cache_salt) for _, ids in job.prompts]
            return await self.engine.submit(job.request_id, inputs, job.arrival)
        except EngineError as e:
            raise ApiError(e.status, str(e)) from None

