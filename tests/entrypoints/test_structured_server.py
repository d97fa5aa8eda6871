"""Structured outputs and tool calling through the server, with the official `openai` client, on
the bundled demo model (a trained tiny model of Python text: the constraints do the work).

The server runs with `--structured-outputs-config {"disable_any_whitespace": true}` (vLLM's
flag): without it a model this small pads JSON with whitespace until max_tokens. Every reply is
checked by an independent reference: `json` + `jsonschema`, `re.fullmatch`, the choice list, the
tools' own parameter schemas; streamed replies against whole ones; unconstrained requests against
themselves sent alone.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mambaserve.config import default_model  # noqa: E402
from tests.entrypoints.servers import MODEL, running_server  # noqa: E402

CHAT = [{"role": "user", "content": "Reply in JSON."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served():
    flags = ["--structured-outputs-config", '{"disable_any_whitespace": true}', "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes", "--max-num-seqs", "64"]
    with running_server(*flags, model=default_model()) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _leaf(rng: random.Random, depth: int) -> dict:
    kinds = ["int", "str", "bool", "null", "enum", "pattern", "phone", "ints", "tags", "const", "num"]
    if depth < 2:
        kinds += ["object", "objects"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "objects":
        return {"type": "array", "items": _object(rng, depth + 1, size=1), "maxItems": 2}
    return {"int": {"type": "integer", "minimum": 0, "maximum": 999}, "str": {"type": "string", "maxLength": 6},
            "bool": {"type": "boolean"}, "null": {"type": "null"}, "enum": {"enum": ["red", "green", "blue", 7]},
            "pattern": {"type": "string", "pattern": "^[a-z]{2,4}$"},
            "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
            "ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
            "const": {"const": "fixed"}, "num": {"type": "number", "minimum": 0, "maximum": 10}}[kind]


def _object(rng: random.Random, depth: int = 0, size: int | None = None) -> dict:
    names = rng.sample(["id", "name", "kind", "items", "meta", "ok", "code", "when", "who"], size or rng.randint(1, 3))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required}


def json_schemas(n: int = 50) -> list[dict]:
    """n different random schemas (the same ones every run)."""
    rng, out = random.Random(22), {}
    while len(out) < n:
        schema = _object(rng)
        out.setdefault(json.dumps(schema), schema)
    return list(out.values())


def test_fifty_json_schemas_all_parse_and_validate(client):
    schemas = json_schemas()
    assert len({json.dumps(s) for s in schemas}) == 50

    def ask(i):
        return client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=96, temperature=0 if i % 2 else 1, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i],
                                                                     "strict": True}})

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(ask, range(50)))
    truncated = [i for i, r in enumerate(replies) if r.choices[0].finish_reason != "stop"]
    assert truncated == [], f"{len(truncated)} of 50 replies hit max_tokens: {truncated}"
    for schema, r in zip(schemas, replies):
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_grammar_and_json_object_always_match(client, endpoint):
    cases = [
        ({"structured_outputs": {"regex": r"[a-z]{3,6}@(mail|post)\.com"}},
         lambda t: re.fullmatch(r"[a-z]{3,6}@(mail|post)\.com", t)),
        ({"guided_regex": r"\d{1,3}(\.\d{1,3}){3}"}, lambda t: re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", t)),
        ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
         lambda t: t in ("positive", "negative", "neutral")),
        ({"guided_choice": ["A", "B", "C or D"]}, lambda t: t in ("A", "B", "C or D")),
        ({"guided_grammar": 'root ::= ("yes" | "no") ", " [0-9]'}, lambda t: re.fullmatch(r"(yes|no), [0-9]", t)),
        ({"guided_json": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}},
         lambda t: isinstance(json.loads(t)["v"], bool)),
    ]
    for extra, check in cases:
        kw = dict(model=MODEL, max_tokens=32, temperature=1.0, n=3, seed=1, extra_body=extra)
        if endpoint == "chat":
            r = client.chat.completions.create(messages=CHAT, **kw)
            texts = [c.message.content for c in r.choices]
        else:
            r = client.completions.create(prompt="def main():", **kw)
            texts = [c.text for c in r.choices]
        assert all(c.finish_reason == "stop" for c in r.choices), (extra, texts)
        assert all(check(t) for t in texts), (extra, texts)


def _check_calls(message, names=None, cut=False):
    """Every call names a tool and has arguments valid under its schema (but the last when
    max_tokens cut the reply: its arguments may stop short, as OpenAI's can)."""
    assert message.tool_calls, message
    for call in message.tool_calls[:-1] if cut else message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or PARAMS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_and_named_always_valid_calls(client):
    def ask(i):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS, max_tokens=64,
                  temperature=1.0, seed=i)
        if i % 3 == 2:
            return client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "add"}}, **kw)
        return client.chat.completions.create(tool_choice="required", parallel_tool_calls=i % 3 == 1, **kw)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(ask, range(12)))
    for i, r in enumerate(replies):
        choice = r.choices[0]
        _check_calls(choice.message, ["add"] if i % 3 == 2 else None, cut=choice.finish_reason == "length")
        if i % 3 == 1:
            # parallel calls: this model may go on calling until max_tokens; the calls it finished are returned
            assert choice.finish_reason in ("tool_calls", "length"), choice
        else:
            # a call of the named function ends with "stop", as in OpenAI's API and vLLM
            assert choice.finish_reason == ("stop" if i % 3 == 2 else "tool_calls"), choice
            assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False, or a named function


def _stream_chat(client, **kw):
    content, calls, finish = "", {}, None
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # a call's first piece: id, type and name, before any arguments
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("case", ["json_schema", "required", "named", "auto"])
def test_streamed_equals_non_streamed_under_greedy(client, case):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=160, temperature=0)
    if case == "json_schema":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": json_schemas(3)[2]}}
    elif case == "required":
        kw.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    elif case == "named":
        kw.update(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    else:  # the hermes parser on a reply made to look like the model's own call (a regex constraint)
        call = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", '
                r'"unit": "celsius"\}\}\n</tool_call>')
        kw.update(tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": {"regex": "Sure[.!]? " + call}})
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = _stream_chat(client, **kw)
    assert finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "")
    if case == "json_schema":
        assert not calls and finish == "stop" and json.loads(content)
    else:
        assert finish == ("stop" if case == "named" else "tool_calls")
        _check_calls(whole.message)
    if case == "auto":
        assert whole.message.content.startswith("Sure") and "<tool_call>" not in whole.message.content


def test_a_constrained_request_leaves_concurrent_unconstrained_ones_unchanged(client):
    prompts = ["def add(a, b):", "class Stack:", "import sys\n", "for i in range(10):"]

    def plain(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text

    def constrained(_):
        return client.completions.create(model=MODEL, prompt="x = ", max_tokens=48, temperature=0, extra_body={
            "structured_outputs": {"json": json_schemas(1)[0]}}).choices[0].text

    alone = [plain(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(constrained, 0)] + [pool.submit(plain, p) for p in prompts] + [pool.submit(constrained, 1)]
        results = [j.result() for j in jobs]
    assert results[1:5] == alone
    for text in (results[0], results[5]):
        jsonschema.validate(json.loads(text), json_schemas(1)[0])


def test_bad_constraints_are_400s_naming_the_field(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format", "does not compile"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "does not compile"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "does not compile"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured-output constraint"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "one structured-output constraint"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", ""),
    ]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param and message in e.value.body["message"], (extra, e.value.body)


def test_auto_tool_choice_needs_the_flag(served):
    from mambaserve.entrypoints.openai_serving import ApiError, OpenAIServing
    from mambaserve.entrypoints.protocol import ChatCompletionRequest

    serving = OpenAIServing(served[1].engine, MODEL)  # no --enable-auto-tool-choice
    try:
        for choice in ("auto", None):  # tools without tool_choice mean "auto", as in vLLM
            req = ChatCompletionRequest(messages=CHAT, tools=TOOLS, **({"tool_choice": choice} if choice else {}))
            with pytest.raises(ApiError, match="enable-auto-tool-choice") as e:
                serving.prepare_chat(req)
            assert e.value.status == 400 and e.value.param == "tool_choice"
        for choice in ("none", "required"):
            assert serving.prepare_chat(ChatCompletionRequest(messages=CHAT, tools=TOOLS, tool_choice=choice))
    finally:
        serving.close()
