"""One request's bookkeeping: its tokens, how many of them the caches already hold, its state
slot and KV blocks, its status and why it finished.

A sequence's tokens are `prompt_token_ids + output_token_ids`. The uncomputed ones,
`all_token_ids[num_computed_tokens:]`, are what the scheduler hands to the model, in chunks,
until `num_computed_tokens == num_tokens`; the engine then samples one token, which makes the
sequence one token short again (a decode). Preemption by recompute sets `num_computed_tokens`
back to 0, so prompt and outputs so far are prefilled again from an empty state.

This module holds no tensors except the lazily created per-request `torch.Generator`, and knows
nothing about models, tokenizers or scheduling policy.
"""

from __future__ import annotations

import enum
import time

import torch

from mambaserve.sampling_params import Logprob, SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, in the running batch, or finished (and why)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" for a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A request's tokens and the engine's bookkeeping for it.

    Fields (all public, mutated by the scheduler and the engine):
    request_id, prompt (text or None), prompt_token_ids, output_token_ids, sampling_params,
    arrival_time (time.time() at creation unless given), status, num_computed_tokens (tokens
    whose effect is already in the state slot / KV blocks), state_slot (index into the conv and
    SSM state pools, None while not running), block_table (KV block ids covering the computed
    tokens in order), finish_reason ("stop" | "length" | "abort" | None), stop_reason (the stop
    token id or stop string that ended it, None for EOS or no stop), output_logprobs (one dict
    per output token when logprobs were requested), prompt_logprobs (filled by the engine when
    requested; the first entry is None since the first token has no context), generator (the
    request's own RNG when it has a seed; created by the sampler on the logits' device),
    num_preemptions, num_prompt_tokens_counted (the prompt tokens `EngineStats` has counted as
    computed: a recompute after preemption counts only those beyond them), num_cached_tokens
    (prompt tokens served from the prefix cache when it was first admitted: 0 without a hit;
    kept as first set for the life of the request, after a preemption too, as vLLM's
    `num_cached_tokens`). Prefix-cache bookkeeping of the scheduler:
    block_hashes (keys of the full hash blocks of all_token_ids so far, `cache.prefix_cache`,
    under the root of cache_salt: vLLM's, only requests with the same salt share a prefix),
    num_registered_blocks (blocks of block_table registered in the cache), checkpoint_positions
    (where the prefill ends a chunk to take a state checkpoint, increasing). spec_token_ids:
    speculative decoding's drafts for the next step (set by the engine before it schedules;
    empty when it proposes none).
    """

    def __init__(
        self,
        request_id: str,
        *,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.state_slot: int | None = None
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.num_prompt_tokens_counted = 0
        self.num_cached_tokens = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.num_registered_blocks = 0
        self.checkpoint_positions: list[int] = []
        self.spec_token_ids: list[int] = []

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the caches: all_token_ids[num_computed_tokens:]."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one uncomputed token remains (a prompt, a chunk of one, or a
        recompute after preemption); False for a decode (exactly one uncomputed token)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step needs one
        token of a possibly long context)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int, logprobs_dict: dict[int, Logprob] | None = None) -> None:
        """Add a sampled token (and its logprobs, if requested).

        The engine calls this after adding the step's chunk to num_computed_tokens: a token can
        only be sampled once every earlier token is computed.
        """
        assert self.num_computed_tokens == self.num_tokens, (
            f"{self.request_id}: sampled with {self.num_uncomputed_tokens} tokens uncomputed"
        )
        self.output_token_ids.append(token_id)
        if logprobs_dict is not None:
            self.output_logprobs.append(logprobs_dict)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"slot={self.state_slot}, blocks={len(self.block_table)})"
        )
