"""Full CUDA graphs for uniform steps: one graph of the whole forward (and the logits) per
captured batch size, replayed with persistent input buffers. Decode-only steps (one new token
per sequence) run in them, and so do speculative decoding's uniform verify steps (every
sequence verifies k drafts: k + 1 new tokens each, `query_len`).

At batch 1 a decode step is hundreds of small kernels and the host cannot launch them as fast
as the GPU runs them; a graph replay launches them all at once. Everything a replay reads lives
in buffers allocated once: token ids, positions, state indices, sequence lengths, block tables,
slot mapping. A real batch of b sequences runs in the smallest captured size >= b; the padding
rows have slot -1 (no KV written) and state index -1 (no state read or written; a verify
graph's padding reads the reserved scratch slot instead, since its kernels read a slot per
sequence, and writes only its own scratch rows), so they never touch a real request's state.
The context's launch plan (the attention work list, from host copies planned for
plan_len-token contexts) is built in the warm-up run before capture and is valid for any
context length (the kernels read the lengths and offsets from the buffers); the Mamba layers'
decode and verify kernels need none (a verify graph's state rows are fixed per batch row:
sequence i keeps the state after its position j in row base + i * stride + j, as
`ModelRunner.prepare` assigns them). Captured sizes never exceed the number of usable state
slots (and, for verify graphs, the scratch rows). The capture loop and the padded-size lookup
are `graph_capture.CapturedSizes`. Without CUDA (tests) nothing is captured: a "replay" runs
the same forward over the same buffers eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from mambaserve.engine.graph_capture import CapturedSizes
from mambaserve.forward_context import ForwardContext, VerifyPlan


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, every 32 up to 512, every 64 beyond, up to
    max_num_seqs (vLLM's spacing where it captures; a padded row of a large batch is cheap)."""
    sizes = ([s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, min(max_num_seqs, 256) + 1, 16))
             + list(range(288, min(max_num_seqs, 512) + 1, 32)) + list(range(576, max_num_seqs + 1, 64)))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def capture_full_graphs(model, caches, *, sizes: list[int] | None, max_num_seqs: int, max_model_len: int,
                        block_size: int, has_attention: bool, device: torch.device,
                        verify: tuple[int, int, int, int] | None = None
                        ) -> tuple[DecodeGraphRunner, dict[int, DecodeGraphRunner]]:
    """The decode graphs (sizes: the configured batch sizes, None for `default_capture_sizes`;
    a captured batch never exceeds max_num_seqs, the usable state slots) and, with speculative
    decoding, the verify graphs: verify = (k + 1, the first scratch state row, the most
    sequences that verify in a step, the scratch slot that padding reads), one set per number
    of new tokens 2..k + 1 (a proposer may find fewer than k drafts), up to that many
    sequences. Returns (decode graphs, {tokens per sequence: verify graphs}), all captured."""
    sizes = sorted({min(int(s), max_num_seqs) for s in (sizes or default_capture_sizes(max_num_seqs))})
    common = dict(max_model_len=max_model_len, block_size=block_size, has_attention=has_attention, device=device)
    decode = DecodeGraphRunner(model, caches, sizes=sizes, **common)
    decode.capture()
    verify_graphs = {}
    if verify is not None:
        stride, base, max_seqs, pad_slot = verify
        for q in range(stride, 1, -1):
            verify_graphs[q] = DecodeGraphRunner(model, caches, sizes=sorted({min(s, max_seqs) for s in sizes}),
                                                 query_len=q, verify_rows=(base, stride), pad_slot=pad_slot, **common)
            verify_graphs[q].pool = decode.pool  # one memory pool for all the full graphs
            verify_graphs[q].capture()
    return decode, verify_graphs


class DecodeGraphRunner(CapturedSizes):
    """Captures and replays uniform forwards for a fixed set of batch sizes: decode-only steps
    (query_len 1), or verify-only steps of query_len = k + 1 tokens per sequence, whose state
    rows start at verify_rows = (base, stride) (`ModelRunner.prepare`) and whose padding rows
    read state slot pad_slot. Raises ValueError for query_len > 1 without verify_rows."""

    def __init__(self, model, caches, *, sizes: list[int], max_model_len: int, block_size: int,
                 has_attention: bool, device: torch.device, query_len: int = 1,
                 verify_rows: tuple[int, int] | None = None, pad_slot: int = -1):
        super().__init__(sizes, device)
        if query_len > 1 and verify_rows is None:
            raise ValueError("a graph of several tokens per sequence is a verify graph: it needs verify_rows")
        self.model = model
        self.block_size = block_size
        self.has_attention = has_attention
        self.query_len = q = query_len
        self.verify_rows = verify_rows if q > 1 else None
        self.pad_slot = pad_slot if q > 1 else -1
        n = self.max_size
        self.max_blocks = -(-max_model_len // block_size)
        # Captured kernels plan for this context length; they read the real lengths at replay.
        self.plan_len = min(max_model_len, 8192)
        i32 = dict(dtype=torch.int32, device=device)
        # The per-step inputs live in two device buffers (int64, one entry per token: token ids,
        # positions, KV slots; int32, one per sequence: state indices, sequence lengths) filled
        # from pinned host mirrors by one copy each, padding rows included: a step costs two
        # small copies, not one per input.
        self._i64 = torch.zeros(3, n * q, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(2, n, **i32)
        self.input_ids, self.positions, self.slot_mapping = self._i64[0], self._i64[1], self._i64[2]
        self.state_indices, self.seq_lens = self._i32[0], self._i32[1]
        pin = device.type == "cuda"
        self._host_i64 = torch.zeros(3, n * q, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(2, n, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # the host mirrors may be rewritten
        self._host_table = torch.zeros(n, self.max_blocks if has_attention else 1, dtype=torch.int32, pin_memory=pin)
        self.query_start_loc = torch.arange(0, (n + 1) * q, q, **i32)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.block_table = torch.zeros(n, self.max_blocks if has_attention else 1, **i32)
        if self.verify_rows is not None:  # (n, q): row j of sequence i keeps the state after its position j
            base, stride = self.verify_rows
            self._state_rows_host = base + stride * np.arange(n)[:, None] + np.arange(q)[None, :]
            self.state_rows = torch.as_tensor(self._state_rows_host, **i32)
            self.token_seq = torch.as_tensor(np.repeat(np.arange(n), q), **i32)
        self.caches = caches
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, ForwardContext] = {}

    def _context(self, bs: int) -> ForwardContext:
        q, rows = self.query_len, bs * self.query_len
        verify = None
        if self.verify_rows is not None:
            offsets = list(range(0, rows + 1, q))
            verify = VerifyPlan(bs, 0, rows, self.query_start_loc[: bs + 1], self.state_indices[:bs],
                                self.state_rows[:bs], self.token_seq[:rows],
                                _host=(offsets, self._state_rows_host[:bs].tolist(), self.device, self.caches.mamba))
        return ForwardContext(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            state_indices=self.state_indices[:bs], has_initial_state=self.has_initial_state[:bs],
            block_table=self.block_table[:bs] if self.has_attention else None,
            slot_mapping=self.slot_mapping[:rows] if self.has_attention else None,
            num_decodes=bs if q == 1 else 0, num_tokens=rows, max_query_len=q, max_seq_len=self.plan_len,
            # the attention plan is built for plan_len-token contexts: the kernels read the real
            # lengths from the buffers at replay
            query_start_loc_host=np.arange(bs + 1) * q, seq_lens_host=np.full(bs, self.plan_len),
            mamba_caches=self.caches.mamba, kv_caches=self.caches.kv, verify=verify,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first (smaller ones reuse its memory pool).

        During capture every row is padding (state index -1 or the pad slot, KV slot -1): no
        real state is touched. Without CUDA, only the warm-up runs (nothing to capture).
        """
        self._reset_padding(0)
        if self.device.type != "cuda":
            for bs in reversed(self.sizes):
                ctx = self._context(bs)
                self.graphs[bs], self.outputs[bs], self.contexts[bs] = None, self._forward(bs, ctx), ctx
            return
        what = "decode" if self.query_len == 1 else f"verify ({self.query_len} tokens per sequence)"
        self.capture_all(self._capture_one, f"{what} CUDA graphs (batch sizes)")

    def _capture_one(self, bs: int, stream: torch.cuda.Stream) -> None:
        ctx = self._context(bs)
        self.warm_up(lambda: self._forward(bs, ctx), times=2)  # also builds the context's plans
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self._forward(bs, ctx)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs], self.outputs[bs], self.contexts[bs] = graph, out, ctx

    def _forward(self, bs: int, ctx: ForwardContext) -> torch.Tensor:
        rows = bs * self.query_len
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], ctx)
        return self.model.compute_logits(hidden)

    def _reset_padding(self, start: int) -> None:
        q = self.query_len
        self.state_indices[start:].fill_(self.pad_slot)
        self.slot_mapping[start * q:].fill_(-1)
        self.seq_lens[start:].fill_(q)
        self.input_ids[start * q:].zero_()
        self.positions[start * q:].copy_(torch.arange(q, device=self.device).repeat(self.max_size - start))

    @torch.inference_mode()
    def run(self, ids: list[int] | None, positions: list[int], state_indices: list[int],
            block_tables: list[list[int]] | None, device_ids: tuple[torch.Tensor, list[int] | None] | None = None
            ) -> torch.Tensor:
        """Replay the graph for len(state_indices) sequences of query_len new tokens each;
        returns the float32 logits of every new token (batch * query_len, vocab), sequence by
        sequence. positions: of every new token, packed (a decode's = the tokens before it);
        a sequence's positions must be consecutive.

        The input tokens are `ids` (host, packed), or, with ids=None (decode graphs only),
        device_ids = (tokens, rows): row rows[i] of the (m,) int64 device tensor `tokens`
        (rows None: row i), read in stream order, so that a step can take the tokens the
        previous step sampled before the host has seen them. Nothing here waits for the
        device, except for the previous step's input copies to have left the pinned host buffers."""
        q = self.query_len
        b = len(state_indices)
        bs = self.padded_size(b)
        assert bs is not None, "batch larger than the largest captured size"
        assert len(positions) == b * q and (ids is not None or q == 1), "one query_len block of tokens per sequence"
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the mirrors
        h64, h32 = self._host_i64.numpy(), self._host_i32.numpy()
        pos = np.asarray(positions, dtype=np.int64)
        rows, pad = b * q, bs * q
        if ids is not None:
            h64[0, :rows] = ids
        elif device_ids[1] is not None:
            h64[0, :rows] = device_ids[1]  # staged as indices into the device tokens
        h64[1, :rows] = pos
        h32[0, :b], h32[1, :b] = state_indices, pos[q - 1::q] + 1
        # padding rows: tokens 0 at positions 0..q-1, the pad state, no KV slot (-1), length q
        h64[0, rows:pad], h64[1, rows:pad], h64[2, rows:pad] = 0, np.tile(np.arange(q), bs - b), -1
        h32[0, b:bs], h32[1, b:bs] = self.pad_slot, q
        if self.has_attention:
            # numpy rows from lists: a few microseconds per sequence, where torch rows cost tens
            width = max(len(t) for t in block_tables)
            table = self._host_table.numpy()[:b, :width]  # pinned: the copy below does not block
            table[:] = 0
            for i, t in enumerate(block_tables):
                table[i, : len(t)] = t
            page = table[np.repeat(np.arange(b), q), pos // self.block_size].astype(np.int64)
            h64[2, :rows] = page * self.block_size + pos % self.block_size
            self.block_table[:b, :width].copy_(self._host_table[:b, :width], non_blocking=True)
        else:
            h64[2, :rows] = -1
        self._i64.copy_(self._host_i64, non_blocking=True)  # whole buffers: one contiguous copy each
        self._i32.copy_(self._host_i32, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if ids is None:
            tokens, rows_ = device_ids
            picked = tokens[:b] if rows_ is None else tokens.index_select(0, self.input_ids[:b])
            self.input_ids[:b].copy_(picked)
        graph = self.graphs[bs]
        if graph is None:  # no CUDA: the same forward over the same buffers, eagerly
            self.outputs[bs] = self._forward(bs, self.contexts[bs])
        else:
            graph.replay()
        return self.outputs[bs][:rows]
