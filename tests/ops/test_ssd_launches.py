"""The SSD scan's steps 1 and 2 in one launch (`ssd._chunk_state_cb_kernel`) against the same
two steps as launches of their own (kernels written here around `ssd._chunk_state` and
`ssd._chunk_cb`): bit for bit the same dt', cumsum, chunk totals, chunk states and C B^T."""

import pytest
import torch

from mambaserve.ops import ssd, varlen
from mambaserve.ops.dispatch import tl, triton
from tests.ops.kernel_helpers import DEVICES, gpu_only, packed
from tests.ops.test_ssd import _inputs


@triton.jit
def _state_only(x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr,
                dt_out_ptr, cs_out_ptr, chunk_dA_ptr, states_ptr,
                num_tokens, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
                sxt, sxh, sxp, sdt, sdh, sbt, sbg, sbn,
                HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
                OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    ssd._chunk_state(tl.program_id(0), x_ptr, dt_ptr, A_ptr, dt_bias_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr,
                     dt_out_ptr, cs_out_ptr, chunk_dA_ptr, states_ptr,
                     num_tokens, nheads, headdim, dstate, heads_per_group, dt_min, dt_max,
                     sxt, sxh, sxp, sdt, sdh, sbt, sbg, sbn,
                     HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT, OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION,
                     BLOCK_K, BLOCK_P, BLOCK_N)


@triton.jit
def _cb_only(C_ptr, B_ptr, chunk_start_ptr, chunk_end_ptr, cb_ptr, ngroups, dstate, chunk_size,
             sct, scg, scn, sbt, sbg, sbn,
             OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    ssd._chunk_cb(tl.program_id(0), tl.program_id(1), tl.program_id(2), C_ptr, B_ptr, chunk_start_ptr,
                  chunk_end_ptr, cb_ptr, ngroups, dstate, chunk_size, sct, scg, scn, sbt, sbg, sbn,
                  OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION, BLOCK_M, BLOCK_K, BLOCK_N)


def _compare(H, P, N, G, Q, lens, dtype, device):
    qsl, T = packed(lens, device)
    x, dt, B, C, _ = _inputs(T, H, P, G, N, dtype, device)
    A, dt_bias = -torch.rand(H, device=device) - 0.1, torch.randn(H, device=device)
    chunks = varlen.ssd_chunks(varlen.check_offsets(qsl.tolist()), Q, device)
    la = ssd._launch_params(chunks, H, P, N, G, x, False, False, True, True, (0.0, float("inf")))
    kw = la.state_cb_kw
    fused = [t.fill_(float("nan")) for t in ssd._workspace(chunks, T, H, P, N, G, dtype, device)]
    apart = [t.fill_(float("nan")) for t in ssd._workspace(chunks, T, H, P, N, G, dtype, device)]
    nc = chunks.num_chunks
    ssd._chunk_state_cb_kernel[la.state_cb_grid](
        x, dt, A, dt_bias, B, C, chunks.chunk_start, chunks.chunk_end, *fused[:4], fused[5],
        T, H, P, N, H // G, la.lo, la.hi, G, Q, la.num_state_programs, nc * G, la.num_cb_m,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), **kw)
    common = {k: kw[k] for k in ("OPERAND_DTYPE", "DOT_DTYPE", "DOT_PRECISION", "num_warps", "num_stages")}
    _state_only[(la.num_state_programs,)](
        x, dt, A, dt_bias, B, chunks.chunk_start, chunks.chunk_end, *apart[:4],
        T, H, P, N, H // G, la.lo, la.hi, *x.stride(), *dt.stride(), *B.stride(),
        HAS_DT_BIAS=True, DT_SOFTPLUS=True, HAS_DT_LIMIT=kw["HAS_DT_LIMIT"],
        BLOCK_K=kw["BLOCK_K"], BLOCK_P=kw["BLOCK_P"], BLOCK_N=kw["BLOCK_N"], **common)
    _cb_only[(nc * G, la.num_cb_m, -(-Q // kw["CB_BLOCK_K"]))](
        C, B, chunks.chunk_start, chunks.chunk_end, apart[5], G, N, Q, *C.stride(), *B.stride(),
        BLOCK_M=kw["CB_BLOCK_M"], BLOCK_K=kw["CB_BLOCK_K"], BLOCK_N=kw["CB_BLOCK_N"], **common)
    for name, a, b in zip(("dt'", "cumsum", "chunk totals", "chunk states", "", "C B^T"), fused, apart):
        if name:
            assert not a.isnan().all(), name  # the launch wrote something
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_state_and_cb_in_one_launch_equal_separate_launches(device):
    _compare(H=4, P=16, N=16, G=2, Q=16, lens=[1, 37, 16], dtype=torch.float32, device=device)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_and_cb_in_one_launch_equal_separate_launches_granite_gpu(dtype):
    """granite-4.0-tiny's sizes (48 heads of 64, dstate 128, one group, chunk 256)."""
    _compare(H=48, P=64, N=128, G=1, Q=256, lens=[384, 1, 1000], dtype=dtype, device="cuda")
