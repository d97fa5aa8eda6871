"""The PyTorch reference ops against direct, naive float64 recurrences on odd shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

from mambaserve import ops
from tests.conftest import rel_err


def _packed(lens):
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return qsl, int(qsl[-1])


def naive_conv(x_seq, w, b, init):
    """Direct sum over taps, float64."""
    width = w.shape[1]
    xs = torch.cat([init, x_seq])
    out = []
    for t in range(x_seq.shape[0]):
        acc = b.clone() if b is not None else torch.zeros(x_seq.shape[1], dtype=x_seq.dtype)
        for k in range(width):
            acc = acc + w[:, k] * xs[t + k]
        out.append(F.silu(acc))
    return torch.stack(out) if out else x_seq.new_zeros(0, x_seq.shape[1]), xs[xs.shape[0] - (width - 1):]


@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_reference(width):
    dim, num_slots = 37, 9
    lens = [1, 2, 3, 7, 1, 12]
    qsl, T = _packed(lens)
    x = torch.randn(T, dim, dtype=torch.float64)
    w = torch.randn(dim, width, dtype=torch.float64)
    b = torch.randn(dim, dtype=torch.float64)
    states = torch.randn(num_slots, width - 1, dim, dtype=torch.float64)
    idx = torch.tensor([4, -1, 0, 7, 2, 5], dtype=torch.int32)
    has = torch.tensor([True, True, False, True, True, False])
    before = states.clone()
    out = ops.causal_conv1d(x, w, b, states, qsl, idx, has)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        slot = int(idx[i])
        init = before[slot] if slot >= 0 and has[i] else torch.zeros(width - 1, dim, dtype=torch.float64)
        o, st = naive_conv(x[s:e], w, b, init)
        assert rel_err(out[s:e], o) < 1e-12
        if slot >= 0:
            assert torch.equal(states[slot], st)
    for slot in set(range(num_slots)) - {int(i) for i in idx if i >= 0}:
        assert torch.equal(states[slot], before[slot])


def naive_ssm(x, dt, A, B, C, D, z, h):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, y *= silu(z); float64, one token at a time."""
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        y = (h * C[t][:, None, :]).sum(-1) + D[:, None] * x[t]
        if z is not None:
            y = y * F.silu(z[t])
        ys.append(y)
    return torch.stack(ys), h


@pytest.mark.parametrize("ngroups", [1, 3])
@pytest.mark.parametrize("chunk_size", [4, 8])
def test_ssd_chunk_scan_reference(ngroups, chunk_size):
    H, P, N, num_slots = 6, 5, 7, 8
    lens = [1, 2, chunk_size - 1, chunk_size, chunk_size + 1, 3 * chunk_size + 2]
    qsl, T = _packed(lens)
    d = torch.float64
    x = torch.randn(T, H, P, dtype=d)
    dt = torch.randn(T, H, dtype=d)
    A = -torch.rand(H, dtype=d) * 2
    B = torch.randn(T, ngroups, N, dtype=d)
    C = torch.randn(T, ngroups, N, dtype=d)
    D = torch.randn(H, dtype=d)
    z = torch.randn(T, H, P, dtype=d)
    dt_bias = torch.randn(H, dtype=d)
    states = torch.randn(num_slots, H, P, N, dtype=d)
    before = states.clone()
    idx = torch.tensor([3, 0, -1, 6, 1, 5], dtype=torch.int32)
    has = torch.tensor([True, False, True, True, False, True])
    limit = (0.01, 5.0)
    y = ops.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, states, qsl, idx, has, dt_limit=limit)
    dtp = F.softplus(dt + dt_bias).clamp(*limit)
    rep = H // ngroups
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        slot = int(idx[i])
        h0 = before[slot] if slot >= 0 and has[i] else torch.zeros(H, P, N, dtype=d)
        yr, hr = naive_ssm(x[s:e], dtp[s:e], A, B[s:e].repeat_interleave(rep, 1), C[s:e].repeat_interleave(rep, 1), D,
                           z[s:e], h0)
        assert rel_err(y[s:e], yr) < 1e-10
        if slot >= 0:
            assert rel_err(states[slot], hr) < 1e-10
    for slot in {2, 4, 7}:
        assert torch.equal(states[slot], before[slot])


def test_ssd_state_update_reference():
    H, P, N, G, batch = 6, 3, 5, 2, 5
    d = torch.float64
    states = torch.randn(7, H, P, N, dtype=d)
    before = states.clone()
    x, z = torch.randn(batch, H, P, dtype=d), torch.randn(batch, H, P, dtype=d)
    dt, A = torch.randn(batch, H, dtype=d), -torch.rand(H, dtype=d)
    B, C = torch.randn(batch, G, N, dtype=d), torch.randn(batch, G, N, dtype=d)
    D, dt_bias = torch.randn(H, dtype=d), torch.randn(H, dtype=d)
    idx = torch.tensor([6, -1, 2, 0, 4], dtype=torch.int32)
    y = ops.ssd_state_update(states, x, dt, A, B, C, D, z, dt_bias, idx)
    dtp = F.softplus(dt + dt_bias)
    for i in range(batch):
        slot = int(idx[i])
        h0 = before[slot] if slot >= 0 else torch.zeros(H, P, N, dtype=d)
        yr, hr = naive_ssm(x[i:i + 1], dtp[i:i + 1], A, B[i:i + 1].repeat_interleave(H // G, 1),
                           C[i:i + 1].repeat_interleave(H // G, 1), D, z[i:i + 1], h0)
        assert rel_err(y[i], yr[0]) < 1e-12
        if slot >= 0:
            assert rel_err(states[slot], hr) < 1e-12
    for slot in (1, 3, 5):
        assert torch.equal(states[slot], before[slot])


def test_rms_norm_gated_reference():
    x, z = torch.randn(5, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    w = torch.randn(12, dtype=torch.float64)
    out = ops.rms_norm_gated(x, w, z, 1e-6, group_size=4)
    for t in range(5):
        for g in range(3):
            v = x[t, 4 * g:4 * g + 4] * F.silu(z[t, 4 * g:4 * g + 4])
            r = v / math.sqrt(float((v ** 2).mean()) + 1e-6) * w[4 * g:4 * g + 4]
            assert rel_err(out[t, 4 * g:4 * g + 4], r) < 1e-12
    with pytest.raises(ValueError):
        ops.rms_norm_gated(x, w, z, 1e-6, group_size=5)


def test_paged_attention_reference():
    H, KV, Dh, bs, nblocks = 6, 2, 8, 4, 20
    d = torch.float64
    k_cache = torch.randn(nblocks, bs, KV, Dh, dtype=d)
    v_cache = torch.randn(nblocks, bs, KV, Dh, dtype=d)
    seq_lens = [5, 1, 9]
    new = [2, 1, 9]
    tables = torch.randperm(nblocks)[:9].view(3, 3).int()
    qsl, T = _packed(new)
    q = torch.randn(T, H, Dh, dtype=d)
    k_new, v_new = torch.randn(T, KV, Dh, dtype=d), torch.randn(T, KV, Dh, dtype=d)
    slots = []
    for i in range(3):
        for pos in range(seq_lens[i] - new[i], seq_lens[i]):
            slots.append(int(tables[i, pos // bs]) * bs + pos % bs)
    ops.reshape_and_cache(k_new, v_new, k_cache, v_cache, torch.tensor(slots))
    out = ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, 0.3)
    for i in range(3):
        keys = torch.stack([k_cache[tables[i, p // bs], p % bs] for p in range(seq_lens[i])])  # (S, KV, Dh)
        vals = torch.stack([v_cache[tables[i, p // bs], p % bs] for p in range(seq_lens[i])])
        for j in range(new[i]):
            pos = seq_lens[i] - new[i] + j
            t = int(qsl[i]) + j
            for h in range(H):
                s = (keys[: pos + 1, h // 3] @ q[t, h]) * 0.3
                r = torch.softmax(s, 0) @ vals[: pos + 1, h // 3]
                assert rel_err(out[t, h], r) < 1e-12


def test_fused_moe_reference():
    T, Hd, I, E, K = 9, 8, 6, 5, 2
    d = torch.float64
    x = torch.randn(T, Hd, dtype=d)
    w1, w2 = torch.randn(E, 2 * I, Hd, dtype=d), torch.randn(E, Hd, I, dtype=d)
    ids = torch.randint(0, E - 1, (T, K))  # expert E-1 gets no tokens
    wts = torch.rand(T, K, dtype=d)
    out = ops.fused_moe(x, w1, w2, wts, ids)
    for t in range(T):
        r = torch.zeros(Hd, dtype=d)
        for k in range(K):
            e = int(ids[t, k])
            g, u = (w1[e] @ x[t]).chunk(2)
            r += wts[t, k] * (w2[e] @ (F.silu(g) * u))
        assert rel_err(out[t], r) < 1e-12


def test_backend_name_checked():
    with pytest.raises(ValueError):
        with ops.backend("cuda"):
            pass
