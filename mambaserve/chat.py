"""Chat conversations to prompt text, with the model's own chat template.

One function shared by `LLM.chat` and the server's /v1/chat/completions, so that a conversation
becomes the same prompt tokens offline and online (as in vLLM: the template's text, tokenized
without adding special tokens again, since the template writes its own).
"""

from __future__ import annotations

import json
from typing import Any


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation under the tokenizer's chat template.

    messages: [{"role": ..., "content": str | [{"type": "text", "text": ...} | str, ...] | None, ...}];
    text content parts (plain strings too) are joined with newlines; other keys go to the template unchanged.
    chat_template: a Jinja template to use instead of the tokenizer's (vLLM's `LLM.chat` argument).
    add_generation_prompt: end with the assistant's turn header (ignored when
    continue_final_message, which leaves the last message open for the model to continue).
    chat_template_kwargs: extra template variables; it may not replace the template itself.
    tools: OpenAI tool definitions ([{"type": "function", "function": {"name", "description",
    "parameters"}}]) and documents (RAG: [{"title", "text"}]), passed to the template, which
    decides how to show them (a template that does not use them leaves them out). An assistant
    message's tool_calls arguments, JSON text in OpenAI's API, reach the template as objects, as
    chat templates expect (vLLM does the same).

    Raises ValueError naming the problem: no tokenizer, no chat template (neither the tokenizer's
    nor `chat_template`), a message that is not a dict with a role, a non-text content part, a
    `chat_template` in chat_template_kwargs, or an error the template itself raises (an unknown
    role, for instance).
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (this engine runs with skip_tokenizer_init=True)")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template: pass chat_template, or send plain prompts")
    kwargs = dict(chat_template_kwargs or {})
    if "chat_template" in kwargs:
        # a request's own template would run in this process (one of nested loops never ends):
        # only the caller of this function (LLM.chat's user, --chat-template) may choose one
        raise ValueError("chat_template_kwargs may not set chat_template: the model's template is used")
    if chat_template:
        kwargs["chat_template"] = chat_template
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a 'role' string, got {m!r:.80}")
        content = m.get("content")
        if isinstance(content, list):
            # a plain string is a text part, as vLLM takes it
            parts = [{"type": "text", "text": p} if isinstance(p, str) else p if isinstance(p, dict) else {"type": None}
                     for p in content]
            if any(p.get("type") != "text" for p in parts):
                raise ValueError(f"message {i}: only text content parts are supported")
            m = {**m, "content": "\n".join(p.get("text") or "" for p in parts)}  # as vLLM joins text parts
        if isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": [_arguments_as_object(c) for c in m["tool_calls"]]}
        rendered.append(m)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    try:
        return tokenizer.apply_chat_template(rendered, tokenize=False,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja and transformers raise many kinds for bad input
        raise ValueError(f"could not apply the chat template: {e}") from None


def _arguments_as_object(call: Any) -> Any:
    """A tool call with its function's arguments parsed from JSON text (left as they are when
    they are not JSON text)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
