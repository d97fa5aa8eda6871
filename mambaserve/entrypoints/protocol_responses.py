"""Pydantic models of the OpenAI HTTP responses that the server sends: completions, chat
completions, their stream chunks, logprobs, tool calls, model cards and errors, with vLLM's
extras (prompt_logprobs, stop_reason). Unset optional extras are left out of the JSON, as OpenAI
and vLLM leave them out. The request models are in ; this module knows neither them
nor the engine.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's token strings, with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    """OpenAI's usage.prompt_tokens_details: cached_tokens = prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with prefix caching on (null off)


class CompletionLogProbs(BaseModel):
    """OpenAI completions' logprobs: parallel lists over the tokens of the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: {token id: this} per prompt token (None for the first)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_prompt_logprobs(self, handler):
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)  # vLLM's extra: only when asked for
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)  # as OpenAI: only a reply that calls tools has the key
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_prompt_logprobs(self, handler):
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a call: the name comes once, first; then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed tool call: index (its position in the message), and id and type with its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """A streamed message delta; unset fields are left out of the JSON, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mambaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
