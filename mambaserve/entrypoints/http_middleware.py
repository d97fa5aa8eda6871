"""The HTTP layer beneath the routes: OpenAI-style JSON errors, the guard every request passes
before routing (API key, body size and arrival time), server-sent events that stop when the
client leaves, and the message of a request that fails validation.

Knows ApiError and the HTTP limits; nothing of the engine or of the OpenAI formats.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from mambaserve.entrypoints.serving_common import ApiError

logger = logging.getLogger("mambaserve.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT = 60.0
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
ADMIN_PATHS = ("/reset_prefix_cache",)  # behind --api-key like /v1, though outside it (vLLM's paths)


def json_response(status: int, body: str, headers: dict | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(err: ApiError, close: bool = False) -> Response:
    """The JSON response of an ApiError; close: ask to close the connection (its request is
    unfinished on the wire)."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if close:
        headers["Connection"] = "close"
    return json_response(err.status, err.body().model_dump_json(), headers or None)


def check_api_key(key: str | None) -> None:
    """Raise ValueError unless `key` (None: no key) can be sent in an HTTP header: printable ASCII,
    no spaces. Header values are bytes that clients encode as they like (most as latin-1 or
    UTF-8); a key outside ASCII could match in one client and never in another."""
    if key is None:
        return
    if not key or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("--api-key (or $MAMBASERVE_API_KEY) must be printable ASCII without spaces, as an HTTP "
                         "header carries it; got " + ("an empty key" if not key else "a key with other characters"))


def _route_path(scope) -> str:
    """The path the routes see: uvicorn puts --root-path in front of it (ASGI's root_path), and
    a key check on the prefixed path would let /ROOT/v1/... through."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class RequestGuard:
    """ASGI middleware run before routing and body parsing: the API key of /v1 paths (and of
    /tokenize, /detokenize when `protect_tokenizer`; 401), then the request body: its size (413)
    and its arrival within `body_timeout` seconds (408); it is read here and replayed."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, protect_tokenizer: bool = False,
                 body_timeout: float = DEFAULT_BODY_READ_TIMEOUT):
        check_api_key(api_key)
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key = api_key.encode("ascii") if api_key else None
        self.protect_tokenizer, self.body_timeout = protect_tokenizer, body_timeout

    def _needs_key(self, path: str) -> bool:
        return path.startswith("/v1") or path in ADMIN_PATHS or (self.protect_tokenizer and path in TOKENIZER_PATHS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and self._needs_key(_route_path(scope)):
            # compared as the bytes that came (the key is ASCII: see check_api_key)
            auth = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                err = ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY').",
                               code="invalid_api_key")
                return await error_response(err)(scope, receive, send)
        length = headers.get("content-length")  # h11 refuses a non-numeric one before the app (http_protocol)
        if length is not None:
            if not length.isdigit():
                return await error_response(ApiError(400, "invalid Content-Length"))(scope, receive, send)
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                err = ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                               code="body_timeout")
                return await error_response(err, close=True)(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return None  # the client left before sending its body
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        err = ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                       code="request_too_large")
        return await error_response(err)(scope, receive, send)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects (whatever ASGI version
    the server speaks): `on_close` runs then, or when the stream ends, and aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._on_close()
            for task in (sending, watching):
                task.cancel()
            await asyncio.gather(sending, watching, return_exceptions=True)
            await self.body_iterator.aclose()
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            exc = sending.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                logger.error("stream failed", exc_info=exc)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable, on_disconnect: Callable[[], None]) -> Response:
    """Await `work` (a pydantic model) unless the client disconnects first; then call
    `on_disconnect` (which aborts the request) and answer nobody."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    done = False
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        done = task.done()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            on_disconnect()
    if not done:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return json_response(200, task.result().model_dump_json())


_TYPE_TAGS = {"str", "int", "float", "bool"}


def _is_union_tag(x) -> bool:
    """Whether an error location's element names the member of a union that pydantic tried
    (`str`, `list[str]`, `literal['none','auto']`, `NamedToolChoice`), not a field: request
    fields are snake_case and are never a bare type name."""
    return isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or x[:1].isupper())


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request that failed validation: param is the field's path, as
    OpenAI names it ("prompt", "messages.0.content"), without pydantic's union-member tags."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    named = getattr(first.get("ctx", {}).get("error"), "param", None)  # a field a model validator refused
    param = ".".join(loc + ([named] if named else [])) or None
    msgs = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msgs.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(msgs), param
