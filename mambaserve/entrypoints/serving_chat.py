"""OpenAI chat completions (POST /v1/chat/completions) from engine outputs: the whole
response or its server-sent events, with the reply's tool calls (`tool_parsers`) as OpenAI
sends them, whole or streamed piece by piece."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mambaserve.entrypoints.async_engine import EngineError, RequestStream
from mambaserve.entrypoints.protocol_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from mambaserve.entrypoints.serving_common import (
    DONE,
    ApiError,
    ChoiceState,
    Job,
    OutputFormatting,
    prompt_logprobs_of,
    sse,
)
from mambaserve.entrypoints.tool_parsers import ToolCallStream, new_call_id
from mambaserve.outputs import RequestOutput


def _finish(job: Job, made_calls: bool, finish_reason: str | None) -> str | None:
    """"tool_calls" when the reply made calls of its own choice (tool_choice "auto" or "required")
    and ended by itself; a call of the function tool_choice named ends with "stop", as in
    OpenAI's API and vLLM."""
    chose = job.tools is not None and job.tools.mode != "named"
    return "tool_calls" if chose and made_calls and finish_reason == "stop" else finish_reason


def _tool_calls(job: Job, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish reason) of a whole chat reply (`_finish`)."""
    if job.tools is None:
        return text, [], finish_reason
    content, calls = job.tools.final(text)
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in calls]
    return content, tool_calls, _finish(job, bool(tool_calls), finish_reason)




class ChatServing(OutputFormatting):
    """The chat half of `OpenAIServing` (needs `self.response_role`)."""

    async def chat_response(self, job: Job, stream: RequestStream) -> ChatCompletionResponse:
        """The whole chat completion response, once the request has finished."""
        try:
            finals = await self._collect(stream)
        except EngineError as e:
            raise ApiError(e.status, str(e)) from None
        choices = []
        for c in finals[0].outputs:
            lps = self._chat_logprobs(c.token_ids, c.logprobs or [], job.num_top) if job.num_top is not None else None
            content, tool_calls, finish = _tool_calls(job, c.text, c.finish_reason)
            message = ChatResponseMessage(role=self.response_role, content=content, tool_calls=tool_calls)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=finish,
                                      stop_reason=c.stop_reason))
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=choices,
            usage=self._usage(job, finals),
            prompt_logprobs=None if job.prompt_top is None else prompt_logprobs_of(finals[0], job.prompt_top))

    async def chat_events(self, job: Job, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events of a streamed chat completion: a role chunk per choice, content
        deltas, a chunk with the finish reason, the usage chunk if asked, `data: [DONE]`."""
        def chunk(choices, usage=None):
            return sse(ChatCompletionChunk(id=job.request_id, created=job.created, model=job.model,
                                            choices=choices, usage=usage))

        states = [ChoiceState() for _ in range(job.params.n)]
        calls = [ToolCallStream(job.tools) if job.tools is not None else None for _ in range(job.params.n)]
        finals: dict[int, RequestOutput] = {}
        try:
            # the role chunk carries the usage so far too (the prompt's), as in vLLM
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=self.response_role, content=""))
                         for i in range(job.params.n)], self._usage(job, {}) if job.continuous_usage else None)
            async for index, out in stream:
                if out.finished:
                    finals[index] = out
                choices = []
                for c in out.outputs:
                    st = states[c.index]
                    finished = c.finish_reason is not None
                    if st.done or (len(c.token_ids) <= st.tokens_sent and not finished):
                        continue
                    end = max(st.text_sent, len(c.text))  # the engine holds back a stop string's possible start
                    text, deltas, finish = c.text[st.text_sent:end], None, c.finish_reason
                    st.text_sent = max(st.text_sent, end)
                    if calls[c.index] is not None:  # content up to the first call, then the calls' pieces
                        text, pieces = calls[c.index].update(c.text[:end], finished)
                        deltas = [DeltaToolCall(index=k, id=i, type="function" if i else None,
                                                function=DeltaFunctionCall(name=name, arguments=args))
                                  for k, i, name, args in pieces] or None
                        if finished:
                            finish = _finish(job, bool(calls[c.index].ids), finish)
                    lps = None
                    if job.num_top is not None and len(c.token_ids) > st.tokens_sent:
                        lps = self._chat_logprobs(c.token_ids[st.tokens_sent:], (c.logprobs or [])[st.tokens_sent:],
                                                  job.num_top)
                    st.tokens_sent, st.done = len(c.token_ids), finished
                    if text or deltas or finished or lps is not None:
                        choices.append(ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(content=text if text or not deltas else None,
                                                              tool_calls=deltas),
                            logprobs=lps, finish_reason=finish, stop_reason=c.stop_reason))
                if choices:
                    yield chunk(choices, self._usage(job, {0: out}) if job.continuous_usage else None)
            if job.include_usage:
                yield chunk([], self._usage(job, finals))
        except EngineError as e:
            yield f"data: {ApiError(e.status, str(e)).body().model_dump_json()}\n\n"
        finally:
            stream.abort()
        yield DONE


