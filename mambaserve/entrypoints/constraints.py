"""From a request's structured-output fields to one `StructuredOutputsParams`: OpenAI's
response_format, vLLM's structured_outputs extra and its older guided_* fields, and the
constraint that `tool_choice="required"` or a named function puts on a chat reply.

At most one constraint per request (two are a 400, as in vLLM: a tool constraint and a
response format cannot both hold). The server's `--structured-outputs-config` options
(disable_any_whitespace, ...) apply where the request does not set its own.
"""

from __future__ import annotations

import json
from typing import Any

from mambaserve.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice, SamplingRequest
from mambaserve.sampling_params import StructuredOutputsParams

CONFIG_KEYS = {"backend", "disable_any_whitespace", "disable_additional_properties"}


class ConstraintError(ValueError):
    """A request's constraint fields that do not make one valid constraint; `param` names the field."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def parse_config(text: str | None) -> dict[str, Any]:
    """`--structured-outputs-config` (vLLM's flag: a JSON object) as StructuredOutputsParams
    option defaults. backend may be "xgrammar" or "auto" (both xgrammar). Raises ValueError."""
    if not text:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
    if not isinstance(config, dict) or set(config) - CONFIG_KEYS:
        raise ValueError(f"--structured-outputs-config takes an object with keys among {sorted(CONFIG_KEYS)}")
    if config.pop("backend", "auto") not in ("auto", "xgrammar"):
        raise ValueError("--structured-outputs-config: backend must be xgrammar (or auto)")
    if any(not isinstance(v, bool) for v in config.values()):
        raise ValueError("--structured-outputs-config: disable_* options must be true or false")
    return config


def tool_call_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON schema of a reply with tool_choice="required": a list of calls
    [{"name": one of the tools, "arguments": valid under that tool's parameters}, ...]
    (one call at most when parallel_tool_calls is false)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"]} for t in req.tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _named_parameters(req: ChatCompletionRequest) -> dict[str, Any]:
    name = req.tool_choice.function.name
    tool = next(t for t in req.tools if t.function.name == name)
    return tool.function.parameters or {"type": "object"}


def structured_outputs_of(req: SamplingRequest, defaults: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint of `req`, or None. Raises ConstraintError (400) for two constraints,
    or for a constraint StructuredOutputsParams refuses."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs.model_dump(by_alias=True, exclude_unset=True)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice == "required":
        found.append(("tool_choice", {"json": tool_call_schema(req)}))
    elif isinstance(req, ChatCompletionRequest) and isinstance(req.tool_choice, NamedToolChoice):
        found.append(("tool_choice", {"json": _named_parameters(req)}))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise ConstraintError(f"give one structured-output constraint, not {len(found)}: {', '.join(names)}",
                              names[1])
    param, fields = found[0]
    try:
        return StructuredOutputsParams(**{**defaults, **fields})
    except ValueError as e:
        raise ConstraintError(str(e).replace("StructuredOutputsParams", param), param) from None
