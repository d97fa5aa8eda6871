"""The HTTP/1.1 connection layer under the app: uvicorn's h11 protocol, with OpenAI-style JSON
errors and a deadline for a request's headers.

uvicorn answers some requests before the app sees them: a request that h11 cannot parse (a
non-numeric Content-Length, a bad request line, headers over the size limit) gets uvicorn's
plain-text 400. Here it gets OpenAI's {"error": {...}} with h11's status (400, or 431 for
headers that are too large) and reason. uvicorn also has no deadline for headers: its
keep-alive timer starts only after a response, and any byte received stops it, so a client that
trickles a header byte every few seconds keeps a connection (and its buffers) for ever. Here a
request's headers must be complete within `header_timeout` seconds of its first byte (of the
connection's opening for the first request; a JSON 408 then closes the connection), and a
connection that sends nothing is closed quietly after as long; idle keep-alive connections
are uvicorn's (timeout_keep_alive). The body's deadline is the app's (`server._Guard`), which
reads the body.

Set on the uvicorn Config as `http=JsonErrorH11Protocol`; it reads `config.header_timeout`.
"""

from __future__ import annotations

import asyncio
import json

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0
# uvicorn closes a connection idle this long (seconds) after a response. A client drops idle
# connections after its own expiry (httpx, and so the openai client: 5 s); when the two are equal a
# request sent on a connection the client still trusts can meet the server's close and get no
# response ("Server disconnected"). Longer than the client's, the client always lets go first.
DEFAULT_KEEP_ALIVE_TIMEOUT = 10.0


def error_bytes(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii")
    return head + body


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with JSON protocol errors, a header size limit that holds also when
    the headers arrive in one piece (h11's limit counts only bytes buffered while incomplete),
    and a header deadline (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = float(getattr(self.config, "header_timeout", DEFAULT_HEADER_TIMEOUT))
        self.max_header_bytes = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self._header_timer: asyncio.TimerHandle | None = None
        self._started = False  # bytes of a request whose headers are not complete have come
        self._protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_checked():  # uvicorn drops the exception: its status and reason are needed
            try:
                event = next_event()
                if isinstance(event, h11.Request):
                    self._cancel_header_timer()
                    self._started = False
                    size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
                    if size > self.max_header_bytes:
                        raise h11.RemoteProtocolError(f"the request's headers are over {self.max_header_bytes} bytes",
                                                      error_status_hint=431)
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise
            return event

        self.conn.next_event = next_event_checked

    # ---------------------------------------------------------------- header deadline
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request's headers came: it is being read or answered
        if self._started:  # part of a request came: say why it is closed
            self.transport.write(error_bytes(408, "Request Timeout", f"the request's headers did not arrive within "
                                             f"{self.header_timeout:g} s", "header_timeout"))
        self.transport.close()  # else a connection that never sent a byte: closed quietly

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if data and not self._started and self.conn.their_state is h11.IDLE:
            self._started = True  # the deadline runs from a request's first byte (or the connection's opening)
            if self._header_timer is None:
                self._arm_header_timer()
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # idle keep-alive connections: uvicorn's timer closes them
        if (not self.transport.is_closing() and self.conn.their_state is h11.IDLE
                and self.conn.trailing_data[0] and self._header_timer is None):
            self._started = True  # part of a pipelined request is buffered already
            self._arm_header_timer()

    # ---------------------------------------------------------------- JSON errors
    def send_400_response(self, msg: str) -> None:
        err = self._protocol_error
        status = getattr(err, "error_status_hint", 400) if err is not None else 400
        reason = "Request Header Fields Too Large" if status == 431 else "Bad Request"
        detail = str(err) if err is not None and str(err) else msg
        self.transport.write(error_bytes(status, reason, f"invalid HTTP request: {detail}", "invalid_http_request"))
        self.transport.close()
