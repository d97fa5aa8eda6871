"""OpenAI completions (POST /v1/completions) from engine outputs: the whole response, or its
server-sent events as the text grows (held back by the longest stop string less one character,
so that the streamed deltas add up to the non-streamed text)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mambaserve.entrypoints.async_engine import EngineError, RequestStream
from mambaserve.entrypoints.protocol_responses import CompletionChoice, CompletionLogProbs, CompletionResponse
from mambaserve.entrypoints.serving_common import (
    DONE,
    ApiError,
    ChoiceState,
    Job,
    OutputFormatting,
    prompt_logprobs_of,
    sse,
)
from mambaserve.outputs import CompletionOutput, RequestOutput


class CompletionServing(OutputFormatting):
    """The completions half of `OpenAIServing`."""

    def _completion_choice(self, job: Job, index: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        text, lps, offset = "", None, 0
        if job.echo:
            text = self._prompt_text(job, index)
            if job.num_top is not None:
                prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                lps, offset = self._completion_logprobs(out.prompt_token_ids, prompt_lps, 0)
        if not job.drop_output:
            text += c.text
            if job.num_top is not None:
                more, _ = self._completion_logprobs(c.token_ids, c.logprobs or [], offset)
                lps = more if lps is None else CompletionLogProbs(
                    **{k: getattr(lps, k) + getattr(more, k) for k in CompletionLogProbs.model_fields})
        return CompletionChoice(index=index * job.params.n + c.index, text=text, logprobs=lps,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                prompt_logprobs=None if job.prompt_top is None else
                                prompt_logprobs_of(out, job.prompt_top))

    async def completion_response(self, job: Job, stream: RequestStream) -> CompletionResponse:
        """The whole completion response, once every prompt's request has finished."""
        try:
            finals = await self._collect(stream)
        except EngineError as e:
            raise ApiError(e.status, str(e)) from None
        choices = [self._completion_choice(job, i, finals[i], c) for i in sorted(finals) for c in finals[i].outputs]
        return CompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=choices,
                                  usage=self._usage(job, finals))

    def _completion_delta(self, job: Job, index: int, out: RequestOutput, c: CompletionOutput,
                          st: ChoiceState) -> CompletionChoice | None:
        finished = c.finish_reason is not None
        if st.done or (len(c.token_ids) <= st.tokens_sent and not finished):
            return None  # nothing new (e.g. a prefill chunk)
        text, lps = "", None
        if job.echo and not st.started:
            text = self._prompt_text(job, index)
            if job.num_top is not None:
                prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                lps, st.offset = self._completion_logprobs(out.prompt_token_ids, prompt_lps, 0)
        st.started = True
        if not job.drop_output:
            end = max(st.text_sent, len(c.text))  # the engine holds back a stop string's possible start
            text += c.text[st.text_sent:end]
            st.text_sent = max(st.text_sent, end)
            if job.num_top is not None:
                new_ids, new_lps = c.token_ids[st.tokens_sent:], (c.logprobs or [])[st.tokens_sent:]
                more, st.offset = self._completion_logprobs(new_ids, new_lps, st.offset)
                lps = more if lps is None else CompletionLogProbs(
                    **{k: getattr(lps, k) + getattr(more, k) for k in CompletionLogProbs.model_fields})
        new_tokens = len(c.token_ids) > st.tokens_sent
        st.tokens_sent = len(c.token_ids)
        st.done = finished
        if not text and not finished and not (lps is not None and new_tokens):
            return None
        return CompletionChoice(index=index * job.params.n + c.index, text=text, logprobs=lps,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    async def completion_events(self, job: Job, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events of a streamed completion, ending with `data: [DONE]`."""
        states: dict[int, ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        try:
            async for index, out in stream:
                latest[index] = out
                if out.finished:
                    finals[index] = out
                choices = []
                for c in out.outputs:
                    st = states.setdefault(index * job.params.n + c.index, ChoiceState())
                    choice = self._completion_delta(job, index, out, c, st)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield sse(CompletionResponse(id=job.request_id, created=job.created, model=job.model,
                                                  choices=choices,
                                                  usage=self._usage(job, latest) if job.continuous_usage else None))
            if job.include_usage:
                yield sse(CompletionResponse(id=job.request_id, created=job.created, model=job.model,
                                              choices=[], usage=self._usage(job, finals)))
        except EngineError as e:
            yield f"data: {ApiError(e.status, str(e)).body().model_dump_json()}\n\n"
        finally:
            stream.abort()
        yield DONE

