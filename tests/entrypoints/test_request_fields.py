"""No request field is dropped without a word: each field of the OpenAI chat and completions
APIs (every parameter the official `openai` client can send) and of vLLM's extensions is tried
against the server, and gets what the table below says: 200 (implemented; `user` is accepted and
ignored, as vLLM ignores it) or a 400 whose `param` names the field. A known field that is not
implemented is accepted only at the value that leaves it off. Unknown fields are 400s too.
Also here: vLLM's prompt_logprobs and stream_options.continuous_usage_stats.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.entrypoints.servers import MODEL, running_server  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# (endpoint, fields added to a minimal request, expected status, expected error param)
TABLE = [
    # --- OpenAI chat completions: implemented
    ("chat", {"frequency_penalty": 0.5}, 200, None),
    ("chat", {"logit_bias": {"5": 1.0}}, 200, None),
    ("chat", {"logprobs": True, "top_logprobs": 2}, 200, None),
    ("chat", {"max_completion_tokens": 2}, 200, None),
    ("chat", {"max_tokens": 2}, 200, None),
    ("chat", {"n": 2}, 200, None),
    ("chat", {"parallel_tool_calls": False}, 200, None),
    ("chat", {"presence_penalty": 0.5}, 200, None),
    ("chat", {"response_format": {"type": "text"}}, 200, None),
    ("chat", {"response_format": {"type": "json_object"}}, 200, None),
    ("chat", {"seed": 3}, 200, None),
    ("chat", {"stop": ["x"]}, 200, None),
    ("chat", {"stream": True, "stream_options": {"include_usage": True}}, 200, None),
    ("chat", {"temperature": 0.5, "top_p": 0.9}, 200, None),
    ("chat", {"tools": TOOLS, "tool_choice": "none"}, 200, None),
    ("chat", {"tools": TOOLS, "tool_choice": "required"}, 200, None),
    ("chat", {"user": "someone"}, 200, None),  # ignored, as in vLLM
    ("chat", {"modalities": ["text"], "store": False}, 200, None),  # the values that change nothing
    # --- OpenAI chat completions: not implemented
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("chat", {"function_call": "auto"}, 400, "function_call"),
    ("chat", {"functions": [{"name": "f"}]}, 400, "functions"),
    ("chat", {"metadata": {"k": "v"}}, 400, "metadata"),
    ("chat", {"modalities": ["text", "audio"]}, 400, "modalities"),
    ("chat", {"moderation": {"model": "x"}}, 400, "moderation"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ("chat", {"prompt_cache_key": "k"}, 400, "prompt_cache_key"),
    ("chat", {"prompt_cache_options": {"ttl": 5}}, 400, "prompt_cache_options"),
    ("chat", {"prompt_cache_retention": "24h"}, 400, "prompt_cache_retention"),
    ("chat", {"reasoning_effort": "low"}, 400, "reasoning_effort"),
    ("chat", {"safety_identifier": "u"}, 400, "safety_identifier"),
    ("chat", {"service_tier": "auto"}, 400, "service_tier"),
    ("chat", {"store": True}, 400, "store"),
    ("chat", {"verbosity": "low"}, 400, "verbosity"),
    ("chat", {"web_search_options": {}}, 400, "web_search_options"),
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation"),
    # --- vLLM's chat extras: implemented
    ("chat", {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}, 200, None),
    ("chat", {"stop_token_ids": [3], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1}, 200,
     None),
    ("chat", {"skip_special_tokens": False, "allowed_token_ids": [3, 4, 5]}, 200, None),
    ("chat", {"prompt_logprobs": 1}, 200, None),
    ("chat", {"add_generation_prompt": False, "continue_final_message": True}, 200, None),
    ("chat", {"add_special_tokens": True, "documents": [{"title": "t", "text": "x"}]}, 200, None),
    ("chat", {"chat_template_kwargs": {"x": 1}}, 200, None),
    ("chat", {"structured_outputs": {"choice": ["a", "b"]}}, 200, None),
    ("chat", {"guided_json": {"type": "object"}, "guided_decoding_backend": "xgrammar"}, 200, None),
    ("chat", {"guided_regex": "[ab]+"}, 200, None),
    ("chat", {"guided_choice": ["a"]}, 200, None),
    ("chat", {"guided_grammar": 'root ::= "a"'}, 200, None),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 200, None),
    ("chat", {"use_beam_search": False, "priority": 0, "echo": False, "bad_words": []}, 200, None),  # off
    # --- vLLM's chat extras: not implemented
    ("chat", {"use_beam_search": True}, 400, "use_beam_search"),
    ("chat", {"length_penalty": 0.5}, 400, "length_penalty"),
    ("chat", {"spaces_between_special_tokens": False}, 400, "spaces_between_special_tokens"),
    ("chat", {"truncate_prompt_tokens": 5}, 400, "truncate_prompt_tokens"),
    ("chat", {"bad_words": ["x"]}, 400, "bad_words"),
    ("chat", {"echo": True}, 400, "echo"),
    ("chat", {"chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("chat", {"mm_processor_kwargs": {"a": 1}}, 400, "mm_processor_kwargs"),
    ("chat", {"priority": 1}, 400, "priority"),
    ("chat", {"request_id": "mine"}, 400, "request_id"),
    ("chat", {"return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ("chat", {"return_token_ids": True}, 400, "return_token_ids"),
    ("chat", {"cache_salt": ""}, 400, "cache_salt"),
    ("chat", {"kv_transfer_params": {"a": 1}}, 400, "kv_transfer_params"),
    ("chat", {"vllm_xargs": {"a": 1}}, 400, "vllm_xargs"),
    ("chat", {"logprob_token_ids": [3]}, 400, "logprob_token_ids"),
    ("chat", {"thinking_token_budget": 8}, 400, "thinking_token_budget"),
    ("chat", {"include_reasoning": False}, 400, "include_reasoning"),
    ("chat", {"stream_interval": 2}, 400, "stream_interval"),
    ("chat", {"repetition_detection": {"max_pattern_size": 2, "min_count": 2}}, 400, "repetition_detection"),
    ("chat", {"logits_processors": ["x"]}, 400, "logits_processors"),
    ("chat", {"guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern"),
    ("chat", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, 400, "structured_outputs"),
    ("chat", {"structured_outputs": {"structural_tag": "{}"}}, 400, "structured_outputs"),
    ("chat", {"response_format": {"type": "structural_tag"}}, 400, "response_format.type"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, 400, None),  # as in vLLM
    # --- completions: OpenAI's fields
    ("completions", {"best_of": 1, "echo": True, "logprobs": 1, "max_tokens": 2, "n": 1}, 200, None),
    ("completions", {"frequency_penalty": 0.1, "presence_penalty": 0.1, "logit_bias": {"5": -1.0}}, 200, None),
    ("completions", {"seed": 1, "stop": "x", "temperature": 0.7, "top_p": 0.5, "user": "u"}, 200, None),
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}, 200, None),
    ("completions", {"best_of": 3}, 400, "best_of"),
    ("completions", {"suffix": "x"}, 400, "suffix"),
    # --- completions: vLLM's extras
    ("completions", {"prompt_logprobs": 2, "add_special_tokens": False}, 200, None),
    ("completions", {"response_format": {"type": "json_object"}, "max_tokens": 4}, 200, None),
    ("completions", {"structured_outputs": {"regex": "[0-9]+"}}, 200, None),
    ("completions", {"prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("completions", {"use_beam_search": True}, 400, "use_beam_search"),
    ("completions", {"tools": TOOLS}, 400, "tools"),  # chat only
    # --- unknown fields, at the top and inside objects
    ("chat", {"frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"frobnicate": 1}, 400, "frobnicate"),
    ("chat", {"stream": True, "stream_options": {"bogus": 1}}, 400, "stream_options.bogus"),
    ("chat", {"response_format": {"type": "json_object", "bogus": 1}}, 400, "response_format.bogus"),
    ("chat", {"structured_outputs": {"json": {}, "bogus": 1}}, 400, "structured_outputs.bogus"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, 400, "tools.0.function.bogus"),
    ("chat", {"tool_choice": "auto"}, 400, None),  # tool_choice without tools
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, None),
]

# every parameter of the openai client's create() is in the table (stream rides with stream_options)
CHAT_SEEN = {k for e, f, _, _ in TABLE if e == "chat" for k in f}
COMPLETION_SEEN = {k for e, f, _, _ in TABLE if e == "completions" for k in f}


@pytest.fixture(scope="module")
def base_url():
    with running_server("--structured-outputs-config", '{"disable_any_whitespace": true}') as (url, _):
        yield url


def _post(base_url: str, endpoint: str, fields: dict) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Hi"}]
        if body.get("continue_final_message"):
            body["messages"].append({"role": "assistant", "content": "Hello"})
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    body["prompt"] = "Hello"
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def test_every_openai_client_parameter_is_in_the_table():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    chat = set(chat_params.CompletionCreateParamsBase.__annotations__) - {"messages", "model"}
    completion = set(completion_create_params.CompletionCreateParamsBase.__annotations__) - {"prompt", "model"}
    assert chat - CHAT_SEEN == set()
    assert completion - COMPLETION_SEEN == set()


@pytest.mark.parametrize("endpoint, fields, status, param", TABLE,
                         ids=[f"{e}-{'-'.join(f)}-{s}" for e, f, s, _ in TABLE])
def test_field_table(base_url, endpoint, fields, status, param):
    r = _post(base_url, endpoint, fields)
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param, err
            assert param.split(".")[-1] in err["message"] or param.startswith("structured_outputs"), err


def test_prompt_logprobs_as_vllm(base_url):
    r = _post(base_url, "completions", {"prompt_logprobs": 2, "max_tokens": 1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    n = r["usage"]["prompt_tokens"]
    assert len(plp) == n and plp[0] is None
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 3  # the actual token, and the 2 most likely
        for tok, lp in entry.items():
            assert int(tok) >= 0 and lp["logprob"] <= 0 and lp["rank"] >= 1 and isinstance(lp["decoded_token"], str)
        assert sorted(lp["rank"] for lp in entry.values())[:1] == [min(lp["rank"] for lp in entry.values())]
    chat = _post(base_url, "chat", {"prompt_logprobs": 0, "max_tokens": 1}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(e is None or len(e) == 1 for e in chat["prompt_logprobs"])  # only the actual token at 0
    assert "prompt_logprobs" not in _post(base_url, "completions", {}).json()["choices"][0]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(base_url, endpoint):
    fields = {"stream": True, "max_tokens": 6, "ignore_eos": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    url = f"{base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    body = {"model": MODEL, **fields}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat" else {"prompt": "Hello"})
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason") is None
                    and (e["choices"][0].get("text") or (e["choices"][0].get("delta") or {}).get("content"))]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] <= 6
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in with_choices)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
