"""Plain PyTorch twins of every op in `mambaserve.ops`: the math of each op.

They are the test oracle for the Triton kernels and the implementation used on the CPU. They
are written to be obviously right, not fast: a Python loop over the sequences of a packed batch,
float32 arithmetic (float64 when the inputs are float64), no fusion. Each op's arguments,
shapes, dtypes and errors are stated once, in its launcher (`mambaserve.ops.<file>.<op>`,
which checks them before calling the twin); here only the math.

Conventions shared by all ops:
- a packed batch holds sequence i in rows `query_start_loc[i]:query_start_loc[i+1]`;
- `state_indices[i]` names the slot of the state pool that sequence i reads and writes; -1
  marks a padding entry: its rows are computed from no initial state, and no slot is touched.

This module knows nothing about models or the engine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported activation {activation!r}; expected 'silu' or None")


def _sequences(query_start_loc: torch.Tensor, num_rows: int | None = None):
    """Yield (i, start, end) for every sequence of a packed batch (host sync: reference only).
    Raises ValueError, as the kernels do, when the offsets start below 0, decrease or end past
    num_rows (the rows of the packed input, when given)."""
    bounds = query_start_loc.tolist()
    if bounds and (bounds[0] < 0 or any(b < a for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"query_start_loc must be non-negative and non-decreasing, got {bounds}")
    if bounds and num_rows is not None and bounds[-1] > num_rows:
        raise ValueError(f"query_start_loc ends at {bounds[-1]}, past the {num_rows} rows of the input")
    for i in range(len(bounds) - 1):
        yield i, bounds[i], bounds[i + 1]


def causal_conv1d(x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state,
                  activation="silu", state_saves=None):
    """The math of `causal_conv1d`, see `ops.conv1d.causal_conv1d`: out[t, d] = act(bias[d] +
    sum_k weight[d, k] * xs[t + k, d]) where xs is the sequence preceded by its width - 1
    previous inputs (the conv state, or zeros). The slot then holds the last width - 1 rows of
    xs (Mamba2 paper, section 7: the short convolution on x, B, C); a state save's row the
    width - 1 inputs before its position."""
    width = weight.shape[1]
    cdt = _compute_dtype(x)
    out = torch.empty_like(x)
    w = weight.to(cdt)
    for i, start, end in _sequences(query_start_loc, x.shape[0]):
        slot = int(state_indices[i])
        if slot >= 0 and bool(has_initial_state[i]):
            prev = conv_states[slot].to(cdt)  # (width - 1, dim)
        else:
            prev = x.new_zeros(width - 1, x.shape[1], dtype=cdt)
        xs = torch.cat([prev, x[start:end].to(cdt)], dim=0)  # (width - 1 + L, dim)
        if end > start:  # an empty sequence has no output, only its state update
            y = F.conv1d(xs.t().unsqueeze(0), w.unsqueeze(1), groups=x.shape[1])[0].t()  # (L, dim)
            if bias is not None:
                y = y + bias.to(cdt)
            out[start:end] = _activate(y, activation).to(x.dtype)
        if slot >= 0 and width > 1:
            conv_states[slot] = xs[xs.shape[0] - (width - 1) :].to(conv_states.dtype)
        for b, row in _save_points(state_saves, i, start, end)[:-1] if state_saves else []:
            if width > 1:  # the width - 1 inputs before the saved position (xs is offset by width - 1)
                conv_states[row] = xs[b - start : b - start + width - 1].to(conv_states.dtype)
    return out


def causal_conv1d_update(x, conv_states, weight, bias, state_indices, activation="silu"):
    """The math of `causal_conv1d_update`, see `ops.conv1d.causal_conv1d_update`: `causal_conv1d`
    with every sequence of length 1 and an initial state."""
    batch = x.shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    has_init = torch.ones(batch, dtype=torch.bool, device=x.device)
    return causal_conv1d(x, weight, bias, conv_states, qsl, state_indices, has_init, activation)


def _process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt):
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a: (..., T) -> (..., T, T) with out[..., i, j] = sum(a[..., j+1 : i+1]) for j <= i, -inf above."""
    T = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return out.masked_fill(~mask, -math.inf)


def ssd_sequence(x, dt, A, B, C, chunk_size, initial_state):
    """The SSD chunked scan of one sequence (Mamba2 paper, section 6, the minimal SSD listing).

    x: (L, H, P); dt: (L, H) already processed; A: (H,); B, C: (L, H, N) (groups expanded);
    initial_state: (H, P, N) or None. All in one float dtype. Returns y (L, H, P) without the
    D skip, and the final state (H, P, N).
    """
    L, H, P = x.shape
    N = B.shape[-1]
    pad = (-L) % chunk_size
    if pad:
        # Padding with dt = 0 leaves the state untouched: exp(0 * A) = 1 and dt * x = 0.
        x, dt, B, C = (F.pad(t, (0,) * (2 * t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = x.shape[0] // chunk_size
    xdt = (x * dt[..., None]).view(c, chunk_size, H, P)  # (c, l, H, P)
    Bc = B.view(c, chunk_size, H, N)
    Cc = C.view(c, chunk_size, H, N)
    dA = (dt * A).view(c, chunk_size, H).permute(2, 0, 1)  # (H, c, l)
    dA_cs = torch.cumsum(dA, dim=-1)  # (H, c, l)

    # 1. within each chunk: the quadratic (attention-like) form
    decay = torch.exp(_segsum(dA))  # (H, c, l, s)
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", Cc, Bc, decay, xdt)
    # 2. each chunk's own contribution to the state at its end
    decay_to_end = torch.exp(dA_cs[:, :, -1:] - dA_cs)  # (H, c, l)
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", Bc, decay_to_end, xdt)  # (c, H, P, N)
    # 3. pass states across chunk boundaries, starting from the initial state
    h0 = initial_state if initial_state is not None else x.new_zeros(H, P, N)
    chunk_states = torch.cat([h0[None], chunk_states], dim=0)  # (c + 1, H, P, N)
    decay_chunk = torch.exp(_segsum(F.pad(dA_cs[:, :, -1], (1, 0))))  # (H, c + 1, c + 1)
    states = torch.einsum("hzc,chpn->zhpn", decay_chunk, chunk_states)  # (c + 1, H, P, N)
    # 4. the state entering each chunk, read out by C
    y_off = torch.einsum("clhn,chpn,hcl->clhp", Cc, states[:-1], torch.exp(dA_cs))
    y = (y_diag + y_off).reshape(c * chunk_size, H, P)[:L]
    return y, states[-1]


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(T, ngroups, N) -> (T, nheads, N): head h reads group h // (nheads // ngroups)."""
    return t.repeat_interleave(nheads // t.shape[1], dim=1)


def _save_points(state_saves, i: int, start: int, end: int) -> list[tuple[int, int]]:
    """(end row, save row) of the pieces of sequence i's rows start:end cut at its state saves; the last: -1."""
    return [*((start + o, r) for j, o, r in zip(state_saves.seq, state_saves.offset, state_saves.row) if j == i),
            (end, -1)]


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, ssm_states, query_start_loc, state_indices,
                   has_initial_state, dt_softplus=True, dt_limit=(0.0, math.inf), state_saves=None):
    """The math of `ssd_chunk_scan` (Mamba2), see `ops.ssd.ssd_chunk_scan` (Mamba2 paper,
    sections 3 and 6): dt' = clamp(softplus(dt + dt_bias), dt_limit); h_t = exp(dt'_t A) h_{t-1}
    + dt'_t x_t B_t^T; y_t = h_t C_t + D x_t; y *= silu(z). Computed per sequence with the
    chunked SSD algorithm in float32 (float64 for float64 x). A sequence with state saves is
    computed piece by piece, each piece's final state written into its save row and read back
    from it (in ssm_states' dtype) as the next piece's initial state: a step ending there."""
    cdt = _compute_dtype(x)
    nheads = x.shape[1]
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # (T, H)
    Bh = _expand_groups(B.to(cdt), nheads)
    Ch = _expand_groups(C.to(cdt), nheads)
    xc = x.to(cdt)
    Ac = A.to(cdt)
    y = torch.empty_like(xc)
    for i, start, end in _sequences(query_start_loc, x.shape[0]):
        slot = int(state_indices[i])
        init = ssm_states[slot].to(cdt) if slot >= 0 and bool(has_initial_state[i]) else None
        if end == start:
            if slot >= 0:
                ssm_states[slot] = (init if init is not None else torch.zeros_like(ssm_states[slot]))
            continue
        a = start
        for b, row in _save_points(state_saves, i, start, end) if state_saves else [(end, -1)]:
            # The result does not depend on the chunk size: a short sequence (a decode inside a
            # mixed batch) is one chunk of its own length instead of a mostly padded one.
            ys, final = ssd_sequence(xc[a:b], dtp[a:b], Ac, Bh[a:b], Ch[a:b], min(chunk_size, b - a), init)
            y[a:b] = ys
            if row >= 0:
                ssm_states[row] = final.to(ssm_states.dtype)
                init = ssm_states[row].to(cdt)
            a = b
        if slot >= 0:
            ssm_states[slot] = final.to(ssm_states.dtype)
    if D is not None:
        y = y + xc * D.to(cdt)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(x.dtype)


def ssd_state_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus=True,
                     dt_limit=(0.0, math.inf)):
    """The math of `ssd_state_update` (Mamba2 decode), see `ops.state_update.ssd_state_update`:
    `ssd_chunk_scan`'s recurrence for a single step."""
    cdt = _compute_dtype(x)
    nheads = x.shape[1]
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # (batch, H)
    Bh = _expand_groups(B.to(cdt), nheads)  # (batch, H, N)
    Ch = _expand_groups(C.to(cdt), nheads)
    xc = x.to(cdt)
    y = torch.empty_like(xc)
    for i in range(x.shape[0]):
        slot = int(state_indices[i])
        h = ssm_states[slot].to(cdt) if slot >= 0 else xc.new_zeros(ssm_states.shape[1:])
        dA = torch.exp(dtp[i] * A.to(cdt))  # (H,)
        h = h * dA[:, None, None] + (dtp[i][:, None] * xc[i])[..., None] * Bh[i][:, None, :]
        y[i] = (h * Ch[i][:, None, :]).sum(-1)
        if slot >= 0:
            ssm_states[slot] = h.to(ssm_states.dtype)
    if D is not None:
        y = y + xc * D.to(cdt)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(x.dtype)


def selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, query_start_loc, state_indices, has_initial_state,
                   dt_softplus=True):
    """The math of `selective_scan` (Mamba-1), see `ops.mamba1_scan.selective_scan` (Mamba paper,
    Gu & Dao 2023, section 3, Algorithm 2; zero-order hold on A, Euler on B): dt' =
    softplus(dt + dt_bias); h_t = exp(dt'_t A) * h_{t-1} + (dt'_t x_t) B_t (h: (dim, dstate));
    y_t = h_t C_t + D x_t; y *= silu(z). A token loop per sequence, in float32 (float64 for
    float64 x)."""
    cdt = _compute_dtype(x)
    dtp = _process_dt(dt, dt_bias, dt_softplus, (0.0, math.inf), cdt)  # (T, dim)
    xc, Bc, Cc, Ac = x.to(cdt), B.to(cdt), C.to(cdt), A.to(cdt)
    y = torch.empty_like(xc)
    for i, start, end in _sequences(query_start_loc, x.shape[0]):
        slot = int(state_indices[i])
        if slot >= 0 and bool(has_initial_state[i]):
            h = ssm_states[slot].to(cdt)  # (dim, dstate)
        else:
            h = xc.new_zeros(A.shape)
        for t in range(start, end):
            h = torch.exp(dtp[t][:, None] * Ac) * h + (dtp[t] * xc[t])[:, None] * Bc[t][None, :]
            y[t] = h @ Cc[t]
        if slot >= 0:
            ssm_states[slot] = h.to(ssm_states.dtype)
    if D is not None:
        y = y + xc * D.to(cdt)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(x.dtype)


def selective_scan_update(ssm_states, x, dt, A, B, C, D, z, dt_bias, state_indices, dt_softplus=True):
    """The math of `selective_scan_update` (Mamba-1 decode), see
    `ops.mamba1_scan.selective_scan_update`: `selective_scan` with every sequence of length 1
    and an initial state."""
    batch = x.shape[0]
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    has_init = torch.ones(batch, dtype=torch.bool, device=x.device)
    return selective_scan(x, dt, A, B, C, D, z, dt_bias, ssm_states, qsl, state_indices, has_init, dt_softplus)


def rms_norm_gated(x, weight, z, eps, group_size, norm_before_gate=False):
    """The math of `rms_norm_gated`, see `ops.layernorm_gated.rms_norm_gated` (Mamba2 paper,
    section 7.2, "extra normalization"): norm_before_gate=False: weight * rmsnorm_g(x * silu(z));
    True: weight * rmsnorm_g(x) * silu(z), where rmsnorm_g divides each group of group_size
    features by its root mean square."""
    cdt = _compute_dtype(x)
    h = x.to(cdt)
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(cdt))
    shape = h.shape
    g = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    h = g.view(shape) * weight.to(cdt)
    if z is not None and norm_before_gate:
        h = h * F.silu(z.to(cdt))
    return h.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps, alpha=1.0):
    """The math of `fused_add_rms_norm`, see `ops.layernorm_gated.fused_add_rms_norm` (RMSNorm:
    Zhang & Sennrich 2019): residual <- residual + alpha * x, rounded once to residual's dtype
    (as `torch.add(residual, x, alpha=alpha)`; partial sums are first added in order in
    float32), then weight * rmsnorm(residual) in float32."""
    if x.dim() == 3:  # partial sums: added in order in float32, then rounded once with the residual
        total = x[0].to(_compute_dtype(x))
        for part in x[1:]:
            total = total + part.to(total.dtype)
        residual.copy_(residual.to(total.dtype) + alpha * total)
        return rms_norm_gated(residual, weight, None, eps, residual.shape[-1])
    residual.copy_(torch.add(residual, x, alpha=alpha))
    return rms_norm_gated(residual, weight, None, eps, residual.shape[-1]).to(x.dtype)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, num_splits: int = 1) -> torch.Tensor:
    """The math of `linear_partials`, see `ops.gemv.linear_partials`: x @ weight^T as num_splits
    partial sums over equal slices of K, in float32 (float64 for float64 input)."""
    cdt = _compute_dtype(x)
    K = x.shape[1]
    bounds = [K * i // num_splits for i in range(num_splits + 1)]
    return torch.stack([x[:, a:b].to(cdt) @ weight[:, a:b].to(cdt).t() for a, b in zip(bounds, bounds[1:])])


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """The math of `reshape_and_cache`, see `ops.attention.reshape_and_cache`: cache row
    slot = block * block_size + offset of each token gets its k and v; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache[slots // block_size, slots % block_size] = k[valid].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[valid].to(v_cache.dtype)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale=1.0, v_scale=1.0):
    """The math of `paged_attention`, see `ops.attention.paged_attention`: the j-th new token of
    a sequence sits at position seq_len - num_new + j and sees keys 0..that position;
    softmax(scale * q k^T) v in float32 (Attention Is All You Need, 3.2.1), query head h reading
    kv head h // (num_heads // num_kv_heads); keys k_cache * k_scale, values v_cache * v_scale."""
    cdt = _compute_dtype(q)
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i, start, end in _sequences(query_start_loc, q.shape[0]):
        n_new = end - start
        if n_new == 0:
            continue
        seq_len = int(seq_lens[i])
        n_blocks = -(-seq_len // block_size)
        if seq_len < n_new:
            raise ValueError("seq_lens must be at least each sequence's number of new tokens")
        if n_blocks > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns, a sequence needs {n_blocks}")
        blocks = block_table[i, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:seq_len].to(cdt) * k_scale
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[-1])[:seq_len].to(cdt) * v_scale
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (S, H, Dh)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        qs = q[start:end].to(cdt)  # (n, H, Dh)
        scores = torch.einsum("nhd,shd->hns", qs, k) * scale
        q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hns,shd->nhd", probs, v).to(q.dtype)
    return out


def fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, add=None):
    """The math of `fused_moe`, see `ops.moe.fused_moe` (Shazeer et al. 2017, top-k routing;
    GLU: Shazeer 2020): out[t] = sum_k topk_weights[t, k] * expert_{ids[t,k]}(x_t) with
    expert_e(x) = w2[e] @ (silu(g) * u), [g; u] = w1[e] @ x, plus `add` when given, rounded once."""
    cdt = _compute_dtype(hidden_states)
    x = hidden_states.to(cdt)
    out = torch.zeros_like(x) if add is None else add.to(cdt).clone()
    inter = w2.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        tok, k = torch.where(topk_ids == e)
        h = x[tok] @ w1[e].to(cdt).t()  # (n, 2 * inter)
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = h @ w2[e].to(cdt).t()  # (n, hidden)
        out.index_add_(0, tok, y * topk_weights[tok, k].to(cdt)[:, None])
    return out.to(hidden_states.dtype)


def router_topk(x, router_weight, top_k, out_dtype, num_shared=0, renormalize=True):
    """The math of `router_topk`, see `ops.moe.router_topk`: the router's logits
    x @ router_weight^T (in x's dtype, as the checkpoints' Linear computes them), then
    `topk_softmax`."""
    return topk_softmax(F.linear(x, router_weight), top_k, out_dtype, num_shared, renormalize)


def silu_and_mul(h):
    """The math of `silu_and_mul`, see `ops.activation.silu_and_mul`: silu(h[:, :inter]) *
    h[:, inter:] (GLU variants, Shazeer 2020), in float32 (float64 for float64 input)."""
    cdt = _compute_dtype(h)
    gate, up = h.to(cdt).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(h.dtype)


def topk_softmax(logits, top_k, out_dtype, num_shared=0, renormalize=True):
    """The math of `topk_softmax`, see `ops.moe.topk_softmax` (Shazeer et al. 2017): the top_k
    largest logits of each row, in float32, and a softmax over just those (renormalize=True)
    or their entries of the softmax over all experts (False); ids int64, largest first, then
    the num_shared always-on experts num_experts + j with weight 1."""
    full = logits.to(_compute_dtype(logits))
    values, ids = full.topk(top_k, dim=-1)
    if renormalize:
        weights = torch.softmax(values, dim=-1).to(out_dtype)
    else:
        weights = torch.exp(values - torch.logsumexp(full, dim=-1, keepdim=True)).to(out_dtype)
    if num_shared:
        T, E = logits.shape
        extra = torch.arange(E, E + num_shared, device=ids.device).expand(T, num_shared)
        ids = torch.cat([ids, extra], dim=1)
        weights = torch.cat([weights, torch.ones(T, num_shared, dtype=out_dtype, device=weights.device)], dim=1)
    return weights, ids
