"""The per-step forward context: batch metadata built once per step, read by every layer.

A step runs one forward pass over a packed batch: sequence i owns token rows
`query_start_loc[i]:query_start_loc[i+1]`. Decodes (one new token, with a state to continue
from) come first, prefills and prefill chunks after them. The context holds the batch twice:
as device tensors, which the kernels read, and as checked host arrays, from which the kernels'
launch plans (conv token blocks, SSD chunks, the attention work list) are built once per step
and shared by every layer (`conv_blocks`, `ssd_chunks`, `attention_plan`): no layer and no
kernel reads the device to plan its work. It also carries references to the cache tensors (one
(conv_states, ssm_states) pair per Mamba layer, one (k_cache, v_cache) pair per attention
layer), which the engine allocates once from the model's cache spec.

Speculative decoding's verify rows (`verify`): the last sequences of a step may each verify
drafts, k + 1 new tokens continuing from their slot's state. Attention takes them as any chunk;
a Mamba layer must keep the state after each of their positions, so it runs them as k + 1
one-token decode steps (`VerifyPlan.steps`), step j reading the state after position j - 1
(the slot itself for j = 0) and writing the state after position j into scratch state rows
(`layers.verify.run_state_op`): the slot is never written, and the engine later copies the
row of the last accepted position into it.

This module sits beneath layers/, models/ and engine/ and imports none of them (only the plan
builders of `mambaserve.ops`); it knows nothing about scheduling: `ForwardContext.build` takes
plain host lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mambaserve.ops import conv1d
from mambaserve.ops.attention import AttentionPlan, plan_paged_attention
from mambaserve.ops.common import pack_to_device, to_device
from mambaserve.ops.varlen import (
    NO_SAVES,
    SsdChunks,
    StateSaves,
    TokenBlocks,
    check_offsets,
    conv_token_blocks,
    ssd_chunks,
)


@dataclass
class VerifyStep:
    """Position j of the verify sequences that have one: rows (n,) int64, their token rows in
    the step; src (n,), the state rows they continue from (int64; for j = 0 the plan's int32
    slots themselves); ctx, a decode-only context of n sequences whose state_indices (int32)
    are the rows receiving the state after position j."""

    rows: torch.Tensor
    src: torch.Tensor
    ctx: ForwardContext


@dataclass
class VerifyPlan:
    """The trailing `num_seqs` sequences of a step that verify drafts: their `num_tokens` rows
    from token row `first_row` on. For the fused ops (`ops.causal_conv1d_verify`,
    `ops.ssd_state_verify`), as device tensors: query_start_loc (num_seqs + 1,) int32 over
    their rows, slots (num_seqs,) int32, state_rows (num_seqs, max positions) int32 (-1
    padding), token_seq (num_tokens,) int32. For a layer without them, `steps()`: position j
    of every sequence that has one as a one-token decode step (`VerifyStep`), built on first use."""

    num_seqs: int
    first_row: int
    num_tokens: int
    query_start_loc: torch.Tensor
    slots: torch.Tensor
    state_rows: torch.Tensor
    token_seq: torch.Tensor
    _host: tuple = field(repr=False, compare=False)  # (offsets, state rows, device, mamba caches)
    _steps: list[VerifyStep] | None = field(default=None, repr=False, compare=False)

    def steps(self) -> list[VerifyStep]:
        if self._steps is None:
            offsets, state_rows, device, caches = self._host
            self._steps = []
            for j in range(max(len(r) for r in state_rows)):
                seqs = [i for i in range(self.num_seqs) if len(state_rows[i]) > j]
                dst = [state_rows[i][j] for i in seqs]
                ctx = ForwardContext.build(query_lens=[1] * len(seqs), seq_lens=[1] * len(seqs), state_indices=dst,
                                           has_initial_state=[True] * len(seqs), block_tables=None, block_size=1,
                                           device=device, mamba_caches=caches)
                # position 0 (every sequence has one) continues from the slots, read from the
                # device tensor itself: a verify CUDA graph replays with other slots in it
                src = self.slots if j == 0 else _to([state_rows[i][j - 1] for i in seqs], device)
                self._steps.append(VerifyStep(_to(self.first_row + np.asarray([offsets[i] + j for i in seqs]), device),
                                              src, ctx))
        return self._steps


def _to(values, device, dtype=torch.int64) -> torch.Tensor:
    return to_device(torch.as_tensor(np.asarray(values), dtype=dtype), device)


@dataclass
class ForwardContext:
    """Metadata of one forward pass over a packed batch of `batch` sequences, `num_tokens` rows.

    query_start_loc: (batch + 1,) int32, row offsets of the sequences.
    seq_lens: (batch,) int32, context length of each sequence after this step (cached + new).
    state_indices: (batch,) int32, state slot of each sequence; -1 marks a padding entry.
    has_initial_state: (batch,) bool, False for a sequence whose first token is in this step.
    block_table: (batch, max_blocks) int32 KV block ids (padded with 0), or None without
        attention layers. slot_mapping: (num_tokens,) int64 KV slot of each new token, -1 = none.
    num_decodes: how many leading sequences are one-token decodes with an initial state
        (host value). num_tokens, max_query_len, max_seq_len: host values.
    query_start_loc_host: (batch + 1,) int64 numpy, the offsets on the host, checked on creation
        (non-negative, non-decreasing). seq_lens_host: (batch,) int64 numpy, the lengths the
        attention plan is built for (a decode graph's: the longest context it plans for).
    mamba_caches / kv_caches: the cache tensors, indexed by a layer's cache index.
    state_saves: prefix caching's state checkpoints inside this step's prefills
    (`ops.varlen.StateSaves`), which the Mamba layers hand to their prefill ops.
    verify: the verify sequences' plan (module docstring), or None.
    Raises ValueError on host copies that disagree with the batch or offsets that decrease.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    block_table: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    num_decodes: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: np.ndarray
    seq_lens_host: np.ndarray
    mamba_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    state_saves: StateSaves = NO_SAVES
    verify: VerifyPlan | None = None
    # the plans, built on first use and kept for the step (keyed by what each depends on)
    _prefill: ForwardContext | None = field(default=None, init=False, repr=False, compare=False)
    # the prefill part's device fields, copied with the step's own (16-byte aligned, unlike
    # slices after num_decodes entries: `ops.common.pack_to_device`), when `build` made them
    _prefill_fields: tuple | None = field(default=None, repr=False, compare=False)
    _main: ForwardContext | None = field(default=None, init=False, repr=False, compare=False)
    # conv blocks by `conv1d.config_version()` (a config override may change their block size)
    _conv_blocks: dict[int, TokenBlocks] = field(default_factory=dict, init=False, repr=False, compare=False)
    _ssd_chunks: dict[int, SsdChunks] = field(default_factory=dict, init=False, repr=False, compare=False)
    _attention_plans: dict[tuple[int, int, int], AttentionPlan] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        batch = self.state_indices.shape[0]
        self.query_start_loc_host = check_offsets(self.query_start_loc_host)
        self.seq_lens_host = np.asarray(self.seq_lens_host, dtype=np.int64)
        if self.query_start_loc_host.shape != (batch + 1,) or self.seq_lens_host.shape != (batch,):
            raise ValueError(f"host copies of {self.query_start_loc_host.size} offsets and {self.seq_lens_host.size} "
                             f"lengths for a batch of {batch}")
        self.state_saves.check(self.query_start_loc_host)

    @property
    def batch_size(self) -> int:
        return self.state_indices.shape[0]

    @property
    def decode_only(self) -> bool:
        """True when every sequence is a one-token decode (the decode kernels apply)."""
        return self.num_decodes == self.batch_size

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def prefill_part(self) -> ForwardContext:
        """The context of the sequences after the leading decodes, with rows renumbered from
        the first of them (row num_decodes of this step is their row 0): a layer that runs the
        decodes through one-step kernels runs the rest through this. Built once per step, so
        every layer shares it and the plans built in it."""
        if self._prefill is None:
            nd = self.num_decodes  # one row each
            if self._prefill_fields is not None:
                qsl, lens, indices, has_init, table, slots = self._prefill_fields
            else:
                qsl, lens, indices, has_init = (self.query_start_loc[nd:] - nd, self.seq_lens[nd:],
                                                self.state_indices[nd:], self.has_initial_state[nd:])
                table = None if self.block_table is None else self.block_table[nd:]
                slots = None if self.slot_mapping is None else self.slot_mapping[nd:]
            self._prefill = ForwardContext(
                query_start_loc=qsl, seq_lens=lens, state_indices=indices, has_initial_state=has_init,
                block_table=table, slot_mapping=slots,
                num_decodes=0, num_tokens=self.num_tokens - nd, max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len, query_start_loc_host=self.query_start_loc_host[nd:] - nd,
                seq_lens_host=self.seq_lens_host[nd:], mamba_caches=self.mamba_caches, kv_caches=self.kv_caches,
                state_saves=self.state_saves.shifted(nd, nd))
        return self._prefill

    def main_part(self) -> ForwardContext:
        """The context of the sequences before the verify ones (the whole step without verify
        rows): rows 0..verify.first_row - 1, its own plans. Built once per step."""
        if self.verify is None:
            return self
        if self._main is None:
            nm, rows = self.batch_size - self.verify.num_seqs, self.verify.first_row
            self._main = ForwardContext(
                query_start_loc=self.query_start_loc[: nm + 1], seq_lens=self.seq_lens[:nm],
                state_indices=self.state_indices[:nm], has_initial_state=self.has_initial_state[:nm],
                block_table=None if self.block_table is None else self.block_table[:nm],
                slot_mapping=None if self.slot_mapping is None else self.slot_mapping[:rows],
                num_decodes=min(self.num_decodes, nm), num_tokens=rows,
                max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                query_start_loc_host=self.query_start_loc_host[: nm + 1], seq_lens_host=self.seq_lens_host[:nm],
                mamba_caches=self.mamba_caches, kv_caches=self.kv_caches, state_saves=self.state_saves)
        return self._main

    def conv_blocks(self) -> TokenBlocks:
        """The token blocks of `ops.causal_conv1d` for this batch and its state saves (of the
        block size its launch config takes for this many tokens on this device), built on
        first use; later calls look nothing up unless a config override changed since."""
        version = conv1d.config_version()
        blocks = self._conv_blocks.get(version)
        if blocks is None:
            # the launcher looks its config up by the planned tokens (query_start_loc[-1]), which
            # padded rows past them do not change
            num_tokens = int(self.query_start_loc_host[-1]) if len(self.query_start_loc_host) else 0
            block_t = conv1d.varlen_block_t(conv1d.table_for(self.device), num_tokens)
            blocks = next((b for b in self._conv_blocks.values() if b.block_t == block_t), None)
            if blocks is None:
                blocks = conv_token_blocks(self.query_start_loc_host, block_t, self.device, self.state_saves)
            self._conv_blocks[version] = blocks
        return blocks

    def ssd_chunks(self, chunk_size: int) -> SsdChunks:
        """The chunks of `ops.ssd_chunk_scan` of `chunk_size` rows for this batch, built on first use."""
        chunks = self._ssd_chunks.get(chunk_size)
        if chunks is None:
            chunks = self._ssd_chunks[chunk_size] = ssd_chunks(self.query_start_loc_host, chunk_size, self.device,
                                                               self.state_saves)
        return chunks

    def attention_plan(self, group_size: int, num_kv_heads: int, block_size: int) -> AttentionPlan:
        """The work list of `ops.paged_attention` for this batch, for a layer of `group_size`
        query heads per kv head, num_kv_heads kv heads and KV pages of block_size tokens, built
        on first use (a decode graph builds it in its warm-up, outside the capture). Raises
        ValueError when seq_lens or the block table do not cover the new tokens."""
        key = (group_size, num_kv_heads, block_size)
        plan = self._attention_plans.get(key)
        if plan is None:
            if self.block_table is None:
                raise ValueError("this step has no block table (the model declared no attention layer)")
            plan = self._attention_plans[key] = plan_paged_attention(
                self.query_start_loc_host, self.seq_lens_host, group_size=group_size, num_kv_heads=num_kv_heads,
                block_size=block_size, table_width=self.block_table.shape[1], device=self.device)
        return plan

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        state_indices: list[int],
        has_initial_state: list[bool],
        block_tables: list[list[int]] | None,
        block_size: int,
        device: torch.device | str,
        mamba_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        pad_to: int | None = None,
        state_saves: list[tuple[int, int, int]] | None = None,
        verify_state_rows: list[list[int]] | None = None,
    ) -> ForwardContext:
        """Build the context from host lists, one entry per sequence (decodes first).

        query_lens[i] new tokens of sequence i end at position seq_lens[i] - 1. block_tables[i]
        must cover seq_lens[i] tokens when given. pad_to: the token count of a padded forward
        (piecewise graphs): slot_mapping gets -1 for the padding rows, which belong to no
        sequence. state_saves: (sequence, offset, state row) triples, sorted (`StateSaves`).
        verify_state_rows: one list per trailing verify sequence (speculative decoding), the
        scratch state rows receiving the state after each of its query_len positions.
        Raises ValueError on inconsistent lengths or saves outside their sequences.
        """
        n = len(query_lens)
        if not (len(seq_lens) == len(state_indices) == len(has_initial_state) == n):
            raise ValueError("query_lens, seq_lens, state_indices and has_initial_state must have one entry per "
                             "sequence")
        if any(q < 1 for q in query_lens) or any(s < q for q, s in zip(query_lens, seq_lens)):
            raise ValueError("every sequence needs at least one new token and seq_len >= query_len")
        num_decodes = 0
        for q, h in zip(query_lens, has_initial_state):
            if q == 1 and h:
                num_decodes += 1
            else:
                break
        offsets = [0]
        for q in query_lens:
            offsets.append(offsets[-1] + q)
        # the int32 fields go in one host buffer and one copy (pinned: `ops.common.to_device`)
        ints = [np.asarray(offsets), np.asarray(seq_lens), np.asarray(state_indices),
                np.asarray(has_initial_state, dtype=np.int64)]
        block_table = slot_mapping = None
        if block_tables is not None:
            width = max((len(b) for b in block_tables), default=0) or 1
            table = [b + [0] * (width - len(b)) for b in block_tables]
            parts = []
            for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
                blocks = block_tables[i]
                if -(-s // block_size) > len(blocks):
                    raise ValueError(f"block table of sequence {i} covers {len(blocks) * block_size} tokens, needs {s}")
                pos = np.arange(s - q, s)
                parts.append(np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
            if pad_to is not None:
                parts.append(np.full(pad_to - offsets[-1], -1, dtype=np.int64))
            slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            ints.append(np.asarray(table, dtype=np.int64).reshape(-1))
        # a step of decodes and prefills: the prefill part's fields too (`prefill_part`)
        nd = num_decodes if 0 < num_decodes < n else 0
        if nd:
            ints += [np.asarray(offsets[nd:]) - nd, *(a[nd:] for a in ints[1:4])]
            if block_tables is not None:
                ints.append(np.asarray(table[nd:], dtype=np.int64).reshape(-1))
        qsl, lens, indices, has_init, *rest = pack_to_device(ints, device)  # one copy, aligned views
        prefill_table = prefill_slots = None
        if block_tables is not None:
            block_table = rest.pop(0).view(n, width)
            slot_mapping, *more = pack_to_device([slots, slots[nd:]] if nd else [slots], device, torch.int64)
            if nd:
                prefill_table, prefill_slots = rest.pop().view(n - nd, width), more[0]
        prefill_fields = None
        if nd:
            prefill_fields = (rest[0], rest[1], rest[2], rest[3].bool(), prefill_table, prefill_slots)
        verify = None
        if verify_state_rows:
            verify = _verify_plan(verify_state_rows, offsets, query_lens, state_indices, device, mamba_caches)
        return cls(
            query_start_loc=qsl,
            seq_lens=lens,
            state_indices=indices,
            has_initial_state=has_init.bool(),
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            num_tokens=offsets[-1],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=np.asarray(offsets, dtype=np.int64),
            seq_lens_host=np.asarray(seq_lens, dtype=np.int64),
            mamba_caches=mamba_caches or [],
            kv_caches=kv_caches or [],
            state_saves=StateSaves(*map(tuple, zip(*[(i, o, r, offsets[i]) for i, o, r in state_saves])))
            if state_saves else NO_SAVES,
            verify=verify,
            _prefill_fields=prefill_fields,
        )


def _verify_plan(state_rows: list[list[int]], offsets: list[int], query_lens: list[int], state_indices: list[int],
                 device, mamba_caches) -> VerifyPlan:
    """The plan of the trailing len(state_rows) sequences (`VerifyPlan`)."""
    n, batch = len(state_rows), len(query_lens)
    first = batch - n
    if n > batch or any(len(r) != q for r, q in zip(state_rows, query_lens[first:])):
        raise ValueError("verify_state_rows needs one row per new token of each trailing verify sequence")
    local = [o - offsets[first] for o in offsets[first:]]
    slots = list(state_indices[first:])
    width = max(query_lens[first:])
    table = [r + [-1] * (width - len(r)) for r in state_rows]
    token_seq = [i for i, q in enumerate(query_lens[first:]) for _ in range(q)]
    # one host buffer, one copy (pinned: `ops.common.to_device`)
    qsl, slots_t, rows, seqs = pack_to_device([local, slots, np.asarray(table).reshape(-1), token_seq], device)
    return VerifyPlan(n, offsets[first], local[-1], qsl, slots_t, rows.view(n, width), seqs,
                      _host=(local, state_rows, device, mamba_caches))
