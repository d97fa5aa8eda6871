"""`mambaserve serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), and vLLM's POST /tokenize, POST /detokenize, GET /version. Streaming is server-sent events ending with `data: [DONE]`.

Every error is OpenAI's {"error": {"message", "type", "param", "code"}}, also those answered
below the app (`http_protocol`): 400 for invalid parameters, wrong JSON types, malformed JSON or
HTTP, or a prompt over the context length (checked before queueing), 401 for a missing or wrong
API key on /v1 (and /tokenize, /detokenize with --tokenize-requires-api-key) when --api-key is
set, 404 for an unknown model, 408 for headers or a body that do not arrive in time, 413 for a
body over --max-request-body-bytes, 431 for headers over 16 KiB, 503 when the engine queue is
full (--max-queue-len) or the server is shutting down; a streaming client that leaves more than
--max-stream-backlog-tokens generated tokens unread is dropped (its stream's last event is a
429 error). A client that disconnects aborts its request. On SIGINT/SIGTERM the requests in
flight are aborted (streams get an error event), the engine loop stops, and the process exits 0.

Timeouts and limits, with their reasons: a request's headers within 10 s of the connection (or
of the previous response), at most 16 KiB of them (h11's default; real clients send under 2
KiB); its whole body within --body-read-timeout (60 s: a 4 MiB body at 70 KB/s); an idle
keep-alive connection closed after 5 s (uvicorn's default, set explicitly). Without them a
client holding many half-sent requests keeps their sockets and buffers for ever.

This module wires HTTP to `OpenAIServing` (formats) and `AsyncEngine` (the engine thread); it
knows neither sampling nor the engine's internals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mambaserve import __version__
from mambaserve.engine.arg_utils import add_engine_args, engine_config_from_args
from mambaserve.entrypoints.async_engine import DEFAULT_MAX_BACKLOG_TOKENS, AsyncEngine
from mambaserve.entrypoints.constraints import parse_config
from mambaserve.entrypoints.http_middleware import (DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_BODY_BYTES,
                                                    EventStreamResponse, RequestGuard, check_api_key, error_response,
                                                    json_response, unless_disconnected, validation_message)
from mambaserve.entrypoints.http_protocol import DEFAULT_HEADER_TIMEOUT, JsonErrorH11Protocol
from mambaserve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from mambaserve.entrypoints.openai_serving import ApiError, OpenAIServing
from mambaserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from mambaserve.entrypoints.protocol_responses import ModelCard, ModelList
from mambaserve.entrypoints.tool_parsers import PARSERS as TOOL_PARSERS

logger = logging.getLogger("mambaserve.server")

KEEP_ALIVE_TIMEOUT = 5  # seconds an idle keep-alive connection stays open
MAX_HEADER_BYTES = 16 * 1024  # h11's own default, set explicitly: an over-size header block is a 431


# ---------------------------------------------------------------------------- the app
def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, protect_tokenizer: bool = False,
              body_timeout: float = DEFAULT_BODY_READ_TIMEOUT, **serving_options) -> FastAPI:
    """The FastAPI app over `engine`. Its lifespan starts the engine thread and stops it.
    serving_options: `OpenAIServing`'s (tool calling, structured-output defaults). Raises
    ValueError for an API key that an HTTP header cannot carry (`check_api_key`)."""
    serving = OpenAIServing(engine, served_model_name, **serving_options)
    metrics = engine.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)
            serving.close()

    app = FastAPI(title="mambaserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    check_api_key(api_key)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes, protect_tokenizer=protect_tokenizer,
                       body_timeout=body_timeout)
    app.state.serving = serving

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, "internal server error"))

    @app.get("/health")
    async def health():
        """200 while the engine loop runs, 503 otherwise."""
        if not engine.is_running:
            return error_response(ApiError(503, "the engine loop is not running"))
        return json_response(200, "{}")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render() if metrics is not None else b"", media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=served_model_name, root=engine.model_path, max_model_len=engine.max_model_len)
        return json_response(200, ModelList(data=[card]).model_dump_json())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """One model card, as OpenAI's retrieve-model; 404 for another name."""
        if model_id != served_model_name:
            return error_response(ApiError(404, f"The model `{model_id}` does not exist.", type="not_found_error",
                                           param="model", code="model_not_found"))
        card = ModelCard(id=served_model_name, root=engine.model_path, max_model_len=engine.max_model_len)
        return json_response(200, card.model_dump_json())

    @app.get("/version")
    async def version():
        return json_response(200, json.dumps({"version": __version__}))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return json_response(200, (await serving.tokenize(body)).model_dump_json())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return json_response(200, (await serving.detokenize(body)).model_dump_json())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        job = await serving.prepare(body)
        stream = await serving.submit(job)
        if job.stream:
            return EventStreamResponse(serving.completion_events(job, stream), on_close=stream.abort)
        return await unless_disconnected(request, serving.completion_response(job, stream), stream.abort)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        job = await serving.prepare(body)
        stream = await serving.submit(job)
        if job.stream:
            return EventStreamResponse(serving.chat_events(job, stream), on_close=stream.abort)
        return await unless_disconnected(request, serving.chat_response(job, stream), stream.abort)

    return app


class Server(uvicorn.Server):
    """uvicorn's server that, on shutdown (SIGINT/SIGTERM or `should_exit`), first ends the
    requests in flight, then lets uvicorn close the connections, then stops the engine loop.
    A signal that asked for the shutdown is not raised again afterwards (uvicorn does, so that
    SIGINT ends in a KeyboardInterrupt traceback and exit status 1, SIGTERM in death by the
    signal): the process exits 0 after a clean shutdown."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn re-raises the signals it captured once its handlers are restored
                getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets=None):
        self.engine.abort_all()
        try:
            await super().shutdown(sockets)
        finally:
            await asyncio.to_thread(self.engine.stop)


# ---------------------------------------------------------------------------- CLI
def register(sub) -> None:
    """Add the `serve` subcommand to the `mambaserve` CLI."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory (same as --model)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name)")
    g.add_argument("--api-key", default=os.environ.get("MAMBASERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MAMBASERVE_API_KEY)")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="most waiting sequences (n=4 counts 4; prompts x n for a list of prompts): a "
                        "request that would pass it gets 503, one that alone would gets 400 (default: unbounded)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
                   help="seconds a request's whole body may take to arrive (408 after; default %(default)g)")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a request's headers may take to arrive (408 after; default %(default)g)")
    g.add_argument("--max-stream-backlog-tokens", type=int, default=DEFAULT_MAX_BACKLOG_TOKENS,
                   help="generated tokens a streaming client may leave unread before it is dropped and its "
                        "request aborted (default %(default)d)")
    g.add_argument("--tokenize-requires-api-key", action="store_true",
                   help="with --api-key, /tokenize and /detokenize need the key too (default: open, as in vLLM)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": find the calls in replies with --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="the format of the model's tool calls (granite: Granite 4.0's <tool_call> JSON)")
    g.add_argument("--structured-outputs-config", default=None,
                   help='defaults for constrained requests, as JSON: {"disable_any_whitespace": true, '
                        '"disable_additional_properties": true, "backend": "xgrammar"}')
    p.set_defaults(func=run)


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model path's last component."""
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def build_server(args: argparse.Namespace) -> Server:
    """Load the engine from parsed `serve` arguments and return the (not yet running) server."""
    from mambaserve.engine.llm_engine import LLMEngine

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    for flag in ("body_read_timeout", "header_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.max_stream_backlog_tokens < 1:
        raise ValueError(f"--max-stream-backlog-tokens must be >= 1, got {args.max_stream_backlog_tokens}")
    check_api_key(args.api_key)  # before the model loads: a bad key fails at once
    name = served_model_name(args)
    structured_config = parse_config(args.structured_outputs_config)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    engine = LLMEngine(engine_config_from_args(args, max_queue_len=args.max_queue_len))
    async_engine = AsyncEngine(engine, ServerMetrics(name), max_backlog_tokens=args.max_stream_backlog_tokens)
    app = build_app(async_engine, name, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    protect_tokenizer=args.tokenize_requires_api_key, body_timeout=args.body_read_timeout,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    structured_outputs_config=structured_config)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=30, http=JsonErrorH11Protocol, ws="none",
                            timeout_keep_alive=KEEP_ALIVE_TIMEOUT, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    config.header_timeout = args.header_timeout  # read by JsonErrorH11Protocol
    return Server(config, async_engine)


def run(args: argparse.Namespace) -> int:
    """`mambaserve serve`: serve until SIGINT/SIGTERM."""
    server = build_server(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach this port can use it", args.host)
    server.run()
    return 0


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0: a free one), for `Server.run(sockets=[...])` in tests."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
