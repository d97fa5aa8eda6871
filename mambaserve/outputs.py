"""What `generate` and the engine's `step` return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from mambaserve.sampling_params import Logprob


@dataclass
class CompletionOutput:
    """One of the n completions of a request. logprobs: one dict per token when asked for."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: prompt, its completions so far, and whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
