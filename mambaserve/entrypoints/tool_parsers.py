"""Tool calls in a chat reply's text: where they are, and what to stream of them.

Formats (`--tool-call-parser NAME`, vLLM's names):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after
  optional text (Hermes-style chat templates, Qwen, ...).
- granite: Granite 4.0's format, which is the same `<tool_call>` JSON blocks (its chat template
  asks for them); Granite 3.x's `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` is read too.
- With tool_choice="required" the reply is constrained to a JSON list of such calls, and with a
  named function to that function's arguments alone (`constraints.py`): read whatever the parser.

`parse(text)` finds the calls of a reply: the text before the first call is the content, each
call's arguments are the exact JSON text the model wrote (so streamed pieces add up to it). It
reads prefixes too: a call whose arguments are not complete yet comes back with the text so far.
`ToolCallStream` streams as OpenAI does (a call's id, type and name first, then pieces of its
arguments): as they grow where a grammar keeps them valid (required, named), else each call once
it is complete and valid JSON, so that a call the model botches is never half sent.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "granite")
_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


@dataclass
class CallText:
    """A tool call found in text: name (None until its string is complete), the arguments'
    JSON text so far, and whether the arguments (and so the call) are complete."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class Parsed:
    content: str  # text before the first call (all of it when there is none)
    calls: list[CallText]
    content_final: bool  # no call can start later in `content` (a tag has begun, or the text ended)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_call(text: str, i: int) -> tuple[CallText | None, int | None]:
    """The call object starting at text[i] ("{"): its name and arguments so far, and the index
    after it (None while it is incomplete). (None, None) when it is not a call object."""
    if i >= len(text) or text[i] != "{":
        return None, None
    name, args, args_done = None, "", False
    i = _skip(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return CallText(name, args, args_done), i + 1
        try:
            key, j = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        j = _skip(text, j)
        if j >= len(text) or text[j] != ":":
            break
        j = _skip(text, j + 1)
        try:
            value, end = _DECODER.raw_decode(text, j)
        except ValueError:
            if key in ("arguments", "parameters"):
                args = text[j:]
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key in ("arguments", "parameters"):
            args, args_done = text[j:end], True
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
    return CallText(name, args, False), None


def _scan_list(text: str, i: int) -> list[CallText]:
    """The call objects of a JSON list starting at text[i] ("[")."""
    calls = []
    i = _skip(text, i + 1)
    while i < len(text) and text[i] == "{":
        call, end = _scan_call(text, i)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
    return calls


class ToolCallParser:
    """Finds tool calls in (a prefix of) a reply. mode: "hermes" or "granite" (tool_choice auto,
    the model's own format), "required" (a JSON list of calls) or "named" (the arguments of
    `name`). max_calls: calls beyond it are left out (parallel_tool_calls=false: 1; a required
    reply's grammar already stops at one then)."""

    def __init__(self, mode: str, name: str | None = None, max_calls: int | None = None):
        if mode not in (*PARSERS, "required", "named"):
            raise ValueError(f"unknown tool-call parser {mode!r}: choose one of {', '.join(PARSERS)}")
        self.mode, self.name, self.max_calls = mode, name, max_calls
        self.tags = ["<tool_call>"] + (["<|tool_call|>"] if mode == "granite" else [])

    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls of `text`; final: the reply has ended (partial tags are text)."""
        if self.mode == "named":
            return Parsed("", [CallText(self.name, text, final)], True)
        if self.mode == "required":
            i = _skip(text, 0)
            return Parsed("", _scan_list(text, i) if i < len(text) and text[i] == "[" else [], True)
        starts = [(text.find(t), t) for t in self.tags if t in text]
        if not starts:
            # hold back an end of the text that may be the start of a tag
            keep = len(text) if final else min([_partial_tag_start(text, t) for t in self.tags])
            return Parsed(text[:keep], [], final)
        pos, tag = min(starts)
        calls: list[CallText] = []
        i = pos
        while i >= 0:
            j = _skip(text, i + len(tag))
            if tag == "<|tool_call|>" and text[j:j + 1] == "[":
                calls += _scan_list(text, j)
                break
            call, end = _scan_call(text, j)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            i = text.find(tag, end)
        return Parsed(text[:pos], calls, True)

    def final(self, text: str) -> tuple[str | None, list[CallText]]:
        """(content or None, calls) of a whole reply. With the model's own format (auto), the
        calls are the complete ones with a name and JSON arguments, up to the first that is not;
        with none, the whole text is the content, as if no call had been made. A required or
        named reply is all calls (its grammar made them valid; the last is cut short only when
        max_tokens ended the reply, as OpenAI's can be)."""
        parsed = self.parse(text, final=True)
        if self.incremental:
            return None, [c for c in parsed.calls if c.name is not None][:self.max_calls]
        calls = []
        for c in parsed.calls[:self.max_calls]:
            if not (c.complete and c.name is not None and _is_json(c.arguments)):
                break
            calls.append(c)
        return (parsed.content or None) if calls else (text or None), calls

    @property
    def incremental(self) -> bool:
        """Whether arguments are streamed as they grow (a grammar keeps them valid) rather than
        each call once it is complete and valid."""
        return self.mode in ("required", "named")


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def _partial_tag_start(text: str, tag: str) -> int:
    """Where a suffix of `text` that is a proper prefix of `tag` starts (len(text) if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    """What a streamed choice has sent of its content and calls; `update` gives the next delta."""

    parser: ToolCallParser
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)

    def update(self, text: str, final: bool) -> tuple[str, list[tuple[int, str | None, str | None, str]]]:
        """(new content, [(call index, id or None, name or None, new arguments text)]) for `text`,
        the reply so far. A call's id and name come once, with its first piece. Constrained
        replies (required, named) stream arguments as they grow; the model's own format sends
        each call once it is complete and valid, so that nothing sent is taken back. The pieces
        add up to what `final` gives for the whole reply."""
        parser = self.parser
        parsed = parser.parse(text, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = len(parsed.content)
        if final and not self.ids and not parser.incremental:
            whole, calls = parser.final(text)
            if not calls:  # no valid call after all: the rest of the text is content
                rest = (whole or "")[self.content_sent:]
                self.content_sent += len(rest)
                return content + rest, []
        deltas = []
        for k, call in enumerate(parsed.calls[:parser.max_calls]):
            if call.name is None:
                break
            if not parser.incremental and k >= len(self.ids) and not (call.complete and _is_json(call.arguments)):
                break
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                deltas.append((k, self.ids[k], call.name, call.arguments))
            elif len(call.arguments) > self.args_sent[k]:
                deltas.append((k, None, None, call.arguments[self.args_sent[k]:]))
            self.args_sent[k] = len(call.arguments)
        return content, deltas
