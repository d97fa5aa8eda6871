"""What the completions and chat serving share: the API error, a validated request (`Job`),
a streamed choice's progress, server-sent-event framing, and the formatting of tokens,
logprobs and usage (`OutputFormatting`, the base of both servings).

Knows the response models, not the request models' validation nor the engine loop.
"""

from __future__ import annotations

import dataclasses
import math

from mambaserve.entrypoints.async_engine import RequestStream
from mambaserve.entrypoints.protocol_responses import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from mambaserve.entrypoints.tool_parsers import ToolCallParser
from mambaserve.outputs import RequestOutput
from mambaserve.sampling_params import Logprob, SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_unavailable_error"}


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


@dataclasses.dataclass
class Job:
    """A validated request, ready for the engine."""

    request_id: str
    created: int
    prompts: list[tuple[str | None, list[int]]]  # (text or None, token ids)
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    drop_output: bool = False  # max_tokens=0: one token is generated and not returned
    num_top: int | None = None  # logprobs asked for (None: none)
    arrival: float = 0.0  # time.time() when the request arrived
    prompt_top: int | None = None  # vLLM's prompt_logprobs asked for (None: none)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    tools: ToolCallParser | None = None  # how to find tool calls in the reply (None: it has none)
    model: str = ""  # the served name the request used (responses echo it, as vLLM's)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes


@dataclasses.dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    done: bool = False
    offset: int = 0  # text_offset of the next token (completions logprobs)


def sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


DONE = "data: [DONE]\n\n"


def finite(x: float) -> float:
    # JSON has no infinities: OpenAI-style servers send a large negative number instead.
    return x if math.isfinite(x) else -9999.0



def top_logprobs_by_label(d: dict[int, Logprob], label) -> dict[str, float]:
    """One position's completions top_logprobs {label: logprob}: one entry per token, most
    likely first; label(token, Logprob) -> text. Labels are the tokens' text in context (the
    engine's); where two tokens read the same (byte fragments that each decode to U+FFFD, twin
    vocabulary entries) the less likely one is keyed `token_id:<id>` (vLLM's spelling under
    --return-tokens-as-token-ids), so that no entry is lost and none takes another's value."""
    ranked = sorted(d.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))
    top: dict[str, float] = {}
    for t, lp in ranked:
        text = label(t, lp)
        top[f"token_id:{t}" if text in top else text] = finite(lp.logprob)
    return top



def prompt_logprobs_of(out: RequestOutput, num_top: int) -> list:
    """vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: logprob, rank,
    decoded token} for the actual token and the num_top most likely."""
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return [None if not d else {t: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                 decoded_token=lp.decoded_token)
                                for t, lp in d.items() if t == tok or (lp.rank is not None and lp.rank <= num_top)}
            for tok, d in zip(out.prompt_token_ids, entries)]



class OutputFormatting:
    """Tokens, logprobs, usage and prompt text of engine outputs, as OpenAI's responses carry
    them. Needs `self.tokenizer` (the event loop's; None without one)."""

    def _token_str(self, token: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token])

    def _completion_logprobs(self, token_ids: list[int], lps: list, offset: int) -> tuple[CompletionLogProbs, int]:
        """OpenAI completions logprobs for tokens starting at text offset `offset` (output or,
        under echo, prompt tokens); also returns the offset after them."""
        out = CompletionLogProbs()
        for tok, d in zip(token_ids, lps):
            s = self._token_str(tok, d.get(tok) if d else None)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if not d:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(finite(d[tok].logprob) if tok in d else None)
            out.top_logprobs.append(top_logprobs_by_label(d, self._token_str))
        return out, offset

    def _chat_logprobs(self, token_ids: list[int], lps: list, num_top: int) -> ChatLogProbs:
        content = []
        for tok, d in zip(token_ids, lps):
            chosen = d.get(tok) if d else None
            s = self._token_str(tok, chosen)
            top = sorted(((t, lp) for t, lp in (d or {}).items() if lp.rank is not None and lp.rank <= num_top),
                         key=lambda item: item[1].rank)
            content.append(ChatTokenLogprob(
                token=s, logprob=finite(chosen.logprob) if chosen else -9999.0, bytes=list(s.encode()),
                top_logprobs=[TopLogprob(token=(ts := self._token_str(t, lp)), logprob=finite(lp.logprob),
                                         bytes=list(ts.encode())) for t, lp in top]))
        return ChatLogProbs(content=content)

    def _usage(self, job: Job, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in job.prompts)
        completion = 0 if job.drop_output else sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        # cached tokens once per prompt (RequestOutput.num_cached_tokens), like prompt_tokens, also with n > 1
        details = (PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in finals.values()))
                   if self.engine.prefix_caching else None)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=details)

    def _prompt_text(self, job: Job, index: int) -> str:
        text, ids = job.prompts[index]
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    @staticmethod
    async def _collect(stream: RequestStream) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in stream:
            if out.finished:
                finals[index] = out
        return finals

