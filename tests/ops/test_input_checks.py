"""Bad input to the op interface: a ValueError that names the problem, from both backends.

The Triton kernels index rows by query_start_loc and read bias and state rows by the shapes
they are given, so an unchecked bad argument reads or writes out of bounds (garbage, or a
crash of the interpreter's process) instead of failing. Each case here runs the op on the
reference and on the Triton backend (the interpreter on CPU tensors).
"""

import numpy as np
import pytest
import torch

from mambaserve import ops
from tests.ops.kernel_helpers import DEVICES

BACKENDS = ["reference", "triton"]


def _packed_conv(device, qsl):
    T, dim, width = 5, 10, 4
    x = torch.randn(T, dim, device=device)
    w = torch.randn(dim, width, device=device)
    states = torch.randn(3, width - 1, dim, device=device)
    qsl = torch.tensor(qsl, dtype=torch.int32, device=device)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device)
    has = torch.tensor([True, False], device=device)
    return x, w, states, qsl, idx, has


def _packed_scan(device, qsl):
    T, H, P, G, N = 5, 2, 8, 1, 16
    args = dict(x=torch.randn(T, H, P, device=device), dt=torch.randn(T, H, device=device),
                A=-torch.rand(H, device=device), B=torch.randn(T, G, N, device=device),
                C=torch.randn(T, G, N, device=device), chunk_size=4, D=None, z=None, dt_bias=None,
                ssm_states=torch.randn(3, H, P, N, device=device),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                state_indices=torch.tensor([0, 1], dtype=torch.int32, device=device),
                has_initial_state=torch.tensor([True, False], device=device))
    return args


def _packed_attention(device, qsl):
    T = 5
    return dict(q=torch.randn(T, 4, 8, device=device), k_cache=torch.randn(4, 4, 2, 8, device=device),
                v_cache=torch.randn(4, 4, 2, 8, device=device),
                block_table=torch.tensor([[0, 1, 2], [3, 1, 0]], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([6, 8], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device), scale=0.5)


# offsets past the input's 5 rows, decreasing, and starting below 0
BAD_OFFSETS = [([0, 2, 9], "past the 5 rows"), ([0, 4, 2], "non-decreasing"), ([-1, 2, 5], "non-negative")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qsl,match", BAD_OFFSETS)
def test_varlen_ops_reject_bad_query_start_loc(device, backend, qsl, match):
    x, w, states, qsl_t, idx, has = _packed_conv(device, qsl)
    with ops.backend(backend):
        with pytest.raises(ValueError, match=match):
            ops.causal_conv1d(x, w, None, states, qsl_t, idx, has)
        with pytest.raises(ValueError, match=match):
            ops.ssd_chunk_scan(**_packed_scan(device, qsl))
        with pytest.raises(ValueError, match=match):
            ops.paged_attention(**_packed_attention(device, qsl))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_ops_take_padding_rows_past_the_last_sequence(device, backend):
    """Rows past query_start_loc[-1] (a padded forward) are allowed: they belong to no sequence."""
    x, w, states, qsl, idx, has = _packed_conv(device, [0, 1, 3])
    with ops.backend(backend):
        assert ops.causal_conv1d(x, w, None, states, qsl, idx, has).shape == x.shape
        assert ops.ssd_chunk_scan(**_packed_scan(device, [0, 1, 3])).shape == (5, 2, 8)
        assert ops.paged_attention(**_packed_attention(device, [0, 1, 3])).shape == (5, 4, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_ops_check_bias_and_state_layout(device, backend):
    x, w, states, qsl, idx, has = _packed_conv(device, [0, 2, 5])
    dim = x.shape[1]
    transposed = torch.randn(3, dim, w.shape[1] - 1, device=device).transpose(1, 2)  # stride 3 along dim
    with ops.backend(backend):
        with pytest.raises(ValueError, match="bias"):  # the Triton update read past a short bias
            ops.causal_conv1d_update(x[:2], states, w, torch.randn(dim + 3, device=device), idx)
        with pytest.raises(ValueError, match="contiguous along dim"):
            ops.causal_conv1d_update(x[:2], transposed, w, None, idx)
        with pytest.raises(ValueError, match="contiguous along dim"):
            ops.causal_conv1d(x, w, None, transposed, qsl, idx, has)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_gated_checks_group_size(device, backend):
    x, w = torch.randn(3, 10, device=device), torch.randn(10, device=device)
    with ops.backend(backend):
        for group_size in (0, -5, 2.5, "4"):
            with pytest.raises(ValueError, match="group_size"):
                ops.rms_norm_gated(x, w, None, 1e-5, group_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_checks_ids_dtype(device, backend):
    x = torch.randn(3, 8, device=device)
    w1, w2 = torch.randn(4, 12, 8, device=device), torch.randn(4, 8, 6, device=device)
    weights = torch.rand(3, 2, device=device)
    with ops.backend(backend):
        with pytest.raises(ValueError, match="integer"):
            ops.fused_moe(x, w1, w2, weights, torch.randint(0, 4, (3, 2), device=device).float())


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_reference_checks_lengths_as_the_kernel_does(device):
    args = _packed_attention(device, [0, 2, 5])
    with ops.backend("reference"):
        with pytest.raises(ValueError, match="seq_lens"):
            ops.paged_attention(**dict(args, seq_lens=torch.tensor([1, 4], dtype=torch.int32, device=device)))
        with pytest.raises(ValueError, match="block_table"):
            ops.paged_attention(**dict(args, seq_lens=torch.tensor([2, 13], dtype=torch.int32, device=device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_arguments(device, backend):
    """Sizes and constants computed from config arrays (numpy scalars) work on both backends:
    the Triton launchers took them as kernel arguments and failed ("cannot convert")."""
    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    logits, router = torch.randn(3, 6, device=device), torch.randn(6, 8, device=device)
    scan_args = _packed_scan(device, [0, 2, 5])
    scan_states = scan_args["ssm_states"].clone()
    with ops.backend(backend):
        scanned = ops.ssd_chunk_scan(**dict(scan_args, chunk_size=np.int64(4)))
        normed = ops.rms_norm_gated(x, w, None, np.float32(1e-5), np.int64(4))
        added = ops.fused_add_rms_norm(x, x.clone(), w, np.float32(1e-5))
        routed = ops.topk_softmax(logits, np.int64(2), num_shared=np.int64(1))
        routed_x = ops.router_topk(x, router, np.int64(2), num_shared=np.int64(1))
    with ops.backend("reference"):
        assert torch.allclose(scanned, ops.ssd_chunk_scan(**dict(scan_args, ssm_states=scan_states)), rtol=1e-4,
                              atol=1e-5)
        assert torch.allclose(normed, ops.rms_norm_gated(x, w, None, 1e-5, 4), rtol=1e-5, atol=1e-6)
        assert torch.allclose(added, ops.fused_add_rms_norm(x, x.clone(), w, 1e-5), rtol=1e-5, atol=1e-6)
        for ours, theirs in ((routed, ops.topk_softmax(logits, 2, num_shared=1)),
                             (routed_x, ops.router_topk(x, router, 2, num_shared=1))):
            assert torch.equal(ours[1].long(), theirs[1].long())
            assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def _bad_calls(device):
    """(name, a call with one bad argument, the words its ValueError must name), one or more
    per launcher: each op states its checks once, for both backends."""
    d = dict(device=device)
    x2, w8 = torch.randn(3, 8, **d), torch.randn(8, **d)
    scan = _packed_scan(device, [0, 2, 5])
    T, H, P, N = 5, 2, 8, 16
    idx2 = torch.tensor([0, 1], dtype=torch.int32, **d)
    m1 = dict(x=torch.randn(T, 6, **d), dt=torch.randn(T, 6, **d), A=-torch.rand(6, 4, **d), B=torch.randn(T, 4, **d),
              C=torch.randn(T, 4, **d), D=None, z=None, dt_bias=None, ssm_states=torch.randn(3, 6, 4, **d))
    conv = _packed_conv(device, [0, 2, 5])
    att = _packed_attention(device, [0, 2, 5])
    k = torch.randn(T, 2, 8, **d)
    moe_args = (x2, torch.randn(4, 12, 8, **d), torch.randn(4, 8, 6, **d), torch.rand(3, 2, **d),
                torch.randint(0, 4, (3, 2), **d))
    return [
        ("causal_conv1d activation", lambda: ops.causal_conv1d(*conv[:2], None, *conv[2:], activation="gelu"),
         "activation"),
        ("causal_conv1d_update state_indices", lambda: ops.causal_conv1d_update(conv[0][:2], conv[2], conv[1], None,
                                                                                 idx2[:1]), "state_indices"),
        ("ssd_chunk_scan chunk_size", lambda: ops.ssd_chunk_scan(**dict(scan, chunk_size=0)), "chunk_size"),
        ("ssd_chunk_scan groups", lambda: ops.ssd_chunk_scan(**dict(scan, B=scan["B"].expand(T, 3, N),
                                                                    C=scan["C"].expand(T, 3, N))), "ngroups"),
        ("ssd_state_update states", lambda: ops.ssd_state_update(
            torch.randn(3, H, P, N + 1, **d), scan["x"][:2], scan["dt"][:2], scan["A"], scan["B"][:2], scan["C"][:2],
            None, None, None, idx2), "ssm_states"),
        ("selective_scan has_initial_state", lambda: ops.selective_scan(
            **m1, query_start_loc=scan["query_start_loc"], state_indices=idx2,
            has_initial_state=torch.tensor([True], **d)), "has_initial_state"),
        ("selective_scan_update z", lambda: ops.selective_scan_update(
            m1["ssm_states"], m1["x"][:2], m1["dt"][:2], m1["A"], m1["B"][:2], m1["C"][:2], None,
            torch.randn(2, 5, **d), None, idx2), "z must be"),
        ("reshape_and_cache slot_mapping", lambda: ops.reshape_and_cache(
            k, k, att["k_cache"], att["v_cache"], torch.zeros(T - 1, dtype=torch.int64, **d)), "slot_mapping"),
        ("paged_attention heads", lambda: ops.paged_attention(**dict(att, q=torch.randn(T, 3, 8, **d))),
         "multiple of num_kv_heads"),
        ("paged_attention out", lambda: ops.paged_attention(**att, out=torch.empty(T, 4, 4, **d)), "out must be"),
        ("rms_norm_gated z", lambda: ops.rms_norm_gated(x2, w8, x2[:2], 1e-5, 4), "z must have"),
        ("fused_add_rms_norm residual", lambda: ops.fused_add_rms_norm(x2, x2[:2].clone(), w8, 1e-5), "residual"),
        ("linear_partials K", lambda: ops.linear_partials(x2, torch.randn(5, 7, **d)), "weight"),
        ("silu_and_mul odd", lambda: ops.silu_and_mul(torch.randn(3, 7, **d)), "2 \\* inter"),
        ("fused_moe w2", lambda: ops.fused_moe(*moe_args[:2], moe_args[2][:, :, :5], *moe_args[3:]), "w2"),
        ("fused_moe impl", lambda: ops.fused_moe(*moe_args, impl="fastest"), "impl"),
        ("topk_softmax top_k", lambda: ops.topk_softmax(torch.randn(3, 6, **d), 7), "top_k"),
        ("router_topk num_shared", lambda: ops.router_topk(x2, torch.randn(6, 8, **d), 2, num_shared=-1),
         "num_shared"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_launcher_checks_its_arguments_on_both_backends(device, backend):
    with ops.backend(backend):
        for name, call, match in _bad_calls(device):
            with pytest.raises(ValueError, match=match):
                call()
                pytest.fail(f"{name}: no ValueError")
