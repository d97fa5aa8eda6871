"""Copies of whole state rows in every layer at once: op `copy_state_rows`, its Triton kernel
and launcher.

Speculative decoding carries each verifying sequence's accepted state row into its slot before
the next step, and prefix caching copies slots to and from checkpoint rows. The layers' states
are stacked per (shape, dtype) (`cache.tensors.allocate_caches`), so one launch per stack
copies a row of every layer: per-layer copies cost the host ~2 us a tensor (a multi-tensor copy
of 32 pairs over 36 layers' conv and SSM states took 2 ms of host time a step on an H200 host).
Math: `_reference` (its PyTorch twin, kept here: reference.py is at its size limit).
This module knows nothing about models or the engine.
"""

from __future__ import annotations

import torch

from mambaserve.ops.common import cdiv, check, pack_to_device
from mambaserve.ops.dispatch import tl, triton, use_triton

BLOCK = 4096  # elements a program copies


@triton.jit
def _copy_state_rows_kernel(states_ptr, src_ptr, dst_ptr, layer_stride, row_stride, row_numel,
                            BLOCK: tl.constexpr):
    """states[layer, dst[p], block] = states[layer, src[p], block] for program (p, layer, block)."""
    p = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    src = tl.load(src_ptr + p).to(tl.int64)
    dst = tl.load(dst_ptr + p).to(tl.int64)
    base = states_ptr + layer * layer_stride
    tl.store(base + dst * row_stride + offs, tl.load(base + src * row_stride + offs, mask=mask), mask=mask)


def _reference(stacks: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """stack[:, dst[p]] = stack[:, src[p]] for every stack (all reads before the writes)."""
    for s in stacks:
        s[:, torch.tensor(dst, device=s.device)] = s[:, torch.tensor(src, device=s.device)]


def copy_state_rows(stacks: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For each (src, dst) in pairs and each stack: stack[:, dst] = stack[:, src], in place.

    stacks: contiguous (num_layers, num_rows, *row_shape) tensors of any dtype (the conv and SSM
    states of the layers that share a shape and dtype), all on one device with one num_rows.
    pairs: host (src, dst) row indices; the destinations are distinct and none of them is also
    a source, so the result does not depend on the order of the copies. One launch per stack
    (on CUDA) after one host-to-device copy of the indices. Raises ValueError for a stack of
    another shape, a row out of range, a repeated destination or a destination that is read.
    """
    if not pairs or not stacks:
        return
    rows = stacks[0].shape[1] if stacks[0].dim() >= 2 else -1
    for s in stacks:
        check(s.dim() >= 2 and s.is_contiguous() and s.shape[1] == rows and s.device == stacks[0].device,
              lambda: f"stacks must be contiguous (num_layers, {rows}, ...) tensors on one device, got "
                      f"{[(tuple(t.shape), str(t.device)) for t in stacks]}")
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    check(all(0 <= r < rows for r in src + dst), lambda: f"state rows must be in [0, {rows}), got {pairs}")
    check(len(set(dst)) == len(dst) and not set(dst) & set(src),
          lambda: f"destination rows must be distinct and not sources, got {pairs}")
    if not use_triton(stacks[0]):
        _reference(stacks, src, dst)
        return
    src_t, dst_t = pack_to_device([src, dst], stacks[0].device)
    for s in stacks:
        row_numel = s[0, 0].numel()
        if s.shape[0] == 0 or row_numel == 0:
            continue
        _copy_state_rows_kernel[(len(pairs), s.shape[0], cdiv(row_numel, BLOCK))](
            s, src_t, dst_t, s.stride(0), s.stride(1), row_numel, BLOCK=BLOCK, num_warps=8)
