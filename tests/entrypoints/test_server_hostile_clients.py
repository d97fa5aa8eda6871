"""The server against clients that misbehave: floods of tokenizer calls, streams nobody reads,
queue bursts, wrong JSON types, broken or trickled HTTP, odd API keys, and signals.

Servers run as `tests/entrypoints/test_server.py` starts them (a background thread over the tiny
tokenized checkpoint), except the signal tests, which start `mambaserve serve` processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from mambaserve import SamplingParams  # noqa: E402
from mambaserve.config import EngineConfig  # noqa: E402
from mambaserve.engine.llm_engine import LLMEngine, QueueFullError  # noqa: E402
from mambaserve.entrypoints.async_engine import AsyncEngine, EngineError, EngineInput  # noqa: E402
from tests.entrypoints.servers import AUTH, KEY, running_server, wait_idle  # noqa: E402
from tests.tokenized import tokenized_checkpoint  # noqa: E402


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.fixture(scope="module")
def served():
    with running_server("--api-key", KEY, "--header-timeout", "1", "--body-read-timeout", "1") as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


# ---------------------------------------------------------------------------- 6: tokenizing
def test_tokenize_flood_does_not_delay_generation(served, monkeypatch):
    """Two big /tokenize calls (no key needed) and a big completion prompt, each 3 s of
    tokenizing, used to queue in one thread before a 2-token completion: it waited 9 s."""
    url, server = served
    serving = server.config.app.state.serving
    encode = type(serving.tokenizer).__call__

    def slow_for_big(self, text, *args, **kwargs):  # 3 s for a big text; the real one releases the GIL too
        if isinstance(text, str) and len(text) > 50_000:
            time.sleep(3.0)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(type(serving.tokenizer), "__call__", slow_for_big)
    big = "word " * 14_000  # 70 KB
    slow = [threading.Thread(target=httpx.post, args=(f"{url}/tokenize",),
                             kwargs=dict(json={"prompt": big}, timeout=30)) for _ in range(2)]
    slow.append(threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                 kwargs=dict(json={"prompt": big, "max_tokens": 2}, headers=AUTH, timeout=30)))
    for t in slow:
        t.start()
    time.sleep(0.3)  # all three are tokenizing
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=AUTH, timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 200, r.text
    assert took < 2.0, f"a small completion waited {took:.1f} s behind big tokenizing calls"
    for t in slow:
        t.join(30)


def test_tokenizer_endpoints_behind_the_key_with_the_flag():
    with running_server("--api-key", KEY, "--tokenize-requires-api-key") as (url, _):
        for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5, 6]})):
            assert _error(httpx.post(url + path, json=body, timeout=10), 401)["code"] == "invalid_api_key"
            assert httpx.post(url + path, json=body, headers=AUTH, timeout=10).status_code == 200
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # health stays open
    # without the flag they stay open (as in vLLM), the key still guards /v1
    with running_server("--api-key", KEY) as (url, _):
        assert httpx.post(f"{url}/tokenize", json={"prompt": "Hello"}, timeout=10).status_code == 200
        _error(httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, timeout=10), 401)


# ---------------------------------------------------------------------------- 7: unread streams
def _run_async_engine(fn, **kw):
    """fn(async_engine) in an event loop with an AsyncEngine over the tiny tokenized checkpoint."""
    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=tokenized_checkpoint(), dtype="float32", device="cpu",
                                                    num_kv_blocks=256, enforce_eager=True)), **kw)
        engine.start()
        try:
            return await fn(engine)
        finally:
            await asyncio.to_thread(engine.stop)

    return asyncio.run(main())


async def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_an_unread_stream_holds_one_output_per_prompt():
    """Outputs are cumulative: a stream keeps only each prompt's newest unread one (it used to
    queue every step's copy of all choices: 538 MB for one n=32 x 1,200-token request)."""
    async def fn(engine):
        params = SamplingParams(n=4, max_tokens=40, ignore_eos=True, temperature=0)
        stream = await engine.submit("r", [EngineInput([5, 6, 7], params), EngineInput([8, 9], params)])
        await _wait(lambda: not engine._live)  # both prompts finished, nothing read
        assert len(stream._latest) == 2 and stream.backlog_tokens == 2 * 4 * 40
        got = [(i, out) async for i, out in stream]
        assert sorted(i for i, _ in got) == [0, 1] and all(out.finished for _, out in got)
        assert all(len(c.token_ids) == 40 for _, out in got for c in out.outputs)

    _run_async_engine(fn)


def test_a_stream_too_far_behind_is_dropped():
    async def fn(engine):
        params = SamplingParams(n=4, max_tokens=400, ignore_eos=True)
        stream = await engine.submit("r", [EngineInput([5, 6, 7], params)])
        await _wait(lambda: not engine._live)
        with pytest.raises(EngineError) as e:
            async for _ in stream:
                pass
        assert e.value.status == 429 and "too slowly" in str(e.value)
        await _wait(lambda: engine.engine.usage().num_slots_used == 0 and not engine.engine.has_unfinished_requests())
        assert engine.engine.usage().generation_tokens < 4 * 400  # aborted early

    _run_async_engine(fn, max_backlog_tokens=64)


# ---------------------------------------------------------------------------- 8: the queue
def test_max_queue_len_counts_sequences():
    engine = LLMEngine(EngineConfig(model=tokenized_checkpoint(), dtype="float32", device="cpu", num_kv_blocks=256,
                                    max_queue_len=8, enforce_eager=True))
    for i in range(7):
        engine.add_request(str(i), [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):  # 7 waiting + 2 would be 9
        engine.add_request("n2", [5, 6], SamplingParams(n=2, max_tokens=2))
    assert engine.usage().num_waiting == 7 and engine.num_requests == 7  # nothing half-added
    engine.add_request("n1", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="exceed max_queue_len"):  # could never be queued
        engine.add_request("n64", [5, 6], SamplingParams(n=64, max_tokens=2))
    assert engine.usage().num_waiting == 8


def test_max_queue_len_over_http():
    with running_server("--max-queue-len", "8", "--enforce-eager") as (url, _):
        assert _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 9}, timeout=10), 400)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3}, timeout=10)
        assert "9 sequences" in _error(r, 400)["message"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 8
        m = wait_idle(url)
        assert m["mambaserve:state_slots_used"] == 0 and m["vllm:num_requests_waiting"] == 0


# ---------------------------------------------------------------------------- 10: strict types
@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("n", "2"), ("stream", "yes"), ("temperature", "0.5"), ("n", 2.0), ("logprobs", 1.5),
    ("echo", 1), ("top_k", "5"), ("seed", 1.0), ("stop", 3), ("prompt", 5), ("ignore_eos", "true"),
    ("logit_bias", {"5": "1"}), ("stream_options", {"include_usage": 1}),
])
def test_wrong_json_types_are_a_400(base_url, field, value):
    body = {"prompt": "Hello", "max_tokens": 2, field: value}
    if field == "stream_options":
        body["stream"] = True
    r = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=10)
    assert _error(r, 400)["param"].split(".")[0] == field


def test_chat_types_are_strict_and_ints_pass_for_numbers(base_url):
    for bad in ({"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": 1, "content": "hi"}]},
                {"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}):
        _error(httpx.post(f"{base_url}/v1/chat/completions", json={**bad, "max_tokens": 2}, headers=AUTH,
                          timeout=10), 400)
    # integers where numbers go, as JSON and OpenAI have them
    r = httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Hello", "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0,
                         "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- 11: below the app
def _raw(url: str, data: bytes, wait: float = 0.0, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes (after `wait` seconds of nothing, if data is empty: only wait), read until
    the server closes; returns (what came back, seconds until it closed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        start = time.monotonic()
        if data:
            s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - start


def _json_status(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), raw
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
])
def test_http_errors_below_the_app_are_json(base_url, request_bytes, status):
    got, _ = _raw(base_url, request_bytes)
    code, body = _json_status(got)
    assert code == status and body["error"]["message"].startswith("invalid HTTP request")


def test_trickled_headers_idle_bodies_and_silent_connections_time_out(base_url):
    # headers that never end: one byte every 0.3 s used to hold the socket for ever
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        start = time.monotonic()
        for b in b"GET /health HTTP/1.1\r\nX-Slow: 1":
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            time.sleep(0.3)
            if time.monotonic() - start > 3:
                break
        out = s.recv(65536)
    code, body = _json_status(out)
    assert code == 408 and body["error"]["code"] == "header_timeout" and time.monotonic() - start < 3
    # a body announced and never sent
    got, took = _raw(base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    code, body = _json_status(got)
    assert code == 408 and body["error"]["code"] == "body_timeout" and took < 3
    # a connection that sends nothing: closed quietly
    got, took = _raw(base_url, b"")
    assert got == b"" and took < 3
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_keep_alive_and_header_limits_are_set(served):
    config = served[1].config
    assert config.timeout_keep_alive == 10 and config.h11_max_incomplete_event_size == 16 * 1024
    assert config.header_timeout == 1


@pytest.mark.parametrize("flag", ["--timeout-keep-alive", "--header-timeout", "--body-read-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_timeout_that_is_not_positive_is_refused_before_the_model_loads(flag, value):
    from mambaserve.entrypoints.cli import build_parser
    from mambaserve.entrypoints.server import build_server

    args = build_parser().parse_args(["serve", "/no/such/model", flag, value])
    with pytest.raises(ValueError, match=f"^{flag} must be > 0, got"):
        build_server(args)


@pytest.mark.slow
def test_a_connection_the_openai_client_still_pools_is_open(base_url):
    """The openai client reuses a connection idle for up to its keep-alive expiry (5 s): the
    server must not close it first, or a request sent on it as it closes gets no response
    (seen in CI: "Server disconnected without sending a response", the connection's 2nd
    request, with the server's timeout equal to the client's)."""
    expiry = pytest.importorskip("openai._constants").DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    host, port = base_url.removeprefix("http://").split(":")
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    def response(s) -> bytes:  # one whole response: headers, then content-length bytes of body
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536) or b"<closed>"
            assert not got.endswith(b"<closed>"), got
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(body) < length:
            body += s.recv(65536)
        return head

    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(get)
        assert response(s).startswith(b"HTTP/1.1 200")
        time.sleep(expiry + 0.5)  # the client has let go of it by now; the server has not
        s.sendall(get)
        assert response(s).startswith(b"HTTP/1.1 200")


# ---------------------------------------------------------------------------- 12: API keys
def test_non_ascii_api_key_is_refused_at_start_up():
    from mambaserve.entrypoints.server import check_api_key

    for key in ("clé-secrète", "sk key", "", "sk-\u200b"):
        with pytest.raises(ValueError, match="printable ASCII"):
            check_api_key(key)
    check_api_key("sk-abc_DEF.123~+/=")
    r = subprocess.run([sys.executable, "-m", "mambaserve.entrypoints.cli", "serve", tokenized_checkpoint(),
                        "--api-key", "clé"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "printable ASCII" in r.stderr and "Traceback" not in r.stderr


def test_api_key_compared_as_bytes(base_url):
    ok = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200
    for raw in (KEY.encode() + b"\xe9", b"\xc3\xa9", KEY.upper().encode()):
        r = httpx.get(f"{base_url}/v1/models", headers=[(b"Authorization", b"Bearer " + raw)], timeout=10)
        _error(r, 401)


# ---------------------------------------------------------------------------- 9: signals
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_exits_0_without_traceback(sig):
    """SIGINT used to end in a KeyboardInterrupt traceback and status 1 after a clean shutdown
    (uvicorn raises the captured signal again); a stream in flight gets its error and [DONE]."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.entrypoints.cli", "serve", tokenized_checkpoint(),
                             "--dtype", "float32", "--port", str(port), "--enforce-eager",
                             "--uvicorn-log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(sig)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
