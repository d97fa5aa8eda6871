"""Tool calls found in reply text (hermes, granite, required lists, named arguments), streamed
pieces adding up to the whole, and tools reaching the chat template."""

from __future__ import annotations

import json

import pytest

from mambaserve.chat import render_chat
from mambaserve.entrypoints.tool_parsers import ToolCallParser, ToolCallStream

HERMES = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": {"c": "}"}}}</tool_call>')
CASES = [
    ("hermes", HERMES, "I will check. ", [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                          ("add", '{"a": 1, "b": {"c": "}"}}')]),
    ("granite", HERMES, "I will check. ", [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                           ("add", '{"a": 1, "b": {"c": "}"}}')]),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"x": "<tool_call>"}}, {"arguments": {}, "name": "g"}]',
     None, [("f", '{"x": "<tool_call>"}'), ("g", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [("f", "{}")]),
    ("hermes", "no call at all, < tool_call >", "no call at all, < tool_call >", []),
    ("hermes", 'broken <tool_call>{"name": "f", "arguments": {"x": }</tool_call>',
     'broken <tool_call>{"name": "f", "arguments": {"x": }</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call>', '<tool_call>{"arguments": {"x": 1}}</tool_call>', []),
    ("required", '[{"name": "f", "arguments": {"q": "a, b"}}, {"name": "g", "arguments": {"n": [1]}}]',
     None, [("f", '{"q": "a, b"}'), ("g", '{"n": [1]}')]),
    ("required", ' [ {"name": "f", "arguments": {"q": 1} } ]', None, [("f", '{"q": 1}')]),
]


@pytest.mark.parametrize("mode, text, content, calls", CASES)
def test_whole_reply(mode, text, content, calls):
    got_content, got = ToolCallParser(mode).final(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        json.loads(c.arguments)


@pytest.mark.parametrize("mode, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_add_up_to_the_whole_reply(mode, text, content, calls, step):
    stream = ToolCallStream(ToolCallParser(mode))
    sent_content, ids, args = "", {}, {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        piece, deltas = stream.update(text[:cut], final=cut == len(text))
        sent_content += piece
        for k, call_id, name, arguments in deltas:
            if call_id is not None:
                assert k not in ids and name is not None
                ids[k] = (call_id, name)
            else:
                assert k in ids and name is None
            args[k] = args.get(k, "") + arguments
    assert sent_content == (content or "")
    assert [(ids[k][1], args[k]) for k in sorted(ids)] == calls


def test_named_function_reply_is_its_arguments():
    content, [call] = ToolCallParser("named", "f").final('{"x": 1}')
    assert content is None and (call.name, call.arguments) == ("f", '{"x": 1}')
    stream = ToolCallStream(ToolCallParser("named", "f"))
    assert stream.update("", False)[1][0][1:3] != (None, None)  # id and name come first, before any argument


def test_parallel_tool_calls_false_keeps_the_first_call():
    parser = ToolCallParser("hermes", max_calls=1)
    content, calls = parser.final(HERMES)
    assert content == "I will check. " and [c.name for c in calls] == ["get_weather"]
    stream = ToolCallStream(parser)
    sent = [d for cut in range(1, len(HERMES) + 1) for d in stream.update(HERMES[:cut], cut == len(HERMES))[1]]
    assert {k for k, *_ in sent} == {0}


def test_unknown_parser_refused():
    with pytest.raises(ValueError, match="hermes"):
        ToolCallParser("mistral")


def test_tools_documents_and_tool_call_arguments_reach_the_template():
    from tests.tokenized import build_tokenizer

    tok = build_tokenizer(512)
    tok.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                         "{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
                         "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                         "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                         "{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = render_chat(tok, messages, tools=tools, documents=[{"title": "T", "text": "x"}], add_generation_prompt=False)
    assert text == "[tool get_weather][doc T]<user>Weather?<assistant>[call get_weather Oslo]<tool>sunny"
