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
    """A request's state after a step: prompt, its completions so far, and whether it is done.

    num_cached_tokens (vLLM's field): prompt tokens served from the prefix cache when the
    request was admitted, i.e. not computed for it (0 without a hit, or with prefix caching
    off). With n > 1 it is the count of the first completion's sequence (each of the n
    sequences is looked up at its own admission; the prompt counts once, as in the OpenAI
    usage's prompt_tokens). Set at the first admission and kept after a preemption.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0
