"""Pydantic models of the OpenAI HTTP requests that the server takes (completions, chat
completions, vLLM's tokenize and detokenize), with the fields vLLM adds (top_k, min_p,
repetition_penalty, ...); the responses are in `protocol_responses.py`.

Requests are parsed strictly, about fields and about types (pydantic's strict mode): an unknown
field, a known one this server does not implement (`request_fields`), a wrong type (`"n": "2"`,
`"max_tokens": true`, `"stream": "yes"`, `"n": 2.0`) or a non-finite float is a validation error,
which the server answers with 400 naming the field; an integer is accepted where a number is
expected (`"temperature": 1`), as in JSON and OpenAI's API. Value ranges that `SamplingParams`
checks are left to it, so the messages match the offline API's. This module knows nothing about
the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from mambaserve.entrypoints import request_fields

# More completions per prompt than this is far more likely a mistake (or abuse) than a use.
MAX_N = 128
MAX_STOPS = 64
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request

TokenIds = list[StrictInt]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # known fields that are not implemented: {field: the value that leaves it off}
    _unsupported: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """JSON null for an optional field that takes no None means its default: OpenAI's API
        documents n, stream, echo, logprobs, ... as "or null", and some clients send nulls.
        A known but unimplemented field is dropped when off, refused (400) otherwise."""
        if not isinstance(data, dict):
            return data
        data = request_fields.drop_unsupported(data, cls._unsupported)
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()
                or type(None) in get_args(fields[k].annotation)}


class StreamOptions(_Request):
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's): every chunk
    carries the usage so far too."""

    _unsupported: ClassVar[dict[str, Any]] = request_fields.STREAM_OPTIONS
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: the schema the reply must be an instance of."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or
    json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs extra (its StructuredOutputsParams): one constraint kind."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


def _check_text(data: Any) -> Any:
    """Raise ValueError if any string in `data` (JSON values) holds a lone UTF-16 surrogate:
    JSON can escape one ("\\ud800"), but it is not text, and no tokenizer or reply can take it."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("strings must be valid Unicode (a lone surrogate was sent)") from None
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list) and x and not isinstance(x[0], int):  # not token ids: a prompt can be 1M of them
            stack.extend(x)
    return data


class SamplingRequest(_Request):
    """The sampling fields that completions and chat completions share."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return _check_text(data)

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # torch generators take seeds in [-2**63, 2**64); the engine adds the completion index.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    # Every generated token is checked against each stop: bounded, so that one request cannot
    # slow the shared engine loop down.
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOPS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's {token id as a string: bias in [-100, 100]}; vLLM's allowed_token_ids
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as in vLLM
    # vLLM's: the prefix cache is shared only among requests with the same salt (a tenant's secret)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=1024)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # as OpenAI and vLLM: stream_options only means something for a streamed response
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true (as in vLLM)")
        return self


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids or a list
    of token-id lists. max_tokens=0 with echo=True returns the prompt (and its logprobs) only."""

    _unsupported: ClassVar[dict[str, Any]] = request_fields.COMPLETION
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)  # non-text parts are refused by type

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation; extra keys (name, tool_calls, ...) go to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextContentPart] | None = None


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    """One entry of `tools`: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice naming the function that must be called."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FieldConflictError(ValueError):
    """Two request fields that contradict each other; `param` names the second (the error's param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _check_chat_prompt_flags(req) -> None:
    """Both set to true by the client is a contradiction (vLLM refuses it too); continue_final_message
    alone wins over add_generation_prompt's default."""
    if {"add_generation_prompt", "continue_final_message"} <= req.model_fields_set and \
            req.add_generation_prompt and req.continue_final_message:
        raise FieldConflictError("add_generation_prompt and continue_final_message cannot both be true: the "
                                 "first starts a new assistant turn, the second continues the last message",
                                 "continue_final_message")


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template over `messages`
    (and `tools`, `documents`)."""

    _unsupported: ClassVar[dict[str, Any]] = request_fields.CHAT
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        _check_chat_prompt_flags(self)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # None: vLLM's defaults, True for a prompt and False for messages (as the two endpoints)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=128)] | None = None  # to the template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        _check_chat_prompt_flags(self)
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = None
    tokens: TokenIds
