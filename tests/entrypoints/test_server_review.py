"""Regression tests from a review of the OpenAI-compatible server: inputs that clients in the
wild send, and that used to hang the server, fail with 500 or be refused.

One server (no API key) for the module, started as `tests/entrypoints/test_server.py` does.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.entrypoints.servers import running_server  # noqa: E402

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served():
    with running_server() as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_request_supplied_chat_template_is_refused(base_url):
    """chat_template_kwargs={"chat_template": ...} used to replace the model's template with
    the client's: a template of nested loops then rendered on the event loop for ever and hung
    the whole server (every stream, /health). It must be a 400, as in vLLM."""
    for kwargs in ({"chat_template": "{{ 'injected' }}"}, {"chat_template": None}):
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=10,
                       json={"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs})
        assert _error(r, 400)["param"] == "chat_template_kwargs"
    # Ordinary template variables still reach the template.
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=10,
                   json={"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [
    ("completions", {"prompt": "a\ud800b"}),
    ("completions", {"prompt": ["ok", "a\udfffb"]}),
    ("completions", {"prompt": "ok", "model": "\ud800"}),
    ("completions", {"prompt": "ok", "stop": ["\ud800"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud83db"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
])
def test_lone_surrogates_are_a_400_not_a_500(base_url, path, body):
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"): not text, so not a valid prompt.
    It used to reach the tokenizer (or an error message) and come back as a 500."""
    raw = json.dumps({**body, "max_tokens": 2})  # ASCII JSON: the surrogate as an escape
    r = httpx.post(f"{base_url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=10)
    _error(r, 400)
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_null_means_default_for_openai_nullable_fields(base_url):
    """OpenAI's API documents n, stream, echo (completions) and logprobs (chat) as nullable
    ("integer or null", defaults apply); some clients send the nulls. They used to be 400s."""
    r = httpx.post(f"{base_url}/v1/completions", timeout=30,
                   json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "n": None, "stream": None,
                         "echo": None, "logprobs": None, "best_of": None, "ignore_eos": None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and not body["choices"][0]["text"].startswith("Hello")
    assert body["choices"][0]["logprobs"] is None
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30,
                   json={"messages": CHAT, "max_tokens": 3, "n": None, "stream": None, "logprobs": None,
                         "top_logprobs": None, "add_generation_prompt": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    # max_tokens: null keeps its meaning (up to the context length), it is not the default 16
    r = httpx.post(f"{base_url}/v1/completions", timeout=60,
                   json={"prompt": [5] * 2020, "max_tokens": None, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2048 - 2020


def test_tokenizing_a_big_prompt_does_not_stall_the_server(served, monkeypatch):
    """Prompts used to be tokenized on the event loop: one 4 MB prompt (a few seconds of
    tokenizing) stopped every stream and /health meanwhile."""
    url, server = served
    serving = server.config.app.state.serving
    slow_calls = []
    encode = type(serving.tokenizer).__call__

    def slow(self, *args, **kwargs):  # 2 s to encode (and, as the real one does, releases the GIL)
        slow_calls.append(1)
        time.sleep(2.0)
        return encode(self, *args, **kwargs)

    # on the class: every tokenizing thread encodes with its own copy
    monkeypatch.setattr(type(serving.tokenizer), "__call__", slow)
    done = []
    t = threading.Thread(target=lambda: done.append(httpx.post(
        f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)))
    t.start()
    deadline = time.monotonic() + 5
    while not slow_calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert time.monotonic() - start < 1.0, "the event loop was blocked by tokenization"
    t.join(30)
    assert done and done[0].status_code == 200, done and done[0].text


def test_retrieve_model_and_unknown_model(base_url):
    """The openai client's models.retrieve(id) is GET /v1/models/{id}."""
    from openai import NotFoundError, OpenAI

    name = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    assert client.models.retrieve(name).id == name
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")


def test_stream_options_without_stream_is_a_400(base_url):
    r = httpx.post(f"{base_url}/v1/completions", timeout=10,
                   json={"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}})
    _error(r, 400)
    r = httpx.post(f"{base_url}/v1/completions", timeout=10,
                   json={"prompt": "a", "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and "data: [DONE]" in r.text
