"""The op interface: one public function per op, two implementations behind it.

On CUDA tensors an op runs its Triton kernel; everywhere else it runs the plain PyTorch
reference of `mambaserve.ops.reference`. `backend("reference" | "triton" | "auto")` forces one
implementation inside a `with` block (tests use "triton" on CPU tensors under
TRITON_INTERPRET=1). Arguments are checked here, once, for both implementations.

Kernels over packed batches take a launch plan built once per step on the host (token blocks,
SSD chunks, the attention work list: `varlen`, `attention.plan_paged_attention`); the forward
context builds them and every layer passes them. Without a plan the kernel path builds one
from a device read (a host sync). The references need none.

This package knows nothing about models or the engine.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from mambaserve.ops import reference
from mambaserve.ops.varlen import SsdChunks, TokenBlocks

if TYPE_CHECKING:
    from mambaserve.ops.attention import AttentionPlan

__all__ = [
    "backend",
    "fused_add_rms_norm",
    "linear_partials",
    "gemv_max_tokens",
    "current_backend",
    "causal_conv1d",
    "causal_conv1d_update",
    "mamba_chunk_scan",
    "selective_state_update",
    "selective_scan",
    "selective_scan_update",
    "rms_norm_gated",
    "reshape_and_cache",
    "paged_attention",
    "fused_moe",
    "topk_softmax",
    "router_topk",
    "silu_and_mul",
    "reference",
]

_BACKENDS = ("auto", "reference", "triton")
_local = threading.local()


def current_backend() -> str:
    """The backend `backend(...)` selected in this thread: "auto", "reference" or "triton"."""
    return getattr(_local, "backend", "auto")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Force the implementation of the ops called inside the block.

    name: "auto" (Triton on CUDA tensors, the reference elsewhere), "reference" or "triton".
    Raises ValueError for any other name.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; expected one of {_BACKENDS}")
    previous = current_backend()
    _local.backend = name
    try:
        yield
    finally:
        _local.backend = previous


def _use_triton(t: torch.Tensor) -> bool:
    name = current_backend()
    if name == "auto":
        return t.is_cuda
    return name == "triton"


def _check(cond: bool, msg) -> None:
    """Raise ValueError(msg) unless cond; msg may be a callable (an f-string built only on failure:
    these checks run on every op call of every layer, and formatting shapes is not free)."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def _check_batch(query_start_loc, state_indices, has_initial_state=None):
    _check(query_start_loc.dim() == 1 and query_start_loc.numel() >= 1,
           lambda: f"query_start_loc must be (batch + 1,), got {tuple(query_start_loc.shape)}")
    batch = query_start_loc.numel() - 1
    _check(state_indices.shape == (batch,),
           lambda: f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    if has_initial_state is not None:
        _check(has_initial_state.shape == (batch,),
               lambda: f"has_initial_state must be ({batch},), got {tuple(has_initial_state.shape)}")


def _check_conv_states(conv_states, width, dim):
    _check(conv_states.dim() == 3 and conv_states.shape[1:] == (width - 1, dim),
           lambda: f"conv_states must be (num_slots, {width - 1}, {dim}), got {tuple(conv_states.shape)}")
    # the kernels load and store whole state rows along dim (both backends take the same layout)
    _check(conv_states.stride(2) == 1 or dim <= 1,
           lambda: f"conv_states must be contiguous along dim (stride 1), got strides {conv_states.stride()}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    blocks: TokenBlocks | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d over a packed batch mixing prefills and decodes.

    x: (num_tokens, dim) with feature stride 1 (a column slice of a wider tensor is fine);
    weight: (dim, width); bias: (dim,) or None; conv_states: (num_slots, width - 1, dim),
    contiguous along dim, updated in place; query_start_loc: (batch + 1,) int32;
    state_indices: (batch,) int32, -1 = padding (no state read or written);
    has_initial_state: (batch,) bool. Returns (num_tokens, dim) in x.dtype.
    Sequence i is convolved as if preceded by conv_states[state_indices[i]] (zeros when it has
    no initial state); that slot then holds the last width - 1 inputs of the concatenation.
    Math: `reference.causal_conv1d`. Raises ValueError on inconsistent shapes, conv_states
    not contiguous along dim, or query_start_loc that decreases or ends past x's rows.
    """
    _check(x.dim() == 2 and x.stride(1) == 1, lambda: f"x must be (num_tokens, dim) with stride 1 on dim, got {tuple(x.shape)} strides {x.stride()}")
    dim = x.shape[1]
    _check(weight.dim() == 2 and weight.shape[0] == dim, lambda: f"weight must be ({dim}, width), got {tuple(weight.shape)}")
    width = weight.shape[1]
    _check(bias is None or bias.shape == (dim,), lambda: f"bias must be ({dim},)")
    _check_conv_states(conv_states, width, dim)
    _check(activation in (None, "silu", "swish"), lambda: f"unsupported activation {activation!r}")
    _check_batch(query_start_loc, state_indices, has_initial_state)
    if _use_triton(x):
        from mambaserve.ops.conv1d import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, bias, conv_states, query_start_loc, state_indices,
                                    has_initial_state, activation, blocks)
    return reference.causal_conv1d(x, weight, bias, conv_states, query_start_loc, state_indices,
                                   has_initial_state, activation)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Conv1d for a decode-only batch: one token per sequence, always with an initial state.

    x: (batch, dim), feature stride 1; conv_states: (num_slots, width - 1, dim) updated in place;
    weight: (dim, width); bias: (dim,) or None; state_indices: (batch,), -1 = padding.
    Returns (batch, dim) in x.dtype. Raises ValueError on inconsistent shapes or conv_states
    not contiguous along dim.
    """
    _check(x.dim() == 2 and x.stride(1) == 1, lambda: f"x must be (batch, dim) with stride 1 on dim, got {tuple(x.shape)}")
    dim = x.shape[1]
    _check(weight.dim() == 2 and weight.shape[0] == dim, lambda: f"weight must be ({dim}, width)")
    _check(bias is None or bias.shape == (dim,), lambda: f"bias must be ({dim},), got {tuple(bias.shape)}")
    _check_conv_states(conv_states, weight.shape[1], dim)
    _check(state_indices.shape == (x.shape[0],), "state_indices must be (batch,)")
    _check(activation in (None, "silu", "swish"), lambda: f"unsupported activation {activation!r}")
    if _use_triton(x):
        from mambaserve.ops.conv1d import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_states, weight, bias, state_indices, activation)
    return reference.causal_conv1d_update(x, conv_states, weight, bias, state_indices, activation)


def _check_ssm(x, dt, A, B, C, D, z, dt_bias, ssm_states):
    _check(x.dim() == 3, lambda: f"x must be (tokens, nheads, headdim), got {tuple(x.shape)}")
    T, H, P = x.shape
    _check(dt.shape == (T, H), lambda: f"dt must be ({T}, {H}), got {tuple(dt.shape)}")
    _check(A.shape == (H,), lambda: f"A must be ({H},), got {tuple(A.shape)}")
    _check(B.dim() == 3 and B.shape[0] == T and C.shape == B.shape,
           lambda: f"B and C must be ({T}, ngroups, dstate), got {tuple(B.shape)} and {tuple(C.shape)}")
    G, N = B.shape[1], B.shape[2]
    _check(H % G == 0, lambda: f"nheads ({H}) must be a multiple of ngroups ({G})")
    _check(D is None or D.shape == (H,), lambda: f"D must be ({H},)")
    _check(dt_bias is None or dt_bias.shape == (H,), lambda: f"dt_bias must be ({H},)")
    _check(z is None or z.shape == x.shape, "z must have the shape of x")
    _check(ssm_states.dim() == 4 and ssm_states.shape[1:] == (H, P, N),
           lambda: f"ssm_states must be (num_slots, {H}, {P}, {N}), got {tuple(ssm_states.shape)}")


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    chunks: SsdChunks | None = None,
) -> torch.Tensor:
    """The Mamba2 SSD scan over variable-length packed sequences, with state pool I/O.

    x: (num_tokens, nheads, headdim); dt: (num_tokens, nheads); A: (nheads,) float32;
    B, C: (num_tokens, ngroups, dstate), head h uses group h // (nheads // ngroups);
    D, dt_bias: (nheads,) or None; z: like x or None (y is multiplied by silu(z));
    ssm_states: (num_slots, nheads, headdim, dstate), float32/bfloat16/float16, read as the
    initial state where has_initial_state and overwritten with each sequence's final state;
    query_start_loc (batch + 1,), state_indices (batch,) (-1 = padding), has_initial_state
    (batch,) bool. Returns y like x.
    Math (Mamba2 paper, "Transformers are SSMs", section 6): dt' = clamp(softplus(dt + dt_bias),
    dt_limit); h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T; y_t = h_t C_t + D x_t.
    chunk_size only matters to the kernels. Raises ValueError on inconsistent shapes.
    """
    _check_ssm(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    _check(isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool) and chunk_size > 0,
           lambda: f"chunk_size must be a positive int, got {chunk_size!r}")
    chunk_size = int(chunk_size)  # a numpy integer is not a Triton kernel argument
    _check_batch(query_start_loc, state_indices, has_initial_state)
    if _use_triton(x):
        from mambaserve.ops.ssd import mamba_chunk_scan_triton

        return mamba_chunk_scan_triton(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states,
                                       query_start_loc, state_indices, has_initial_state,
                                       dt_softplus, dt_limit, chunks)
    return reference.mamba_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states,
                                      query_start_loc, state_indices, has_initial_state,
                                      dt_softplus, dt_limit)


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """One SSM recurrence step per sequence (decode), in place on the state pool.

    ssm_states: (num_slots, nheads, headdim, dstate); x: (batch, nheads, headdim);
    dt: (batch, nheads); A: (nheads,); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads,)
    or None; z: like x or None; state_indices: (batch,), -1 = padding (state untouched).
    Returns y like x. Math as in `mamba_chunk_scan`, one step.
    Raises ValueError on inconsistent shapes.
    """
    _check_ssm(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    _check(state_indices.shape == (x.shape[0],), "state_indices must be (batch,)")
    if _use_triton(x):
        from mambaserve.ops.state_update import selective_state_update_triton

        return selective_state_update_triton(ssm_states, x, dt, A, B, C, D, z, dt_bias,
                                             state_indices, dt_softplus, dt_limit)
    return reference.selective_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias,
                                            state_indices, dt_softplus, dt_limit)


def _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states):
    _check(x.dim() == 2, lambda: f"x must be (num_tokens, dim), got {tuple(x.shape)}")
    T, dim = x.shape
    _check(dt.shape == x.shape, lambda: f"dt must be ({T}, {dim}), got {tuple(dt.shape)}")
    _check(A.dim() == 2 and A.shape[0] == dim, lambda: f"A must be ({dim}, dstate), got {tuple(A.shape)}")
    N = A.shape[1]
    _check(B.shape == (T, N) and C.shape == (T, N),
           lambda: f"B and C must be ({T}, {N}), got {tuple(B.shape)} and {tuple(C.shape)}")
    _check(D is None or D.shape == (dim,), lambda: f"D must be ({dim},), got {tuple(D.shape)}")
    _check(dt_bias is None or dt_bias.shape == (dim,), lambda: f"dt_bias must be ({dim},), got {tuple(dt_bias.shape)}")
    _check(z is None or z.shape == x.shape, lambda: f"z must be ({T}, {dim}), got {tuple(z.shape)}")
    _check(ssm_states.dim() == 3 and ssm_states.shape[1:] == (dim, N),
           lambda: f"ssm_states must be (num_slots, {dim}, {N}), got {tuple(ssm_states.shape)}")


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    query_start_loc_host: np.ndarray | None = None,
) -> torch.Tensor:
    """The Mamba-1 selective scan over variable-length packed sequences, with state pool I/O.

    x: (num_tokens, dim); dt: (num_tokens, dim), before dt_bias and softplus; A: (dim, dstate)
    float32 (one decay rate per channel and state); B, C: (num_tokens, dstate); D, dt_bias:
    (dim,) or None; z: (num_tokens, dim) or None (y is multiplied by silu(z)); any strides.
    ssm_states: (num_slots, dim, dstate), float32/bfloat16/float16, read as the initial state
    where has_initial_state and overwritten with each sequence's final state;
    query_start_loc (batch + 1,) int32, state_indices (batch,) int32 (-1 = padding),
    has_initial_state (batch,) bool. Returns y (num_tokens, dim) in x.dtype.
    Math (Mamba paper, Gu & Dao 2023, section 3, Algorithm 2): dt' = softplus(dt + dt_bias);
    h_t = exp(dt'_t A) * h_{t-1} + (dt'_t x_t) B_t^T; y_t = h_t C_t + D x_t.
    query_start_loc_host: the step's checked host copy of query_start_loc (the kernel path
    reads it instead of the device tensor).
    Raises ValueError on inconsistent shapes, or query_start_loc that starts below 0,
    decreases or ends past x's rows.
    """
    _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    _check_batch(query_start_loc, state_indices, has_initial_state)
    if _use_triton(x):
        from mambaserve.ops.mamba1_scan import selective_scan_triton

        return selective_scan_triton(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
                                     has_initial_state, dt_softplus, query_start_loc_host)
    return reference.selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
                                    has_initial_state, dt_softplus)


def selective_scan_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """One Mamba-1 recurrence step per sequence (decode), in place on the state pool: the
    per-channel-A counterpart of `selective_state_update`.

    ssm_states: (num_slots, dim, dstate); x, dt: (batch, dim); A: (dim, dstate); B, C:
    (batch, dstate); D, dt_bias: (dim,) or None; z: (batch, dim) or None; state_indices:
    (batch,), -1 = padding (state untouched). Returns y (batch, dim). Math as in
    `selective_scan`, one step; no host metadata (CUDA-graph safe). Raises ValueError on
    inconsistent shapes.
    """
    _check_selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    _check(state_indices.shape == (x.shape[0],), lambda: f"state_indices must be ({x.shape[0]},), got {tuple(state_indices.shape)}")
    if _use_triton(x):
        from mambaserve.ops.mamba1_scan import selective_scan_update_triton

        return selective_scan_update_triton(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus)
    return reference.selective_scan_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus)


def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of group_size features (Mamba2 paper, section 7.2).

    x, z: (num_tokens, hidden) (z may be None); weight: (hidden,). norm_before_gate=False
    computes weight * rmsnorm_g(x * silu(z)). Returns (num_tokens, hidden) in x.dtype.
    Raises ValueError when group_size is not a positive int, hidden is not a multiple of it, or
    shapes disagree.
    """
    _check(x.dim() == 2, lambda: f"x must be (num_tokens, hidden), got {tuple(x.shape)}")
    _check(isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool) and group_size > 0,
           lambda: f"group_size must be a positive int, got {group_size!r}")
    group_size = int(group_size)  # a numpy integer is not a Triton kernel argument
    _check(x.shape[1] % group_size == 0, lambda: f"hidden ({x.shape[1]}) must be a multiple of group_size ({group_size})")
    _check(weight.shape == (x.shape[1],), "weight must be (hidden,)")
    _check(z is None or z.shape == x.shape, "z must have the shape of x")
    if _use_triton(x):
        from mambaserve.ops.layernorm_gated import rms_norm_gated_triton

        return rms_norm_gated_triton(x, weight, z, eps, group_size, norm_before_gate)
    return reference.rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    alpha: float = 1.0,
) -> torch.Tensor:
    """residual <- residual + alpha * x in place (rounded once to residual's dtype), then
    weight * rmsnorm(residual) (Zhang & Sennrich 2019), returned in x.dtype: a residual add
    and the next layer's norm in one kernel.

    x, residual: (num_tokens, hidden), residual with feature stride 1; weight: (hidden,).
    x may also be (num_parts, num_tokens, hidden) partial sums of the added term (as
    `linear_partials` or `fused_moe(..., as_partials=True)` leave them), summed in order in
    float32 in a fixed order; the result is then in residual's dtype. Raises ValueError when
    shapes disagree.
    """
    rows = x.shape[-2:] if x.dim() in (2, 3) else None
    _check(rows is not None and residual.shape == rows, lambda: f"x must be (num_tokens, hidden) or (num_parts, num_tokens, "
           f"hidden) and residual (num_tokens, hidden), got {tuple(x.shape)}, {tuple(residual.shape)}")
    _check(weight.shape == (x.shape[-1],), "weight must be (hidden,)")
    if _use_triton(residual):
        from mambaserve.ops.layernorm_gated import rms_norm_gated_triton

        return rms_norm_gated_triton(x, weight, None, eps, x.shape[-1], residual=residual, alpha=alpha)
    return reference.fused_add_rms_norm(x, residual, weight, eps, alpha)


def gemv_max_tokens() -> int:
    """Most rows `linear_partials` takes on the Triton path (decode-sized batches)."""
    from mambaserve.ops.gemv import MAX_TOKENS

    return MAX_TOKENS


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T left as split-K partial sums, for decode-sized batches whose consumer is
    `fused_add_rms_norm` (which adds the splits): one launch where cuBLAS takes two.

    x: (num_tokens, K), at most `gemv.MAX_TOKENS` rows on the Triton path; weight: (N, K) in
    x's dtype. Returns (num_splits, num_tokens, N) float32 whose sum over the first axis is the
    product (num_splits is 1 on the reference path). Raises ValueError on bad shapes.
    """
    _check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1],
           lambda: f"x must be (num_tokens, K) and weight (N, {x.shape[-1]}), got {tuple(x.shape)}, {tuple(weight.shape)}")
    if _use_triton(x) and weight.dtype == x.dtype:
        from mambaserve.ops.gemv import MAX_TOKENS, linear_partials_triton

        if x.shape[0] <= MAX_TOKENS:
            return linear_partials_triton(x, weight)
    return reference.linear_partials(x, weight)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into the paged cache by slot (block * block_size + offset; -1 skips).

    k, v: (num_tokens, num_kv_heads, head_dim); k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim); slot_mapping: (num_tokens,) int. Raises ValueError on bad shapes.
    """
    _check(k.dim() == 3 and v.shape == k.shape, "k and v must be (num_tokens, num_kv_heads, head_dim)")
    _check(k_cache.dim() == 4 and k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape,
           lambda: f"caches must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]})")
    _check(slot_mapping.shape == (k.shape[0],), "slot_mapping must be (num_tokens,)")
    if _use_triton(k):
        from mambaserve.ops.attention import reshape_and_cache_triton

        return reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    return reference.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a packed prefill/decode batch over the paged KV cache.

    q: (num_tokens, num_heads, head_dim); k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim) already holding this step's keys; block_table: (batch,
    max_blocks_per_seq) int32; seq_lens: (batch,) int32, context length after this step;
    query_start_loc: (batch + 1,) int32; scale: the softmax scale (the model's, e.g. Granite's
    attention_multiplier). Returns (num_tokens, num_heads, head_dim) in q.dtype.
    Math: `reference.paged_attention`. Raises ValueError on inconsistent shapes.
    """
    _check(q.dim() == 3, lambda: f"q must be (num_tokens, num_heads, head_dim), got {tuple(q.shape)}")
    _check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == q.shape[2],
           "caches must be (num_blocks, block_size, num_kv_heads, head_dim)")
    _check(q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads")
    batch = query_start_loc.numel() - 1
    _check(seq_lens.shape == (batch,) and block_table.dim() == 2 and block_table.shape[0] == batch,
           lambda: f"seq_lens must be ({batch},) and block_table ({batch}, max_blocks)")
    if _use_triton(q):
        from mambaserve.ops.attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                      scale, plan)
    return reference.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    add: torch.Tensor | None = None,
    as_partials: bool = False,
) -> torch.Tensor:
    """SiLU-gated mixture of experts over routed tokens.

    hidden_states: (num_tokens, hidden); w1: (num_experts, 2 * inter, hidden) with the gate
    rows first, then the up rows; w2: (num_experts, hidden, inter); topk_weights:
    (num_tokens, top_k); topk_ids: (num_tokens, top_k) int. add: optional (num_tokens,
    hidden) tensor added before the result is rounded (a shared expert's output).
    Returns (num_tokens, hidden); with as_partials, (num_parts, num_tokens, hidden) terms that
    sum to it, for `fused_add_rms_norm` to add (the decode path then skips its combine).
    Math: `reference.fused_moe`. Raises ValueError on inconsistent shapes or non-integer
    topk_ids.
    """
    _check(hidden_states.dim() == 2, "hidden_states must be (num_tokens, hidden)")
    E, two_i, Hd = w1.shape
    _check(Hd == hidden_states.shape[1] and two_i % 2 == 0, lambda: f"w1 must be (E, 2 * inter, {hidden_states.shape[1]})")
    _check(w2.shape == (E, Hd, two_i // 2), lambda: f"w2 must be ({E}, {Hd}, {two_i // 2})")
    _check(topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == hidden_states.shape[0],
           "topk_ids and topk_weights must be (num_tokens, top_k)")
    _check(not topk_ids.dtype.is_floating_point and topk_ids.dtype != torch.bool,
           lambda: f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    _check(add is None or add.shape == hidden_states.shape, "add must have hidden_states' shape")
    if _use_triton(hidden_states):
        from mambaserve.ops.moe import fused_moe_triton

        return fused_moe_triton(hidden_states, w1, w2, topk_weights, topk_ids, add=add, as_partials=as_partials)
    out = reference.fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, add)
    return out[None] if as_partials else out


def topk_softmax(logits: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None, num_shared: int = 0,
                 renormalize: bool = True):
    """Top-k expert routing: the top_k largest logits of each row and a softmax over them
    (renormalize=False: the softmax over all experts, of which the top_k entries are kept as
    they are, summing to less than 1: Jamba's router).

    logits: (num_tokens, num_experts), any float dtype (compared in float32). Returns
    (weights (num_tokens, top_k + num_shared) in out_dtype (default logits.dtype), ids
    (num_tokens, top_k + num_shared) integer): the routed experts largest first, then
    num_shared always-on experts num_experts + j with weight 1 (a shared expert stored as
    extra experts of the fused MoE). Math: `reference.topk_softmax` (Shazeer et al. 2017,
    top-k gating). Raises ValueError when top_k is not in [1, num_experts] or num_shared < 0.
    """
    _check(logits.dim() == 2, lambda: f"logits must be (num_tokens, num_experts), got {tuple(logits.shape)}")
    _check(1 <= top_k <= logits.shape[1], lambda: f"top_k must be in [1, {logits.shape[1]}], got {top_k}")
    _check(num_shared >= 0, lambda: f"num_shared must be >= 0, got {num_shared}")
    out_dtype = out_dtype or logits.dtype
    if _use_triton(logits) and logits.shape[1] <= 1024:
        from mambaserve.ops.moe import topk_softmax_triton

        return topk_softmax_triton(logits if logits.stride(1) == 1 else logits.contiguous(), top_k, out_dtype,
                                   num_shared, renormalize)
    return reference.topk_softmax(logits, top_k, out_dtype, num_shared, renormalize)


def router_topk(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None,
                num_shared: int = 0, renormalize: bool = True):
    """Top-k softmax routing from the hidden states: `topk_softmax` of x @ router_weight^T
    (renormalize as there).

    x: (num_tokens, hidden); router_weight: (num_experts, hidden) in x's dtype. Returns
    (weights, ids), each (num_tokens, top_k + num_shared), as `topk_softmax`. A decode step's
    few tokens run the product and the top-k in one kernel. Raises ValueError on bad shapes.
    """
    _check(x.dim() == 2 and router_weight.dim() == 2 and router_weight.shape[1] == x.shape[1],
           lambda: f"x must be (num_tokens, hidden) and router_weight (num_experts, {x.shape[-1]})")
    _check(1 <= top_k <= router_weight.shape[0], lambda: f"top_k must be in [1, {router_weight.shape[0]}], got {top_k}")
    _check(num_shared >= 0, lambda: f"num_shared must be >= 0, got {num_shared}")
    out_dtype = out_dtype or x.dtype
    if _use_triton(x) and router_weight.dtype == x.dtype:
        from mambaserve.ops.moe import router_topk_triton

        return router_topk_triton(x if x.stride(1) == 1 else x.contiguous(), router_weight.contiguous(), top_k,
                                  out_dtype, num_shared, renormalize)
    return reference.router_topk(x, router_weight, top_k, out_dtype, num_shared, renormalize)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [gate | up] projection. h: (num_rows, 2 * inter) ->
    (num_rows, inter) in h.dtype. Math: `reference.silu_and_mul`. Raises ValueError on an odd
    feature count."""
    _check(h.dim() == 2 and h.shape[1] % 2 == 0, lambda: f"h must be (num_rows, 2 * inter), got {tuple(h.shape)}")
    if _use_triton(h):
        from mambaserve.ops.activation import silu_and_mul_triton

        return silu_and_mul_triton(h if h.stride(1) == 1 else h.contiguous())
    return reference.silu_and_mul(h)
