"""Piecewise CUDA graphs for mixed prefill/decode steps of up to a few hundred tokens.

For each captured token count T, one forward is recorded as a chain: graph 0, hole 0, graph 1,
hole 1, ... The holes are the split ops of `mambaserve.layers.graph_split` (the Mamba mixer's
conv + scan, attention's cache write + paged attention): they depend on the step's launch
plans, so at replay they run eagerly with the real step's context, reading their inputs
from, and writing their outputs to, the fixed buffers the neighbouring graphs use. Everything
else (embeddings, projections, norms, MoE, residuals, logits) replays as graphs.

A step of t <= T tokens runs in the smallest captured T; rows t..T-1 belong to no sequence
(their KV slot is -1, no state is read or written for them) and their outputs are dropped.
Steps larger than the largest captured count (over 8,192 tokens) run eagerly. The capture
loop and the padded-size lookup are `graph_capture.CapturedSizes`.
"""

from __future__ import annotations

import torch

from mambaserve.engine.graph_capture import CapturedSizes
from mambaserve.forward_context import ForwardContext
from mambaserve.layers import graph_split


def default_piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 8 and 16, then four sizes per doubling (16, 24, 32, 40 ... 8,192:
    a step's padding is under a fifth of its size) and max_tokens itself when it is at most 8,192.
    Fine steps matter: a throughput run's mixed steps (the running decodes plus one new prompt)
    land anywhere between 64 and 1,024 tokens, and padded rows cost full matrix products.
    Large steps are captured too: an eager 1,024-token step of a 40-layer hybrid spends several
    times its GPU time launching kernels from Python."""
    sizes, base = [8], 16
    while base < 8192:
        sizes += [base, base * 5 // 4, base * 3 // 2, base * 7 // 4]
        base *= 2
    sizes.append(8192)
    chosen = [s for s in sizes if s <= max_tokens]
    if max_tokens <= sizes[-1] and max_tokens not in chosen:
        chosen.append(max_tokens)
    return chosen


class _Piece:
    """One captured forward at a fixed token count: graphs interleaved with eager holes."""

    def __init__(self):
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.holes: list[tuple] = []  # (fn, args, out buffer)
        self.output: torch.Tensor | None = None


class _Recorder:
    def __init__(self, piece: _Piece, pool, ctx: ForwardContext, buffers: dict):
        self.piece, self.pool, self.ctx, self.buffers = piece, pool, ctx, buffers
        self.current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.current.capture_end()
        self.piece.graphs.append(self.current)
        self.current = None

    def hole(self, fn, args, ctx):
        # The hole's tensor inputs are copied, inside the graph being captured, into buffers
        # shared by every hole with that input shape. Holding the graph's own tensors instead
        # would pin each layer's input for as long as the graphs live (a 9B hybrid at 8,192
        # tokens: 29 in_proj outputs of 300 MB each, for every captured size).
        staged = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                key = ("in", i, tuple(a.shape), a.dtype)
                if key not in self.buffers:
                    self.buffers[key] = torch.empty(a.shape, dtype=a.dtype, device=a.device)
                self.buffers[key].copy_(a)
                a = self.buffers[key]
            staged.append(a)
        args = tuple(staged)
        self.end()
        # Run the hole once for real (outside any capture) to learn its output's shape.
        result = fn(*args, ctx)
        key = ("out", tuple(result.shape), result.dtype)
        if key not in self.buffers:
            # Holes run one after the other and each output is read by the next graph before
            # the next hole writes: one buffer per shape serves every layer.
            self.buffers[key] = torch.empty_like(result)
        out = self.buffers[key]
        out.copy_(result)
        self.piece.holes.append((fn, args, out))
        self.begin()
        return out


class PiecewiseGraphRunner(CapturedSizes):
    """Captures forwards (hidden states -> all-row logits are NOT included) per token count."""

    def __init__(self, model, caches, *, sizes: list[int], block_size: int, has_attention: bool,
                 device: torch.device):
        super().__init__(sizes, device)
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.has_attention = has_attention
        self.input_ids = torch.zeros(self.max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_size, dtype=torch.int64, device=device)
        self.pieces: dict[int, _Piece] = {}
        self._buffers: dict = {}  # the split points' staged inputs and outputs, shared by all sizes

    def _capture_context(self, T: int) -> ForwardContext:
        """One sequence of T new tokens on padding slots: nothing is read from or written to a cache."""
        blocks = -(-T // self.block_size)
        ctx = ForwardContext.build(
            query_lens=[T], seq_lens=[T], state_indices=[-1], has_initial_state=[False],
            block_tables=[[0] * blocks] if self.has_attention else None, block_size=self.block_size,
            device=self.device, mamba_caches=self.caches.mamba, kv_caches=self.caches.kv)
        if ctx.slot_mapping is not None:
            ctx.slot_mapping.fill_(-1)
        return ctx

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one chained forward per size, largest first (one shared memory pool); every
        row is padding during capture (state index -1, KV slot -1): no cache is touched."""
        self.pool = torch.cuda.graph_pool_handle()
        self._buffers = {}
        self.capture_all(self._capture_one, "piecewise CUDA graphs (token counts)")

    def _capture_one(self, T: int, stream: torch.cuda.Stream) -> None:
        ctx = self._capture_context(T)
        self.warm_up(lambda: self.model(self.input_ids[:T], self.positions[:T], ctx))  # compiles kernels
        torch.cuda.empty_cache()  # the warm-up's blocks back to the driver, for the graph pool
        piece = _Piece()
        recorder = _Recorder(piece, self.pool, ctx, self._buffers)
        graph_split.set_recorder(recorder)
        try:
            recorder.begin()
            piece.output = self.model(self.input_ids[:T], self.positions[:T], ctx)
            recorder.end()
        finally:
            graph_split.set_recorder(None)
        self.pieces[T] = piece

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Forward of a step whose ctx was built with pad_to=padded_size(len(input_ids)).
        Returns the hidden states of the real rows (len(input_ids), hidden)."""
        t = input_ids.shape[0]
        T = self.padded_size(t)
        piece = self.pieces[T]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        if T > t:
            self.input_ids[t:T].zero_()
            self.positions[t:T].zero_()
        piece.graphs[0].replay()
        for (fn, args, out), graph in zip(piece.holes, piece.graphs[1:]):
            out.copy_(fn(*args, ctx))
            if T > t:
                # the split ops leave the padding rows unwritten: zero them, so that no NaN from
                # stale memory reaches the graphs (MoE routing of a NaN row, for one)
                out[t:T].zero_()
            graph.replay()
        return piece.output[:t]
