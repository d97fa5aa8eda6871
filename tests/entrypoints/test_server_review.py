"""Regression tests from a review of the OpenAI-compatible server: inputs that clients in the
wild send, and that used to hang the server, fail with 500 or be refused.

One server (no API key) for the module, started as `tests/entrypoints/test_server.py` does.
"""

from __future__ import annotations


import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.entrypoints.test_server import running_server  # noqa: E402

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
