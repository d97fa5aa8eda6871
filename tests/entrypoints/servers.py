"""A real server for the entrypoint tests, and helpers to read it.

`running_server` starts `mambaserve serve` (uvicorn in a background thread of the test process,
on a free loopback port) over the tiny tokenized checkpoint of `tests/tokenized.py`; the rest
read its /metrics and its streams. Test modules import this after `pytest.importorskip` of the
server extra, which it needs.
"""

import contextlib
import re
import threading
import time

import httpx

from mambaserve.entrypoints.cli import build_parser
from mambaserve.entrypoints.server import bind_socket, build_server
from tests.tokenized import tokenized_checkpoint

MODEL = "tiny"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_KV_BLOCKS = 512
PROMPTS = ["def add(a, b):", "The quick brown fox", "Hello, world!", "class Stack:", "Simple is better",
           "Numbers: 1 2 3", "Tell me a story", "    return a"]


@contextlib.contextmanager
def running_server(*flags: str, model: str | None = None):
    """A `mambaserve serve` server in a background thread; yields (base_url, uvicorn server).
    model: the checkpoint (default: `tokenized_checkpoint()`)."""
    args = build_parser().parse_args(["serve", model or tokenized_checkpoint(), "--dtype", "float32",
                                      "--served-model-name", MODEL, "--uvicorn-log-level", "warning", *flags])
    # Several engines live in this process: a fixed small KV pool each, rather than one engine
    # taking the whole memory budget (an EngineConfig field with no flag; the args carry it).
    args.num_kv_blocks = NUM_KV_BLOCKS
    with serve_in_thread(args, start_timeout=30) as (url, server, thread):
        yield url, server
    assert not thread.is_alive()


@contextlib.contextmanager
def serve_in_thread(args, start_timeout: float):
    """The server of parsed `serve` args on a free loopback port, in a daemon thread; yields
    (base_url, uvicorn server, thread) and stops it on exit (waiting up to 30 s)."""
    server = build_server(args)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def metrics(base_url: str, labels: bool = False) -> dict[str, float]:
    """/metrics as {name: value}, labels dropped (one model, so one series per name); with
    `labels`, names keep their labels but model_name's (`name{source="local_compute"}`)."""
    out = {}
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if labels:
                name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            else:
                name = name.split("{")[0]
            out[name] = float(value)
    return out


def wait_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no slot, block or request is in use (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        keys = ["mambaserve:state_slots_used", "mambaserve:kv_blocks_used", "vllm:num_requests_running",
                "vllm:num_requests_waiting"]
        if all(m[k] == 0 for k in keys) or time.monotonic() > deadline:
            return m


def stream_text(events) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and finish reasons per choice index of a completion or chat stream."""
    texts, reasons, chunks = {}, {}, []
    for ev in events:
        chunks.append(ev)
        for ch in ev.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, chunks
