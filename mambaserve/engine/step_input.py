"""One forward as every rank runs it: `StepInput`, plain host data (picklable), and the messages
by which rank 0 hands it to the other tensor-parallel ranks.

Rank 0 schedules, builds the step's `StepInput` from the scheduled sequences and broadcasts it
(`share_step`) before running it; every other rank receives it (`receive`) and runs the same
forward, so that their collectives meet. The executor's own messages (build an engine, release
it, exit) go the same way (`share`). A chained decode step (async scheduling) takes
its input tokens from the previous step's sampling, still on rank 0's device: they follow the
description as one device broadcast, in stream order (the host never waits for them).

At tensor_parallel_size 1 nothing is sent. This module knows nothing of sequences or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaserve.distributed import TensorParallelGroup, broadcast, broadcast_object


@dataclass
class StepInput:
    """One forward over a packed batch, sequences in scheduled order (decodes first).

    token_ids: the new tokens, packed (num_tokens,); empty for a chained decode, whose tokens
    are rows `token_rows` (None: 0..batch-1) of the previous step's device tensor of
    `device_tokens` entries. positions: of each new token (num_tokens,). query_lens, state_slots:
    per sequence. block_tables: per sequence, or None without attention layers. sample_rows:
    the rows whose logits are sampled, in order; prompt_rows: (first row, rows) of each prompt
    slice whose logits are wanted (prompt logprobs), in order. checkpoint_loads: (checkpoint
    row, slot) pairs of prefix caching, each checkpoint's state copied into the slot before
    the forward; checkpoint_saves: (slot, checkpoint row) pairs, copied after it (rows of the
    same state tensors: `cache.checkpoint_pool`); state_saves: (sequence, offset, checkpoint
    row) triples, checkpoints the Mamba layers write inside a prefill chunk during the forward
    (`ForwardContext.state_saves`). Every rank applies them to its own shard.
    verify_state_rows: speculative decoding, one list per trailing sequence that verifies drafts,
    the state rows receiving its state after each new token (`ForwardContext.verify`).
    """

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    state_slots: list[int]
    block_tables: list[list[int]] | None
    sample_rows: list[int]
    prompt_rows: list[tuple[int, int]]
    device_tokens: int | None = None
    token_rows: list[int] | None = None
    checkpoint_loads: list[tuple[int, int]] = field(default_factory=list)
    checkpoint_saves: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    verify_state_rows: list[list[int]] = field(default_factory=list)

    @property
    def starts(self) -> list[int]:
        """Per sequence: the position of its first new token (the tokens already computed)."""
        starts, row = [], 0
        for n in self.query_lens:
            starts.append(self.positions[row])
            row += n
        return starts

    @property
    def one_token_each(self) -> bool:
        """One new token with a state per sequence (decodes, or one-token chunks of prompts):
        the forward context's decode_only, which the full decode graphs run."""
        return all(n == 1 for n in self.query_lens) and all(p > 0 for p in self.positions)


def share_step(step: StepInput, tokens: torch.Tensor | None, group: TensorParallelGroup) -> None:
    """Rank 0: send the step (and, for a chained decode, its device tokens) to the other ranks."""
    if group.world_size == 1:
        return
    broadcast_object(step, group)
    if step.device_tokens is not None:
        assert tokens is not None and tokens.shape == (step.device_tokens,), "a chained decode sends its tokens"
        broadcast(tokens.contiguous(), group)


def share(message, group: TensorParallelGroup) -> None:
    """Rank 0: send the other ranks a picklable message that is not a step (the executor's)."""
    if group.world_size > 1:
        broadcast_object(message, group)


def receive(group: TensorParallelGroup, device: torch.device):
    """Ranks above 0: wait for rank 0's next message: a step, as (StepInput, its device tokens
    or None), or whatever else rank 0 `share`d."""
    message = broadcast_object(None, group)
    if not isinstance(message, StepInput):
        return message
    tokens = None
    if message.device_tokens is not None:
        tokens = broadcast(torch.empty(message.device_tokens, dtype=torch.int64, device=device), group)
    return message, tokens
