"""`mambaserve serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), and vLLM's POST /tokenize, POST /detokenize, GET /version.
Streaming is server-sent events ending with `data: [DONE]`.

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
import socket

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mambaserve import __version__
from mambaserve.engine.arg_utils import engine_config_from_args
from mambaserve.engine.gc_heap import gc_heap_frozen
from mambaserve.entrypoints.async_engine import AsyncEngine, EngineError
from mambaserve.entrypoints.constraints import parse_config
from mambaserve.entrypoints.http_middleware import (
    DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    EventStreamResponse,
    RequestGuard,
    check_api_key,
    error_response,
    json_response,
    unless_disconnected,
    validation_message,
)
from mambaserve.entrypoints.http_protocol import JsonErrorH11Protocol
from mambaserve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from mambaserve.entrypoints.openai_serving import ApiError, OpenAIServing
from mambaserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from mambaserve.entrypoints.protocol_responses import ModelCard, ModelList
from mambaserve.entrypoints.serve_args import add_serve_args, read_chat_template, served_model_names

logger = logging.getLogger("mambaserve.server")

MAX_HEADER_BYTES = 16 * 1024  # h11's own default, set explicitly: an over-size header block is a 431


# ---------------------------------------------------------------------------- the app
def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, protect_tokenizer: bool = False,
              body_timeout: float = DEFAULT_BODY_READ_TIMEOUT, cors: dict | None = None,
              **serving_options) -> FastAPI:
    """The FastAPI app over `engine`. Its lifespan starts the engine thread and stops it.
    served_model_name: a name or several (any is accepted; /v1/models lists all). cors:
    CORSMiddleware's options (allow_origins, ...; None: no CORS); it runs before the API-key
    guard, so that a browser's preflight (which carries no key) gets its answer.
    serving_options: `OpenAIServing`'s (tool calling, structured-output defaults, response
    role, request logging). Raises ValueError for an API key that an HTTP header cannot carry
    (`check_api_key`)."""
    serving = OpenAIServing(engine, served_model_name, **serving_options)
    names = serving.model_names
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
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes,
                       protect_tokenizer=protect_tokenizer, body_timeout=body_timeout)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)  # added last: the outermost, before the guard
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
        cards = [ModelCard(id=n, root=engine.model_path, max_model_len=engine.max_model_len) for n in names]
        return json_response(200, ModelList(data=cards).model_dump_json())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """One model card, as OpenAI's retrieve-model; 404 for another name."""
        if model_id not in names:
            return error_response(ApiError(404, f"The model `{model_id}` does not exist.", type="not_found_error",
                                           param="model", code="model_not_found"))
        card = ModelCard(id=model_id, root=engine.model_path, max_model_len=engine.max_model_len)
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: forget the cached prompt prefixes. 200 once done; 409 while requests run (the
        cache is then left as it is: retry when idle); 503 when the engine loop is not running."""
        try:
            done = await engine.reset_prefix_cache()
        except EngineError as e:
            return error_response(ApiError(e.status, str(e)))
        if not done:
            return error_response(ApiError(409, "the prefix cache cannot be reset while requests are running",
                                           code="requests_running"))
        return json_response(200, "{}")

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
    add_serve_args(p)
    p.set_defaults(func=run)


def build_server(args: argparse.Namespace) -> Server:
    """Load the engine from parsed `serve` arguments and return the (not yet running) server."""
    from mambaserve.engine.input_processor import generation_config_folder, generation_sampling_defaults
    from mambaserve.engine.llm_engine import LLMEngine

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    for flag in ("body_read_timeout", "header_timeout", "timeout_keep_alive"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.max_stream_backlog_tokens < 1:
        raise ValueError(f"--max-stream-backlog-tokens must be >= 1, got {args.max_stream_backlog_tokens}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    check_api_key(args.api_key)  # before the model loads: a bad key fails at once
    names = served_model_names(args)
    structured_config = parse_config(args.structured_outputs_config)
    chat_template = read_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    engine = LLMEngine(engine_config_from_args(args, max_queue_len=args.max_queue_len))
    if chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer (not --skip-tokenizer-init)")
        engine.tokenizer.chat_template = chat_template  # the serving's copies are taken from it
    defaults = generation_sampling_defaults(generation_config_folder(engine.config))
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json (as vLLM; "
                    "--generation-config vllm for none): %s", defaults)
    async_engine = AsyncEngine(engine, ServerMetrics(names[0]), max_backlog_tokens=args.max_stream_backlog_tokens)
    app = build_app(async_engine, names, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    protect_tokenizer=args.tokenize_requires_api_key, body_timeout=args.body_read_timeout,
                    cors=dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                              allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials),
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    structured_outputs_config=structured_config, response_role=args.response_role,
                    log_requests=args.enable_log_requests, default_sampling=defaults)
    where = dict(uds=args.uds) if args.uds else dict(host=args.host, port=args.port)
    config = uvicorn.Config(app, **where, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs, timeout_graceful_shutdown=30, http=JsonErrorH11Protocol,
                            ws="none", timeout_keep_alive=args.timeout_keep_alive,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    config.header_timeout = args.header_timeout  # read by JsonErrorH11Protocol
    return Server(config, async_engine)


def run(args: argparse.Namespace) -> int:
    """`mambaserve serve`: serve until SIGINT/SIGTERM."""
    server = build_server(args)
    if not args.uds and args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach this port can use it", args.host)
    with gc_heap_frozen():  # no full collection walks the engine's start-up objects mid-step
        server.run()
    return 0


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0: a free one), for `Server.run(sockets=[...])` in tests."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
