"""The ops: one public function per op, each stated once in its own file.

Each op file holds its launcher (the one docstring with shapes, dtypes, errors and the source
of the math; the one set of argument checks; the choice between its Triton kernel and the
PyTorch twin in `reference`) beside its kernels. `backend(...)` forces one implementation
inside a `with` block; by default CUDA tensors run Triton and everything else the reference.

Kernels over packed variable-length batches take a launch plan built once per step on the
host (`TokenBlocks`, `SsdChunks`, `AttentionPlan`, from `varlen` and `attention`); called
without one, they build it from a device read (a host sync).

Mamba2 ops are named after the paper's SSD (`ssd_chunk_scan`, `ssd_state_update`), Mamba-1
ops after its selective scan (`selective_scan`, `selective_scan_update`).

This package knows nothing about models or the engine, and imports nothing of mambaserve
outside it.
"""

from mambaserve.ops import reference
from mambaserve.ops.activation import silu_and_mul
from mambaserve.ops.attention import AttentionPlan, paged_attention, plan_paged_attention, reshape_and_cache
from mambaserve.ops.conv1d import causal_conv1d, causal_conv1d_update
from mambaserve.ops.dispatch import backend, current_backend, fused, fusions_enabled, unfused
from mambaserve.ops.fp8 import dequantize_fp8, fp8_linear, quantize_fp8, silu_mul_quantize_fp8
from mambaserve.ops.gemv import gated_norm_linear_partials, gemv_max_tokens, linear_partials
from mambaserve.ops.layernorm_gated import fused_add_rms_norm, rms_norm_gated
from mambaserve.ops.mamba1_scan import selective_scan, selective_scan_update
from mambaserve.ops.moe import fused_moe, router_topk, topk_softmax
from mambaserve.ops.ssd import ssd_chunk_scan
from mambaserve.ops.state_copy import copy_state_rows
from mambaserve.ops.state_update import ssd_state_update
from mambaserve.ops.varlen import SsdChunks, TokenBlocks
from mambaserve.ops.verify import causal_conv1d_verify, ssd_state_verify

__all__ = [
    "backend",
    "current_backend",
    "unfused",
    "fused",
    "fusions_enabled",
    "reference",
    # Mamba2 (SSD) and Mamba-1 (selective scan), the short conv of both
    "causal_conv1d",
    "causal_conv1d_update",
    "ssd_chunk_scan",
    "ssd_state_update",
    "selective_scan",
    "selective_scan_update",
    # speculative decoding's verify rows: the decode updates over k + 1 positions, a state per position
    "causal_conv1d_verify",
    "ssd_state_verify",
    # state rows of every layer copied at once (accepted drafts' states, prefix-cache checkpoints)
    "copy_state_rows",
    # attention over the paged KV cache
    "reshape_and_cache",
    "paged_attention",
    # norms, projections, activations, experts
    "rms_norm_gated",
    "fused_add_rms_norm",
    "linear_partials",
    "fp8_linear",
    "quantize_fp8",
    "dequantize_fp8",
    "silu_mul_quantize_fp8",
    "gated_norm_linear_partials",
    "gemv_max_tokens",
    "silu_and_mul",
    "fused_moe",
    "topk_softmax",
    "router_topk",
    # launch plans
    "TokenBlocks",
    "SsdChunks",
    "AttentionPlan",
    "plan_paged_attention",
]
