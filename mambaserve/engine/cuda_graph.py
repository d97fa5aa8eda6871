"""Full CUDA graphs for decode-only steps: one graph of the whole forward (and the logits) per
captured batch size, replayed with persistent input buffers.

At batch 1 a decode step is hundreds of small kernels and the host cannot launch them as fast
as the GPU runs them; a graph replay launches them all at once. Everything a replay reads lives
in buffers allocated once: token ids, positions, state indices, sequence lengths, block tables,
slot mapping. A real batch of b sequences runs in the smallest captured size >= b; the padding
rows have state index -1 (no state read or written) and slot -1 (no KV written), so they never
touch a real request's state. The context's launch plan (the attention work list, from host
copies planned for plan_len-token contexts) is built in the warm-up run before capture and is
valid for any context length (the kernels read the lengths from the buffers); the Mamba
layers' decode kernels need none. Captured sizes never exceed the number of usable state
slots. The capture loop and the padded-size lookup are `graph_capture.CapturedSizes`.
"""

from __future__ import annotations

import numpy as np
import torch

from mambaserve.engine.graph_capture import CapturedSizes
from mambaserve.forward_context import ForwardContext


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, every 32 up to 512, every 64 beyond, up to
    max_num_seqs (vLLM's spacing where it captures; a padded row of a large batch is cheap)."""
    sizes = ([s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, min(max_num_seqs, 256) + 1, 16))
             + list(range(288, min(max_num_seqs, 512) + 1, 32)) + list(range(576, max_num_seqs + 1, 64)))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphRunner(CapturedSizes):
    """Captures and replays decode-only forwards for a fixed set of batch sizes."""

    def __init__(self, model, caches, *, sizes: list[int], max_model_len: int, block_size: int,
                 has_attention: bool, device: torch.device):
        super().__init__(sizes, device)
        self.model = model
        self.block_size = block_size
        self.has_attention = has_attention
        n = self.max_size
        self.max_blocks = -(-max_model_len // block_size)
        # Captured kernels plan for this context length; they read the real lengths at replay.
        self.plan_len = min(max_model_len, 8192)
        i32 = dict(dtype=torch.int32, device=device)
        # The per-step inputs live in two device buffers (int64: token ids, positions, KV slots;
        # int32: state indices, sequence lengths) filled from pinned host mirrors by one copy
        # each, padding rows included: a step costs two small copies, not one per input.
        self._i64 = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(2, n, **i32)
        self.input_ids, self.positions, self.slot_mapping = self._i64[0], self._i64[1], self._i64[2]
        self.state_indices, self.seq_lens = self._i32[0], self._i32[1]
        pin = device.type == "cuda"
        self._host_i64 = torch.zeros(3, n, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(2, n, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # the host mirrors may be rewritten
        self._host_table = torch.zeros(n, self.max_blocks if has_attention else 1, dtype=torch.int32, pin_memory=pin)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.block_table = torch.zeros(n, self.max_blocks if has_attention else 1, **i32)
        self.caches = caches
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, ForwardContext] = {}

    def _context(self, bs: int) -> ForwardContext:
        return ForwardContext(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            state_indices=self.state_indices[:bs], has_initial_state=self.has_initial_state[:bs],
            block_table=self.block_table[:bs] if self.has_attention else None,
            slot_mapping=self.slot_mapping[:bs] if self.has_attention else None,
            num_decodes=bs, num_tokens=bs, max_query_len=1, max_seq_len=self.plan_len,
            # the attention plan is built for plan_len-token contexts: the kernels read the real
            # lengths from the buffers at replay
            query_start_loc_host=np.arange(bs + 1), seq_lens_host=np.full(bs, self.plan_len),
            mamba_caches=self.caches.mamba, kv_caches=self.caches.kv,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first (smaller ones reuse its memory pool).

        During capture every row is padding (state index -1, slot -1): no state is touched.
        """
        self._reset_padding(0)
        self.capture_all(self._capture_one, "decode CUDA graphs (batch sizes)")

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
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    def _reset_padding(self, start: int) -> None:
        self.state_indices[start:].fill_(-1)
        self.slot_mapping[start:].fill_(-1)
        self.seq_lens[start:].fill_(1)
        self.input_ids[start:].zero_()
        self.positions[start:].zero_()

    @torch.inference_mode()
    def run(self, ids: list[int] | None, positions: list[int], state_indices: list[int],
            block_tables: list[list[int]] | None, device_ids: tuple[torch.Tensor, list[int] | None] | None = None
            ) -> torch.Tensor:
        """Replay the decode graph for len(positions) one-token sequences; returns their float32
        logits (batch, vocab). positions[i] is the new token's position (= tokens before it).

        The input tokens are `ids` (host), or, with ids=None, device_ids = (tokens, rows): row
        rows[i] of the (m,) int64 device tensor `tokens` (rows None: row i), read in stream
        order, so that a step can take the tokens the previous step sampled before the host
        has seen them. Nothing here waits for the device, except for the previous step's input
        copies to have left the pinned host buffers."""
        b = len(positions)
        bs = self.padded_size(b)
        assert bs is not None, "batch larger than the largest captured size"
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the mirrors
        h64, h32 = self._host_i64.numpy(), self._host_i32.numpy()
        pos = np.asarray(positions, dtype=np.int64)
        if ids is not None:
            h64[0, :b] = ids
        elif device_ids[1] is not None:
            h64[0, :b] = device_ids[1]  # staged as indices into the device tokens
        h64[1, :b] = pos
        h32[0, :b], h32[1, :b] = state_indices, pos + 1
        # padding rows: token 0 at position 0, no state (-1), no KV slot (-1), length 1
        h64[0:2, b:bs], h64[2, b:bs], h32[0, b:bs], h32[1, b:bs] = 0, -1, -1, 1
        if self.has_attention:
            # numpy rows from lists: a few microseconds per sequence, where torch rows cost tens
            width = max(len(t) for t in block_tables)
            table = self._host_table.numpy()[:b, :width]  # pinned: the copy below does not block
            table[:] = 0
            for i, t in enumerate(block_tables):
                table[i, : len(t)] = t
            page = table[np.arange(b), pos // self.block_size].astype(np.int64)
            h64[2, :b] = page * self.block_size + pos % self.block_size
            self.block_table[:b, :width].copy_(self._host_table[:b, :width], non_blocking=True)
        else:
            h64[2, :b] = -1
        self._i64.copy_(self._host_i64, non_blocking=True)  # whole buffers: one contiguous copy each
        self._i32.copy_(self._host_i32, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if ids is None:
            tokens, rows = device_ids
            picked = tokens[:b] if rows is None else tokens.index_select(0, self.input_ids[:b])
            self.input_ids[:b].copy_(picked)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
