"""The server against vLLM's OpenAI server for the same requests: defaults, stream chunks and
error bodies where the two used to differ.

One server for the module, over a copy of the tiny tokenized checkpoint whose
generation_config.json sets max_new_tokens and whose tokenizer puts a BOS token before a text
(as real checkpoints do), with a short context.
"""

from __future__ import annotations

import json
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.entrypoints.servers import running_server  # noqa: E402
from tests.tokenized import tokenized_checkpoint  # noqa: E402

MAX_NEW_TOKENS = 6
MAX_MODEL_LEN = 64
BOS = "<|startoftext|>"  # id 1 in tests/tokenized.py


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt") / "tiny"
    shutil.copytree(tokenized_checkpoint(), ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": MAX_NEW_TOKENS}))
    tokenizer = json.loads((ckpt / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    tokenizer["post_processor"].update(single=[bos, *tokenizer["post_processor"]["single"]],
                                       special_tokens={BOS: {"id": BOS, "ids": [1], "tokens": [BOS]}})
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer))
    with running_server("--max-model-len", str(MAX_MODEL_LEN), model=str(ckpt)) as (url, _):
        yield url


def _post(base_url, path, body):
    r = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_completions_max_tokens_null_is_the_generation_config_default(base_url):
    """vLLM takes "max_tokens": null (OpenAI's API allows it) as the checkpoint's max_new_tokens,
    capped by the context, on both endpoints; completions used to generate up to the context."""
    short = {"prompt": "def add(a, b):", "max_tokens": None, "ignore_eos": True, "temperature": 0}
    assert _post(base_url, "/v1/completions", short)["usage"]["completion_tokens"] == MAX_NEW_TOKENS
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": None, "ignore_eos": True}
    assert _post(base_url, "/v1/chat/completions", chat)["usage"]["completion_tokens"] == MAX_NEW_TOKENS
    # a prompt that leaves fewer tokens than the default: it ends at the context, as in vLLM
    long = {**short, "prompt": [5] * (MAX_MODEL_LEN - 2)}
    choice = _post(base_url, "/v1/completions", long)
    assert choice["usage"]["completion_tokens"] == 2 and choice["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": "x"}}, "logit_bias.1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "any",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
])
def test_a_wrong_type_names_the_field_as_openai(base_url, path, body, param):
    """The error's param is the request field's path, as OpenAI's API names it; it used to end
    in pydantic's tag of the first union member tried ("prompt.str", "tool_choice.literal[...]")."""
    r = httpx.post(f"{base_url}{path}", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _events(base_url, path, body):
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_continuous_usage_is_in_every_chat_chunk_the_role_chunk_too(base_url):
    """vLLM's continuous_usage_stats: every chunk has the usage so far, also the first (the
    role's: the prompt's tokens, none generated), which used to have none."""
    messages = [{"role": "user", "content": "Hi"}]
    prompt = _post(base_url, "/tokenize", {"messages": messages})["count"]
    events = _events(base_url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["usage"] is not None and e["usage"]["prompt_tokens"] == prompt for e in events)
    first = events[0]["usage"]
    assert (first["completion_tokens"], first["total_tokens"]) == (0, prompt)


@pytest.mark.parametrize("field, value", [("logit_bias", {"100000": 5}), ("allowed_token_ids", [100000])])
def test_a_token_id_outside_the_vocabulary_names_its_field(base_url, field, value):
    """OpenAI's error names the field at fault; one naming a token past the vocabulary had none."""
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "a", "max_tokens": 1, field: value}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tokenize_takes_add_special_tokens_for_messages_too(base_url):
    """vLLM's /tokenize adds the tokenizer's special tokens (BOS here) to a prompt by default and
    to chat messages only when asked, as /v1/chat/completions does; for messages the field used
    to be ignored, so its count was not the chat endpoint's prompt_tokens."""
    def count(**body):
        return _post(base_url, "/tokenize", body)["count"]

    assert _post(base_url, "/tokenize", {"prompt": "Hi"})["tokens"][0] == 1
    assert count(prompt="Hi") == count(prompt="Hi", add_special_tokens=False) + 1
    messages = [{"role": "user", "content": "Hi"}]
    for special in (False, True):
        chat = _post(base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                        "add_special_tokens": special})
        assert count(messages=messages, add_special_tokens=special) == chat["usage"]["prompt_tokens"]
    assert count(messages=messages) == count(messages=messages, add_special_tokens=True) - 1


def test_tokenize_returns_the_token_strings_when_asked(base_url):
    """vLLM's return_token_strs: the tokenizer's own strings of the ids (used to be refused)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenized_checkpoint())
    got = _post(base_url, "/tokenize", {"prompt": "def add(a, b):", "return_token_strs": True})
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"]) and len(got["token_strs"]) == got["count"]
    assert _post(base_url, "/tokenize", {"prompt": "def add(a, b):"})["token_strs"] is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_new_turn_and_a_continued_message_together_are_refused(base_url, path):
    """vLLM refuses add_generation_prompt and continue_final_message both set to true; this server
    used to let the second win silently. continue_final_message alone is fine (the first's
    default gives way)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, **({"max_tokens": 1} if path != "/tokenize" else {})}
    r = httpx.post(f"{base_url}{path}", json={**body, "add_generation_prompt": True, "continue_final_message": True},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert "cannot both be true" in r.json()["error"]["message"]
    _post(base_url, path, {**body, "continue_final_message": True})
