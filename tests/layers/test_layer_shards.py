"""What each rank of a sharded layer holds, against the whole layer's weights read by meaning.

One process stands for every rank (as in test_linear.py). The whole layer's outputs are cut by
what they mean (Mamba2's in_proj output into z, x, B, C, dt per head and group; attention's
q/k/v per head; the experts' features) and each rank's layer must compute exactly its heads,
groups or features; the row-parallel parts must sum to the whole; the gated norm of a group
spread over ranks, with its sum of squares summed over them, must equal the whole norm.
"""

import pytest
import torch

from mambaserve import ops
from mambaserve.distributed import TensorParallelGroup, building_with
from mambaserve.layers import mamba2
from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba1 import MambaMixer
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.moe import GraniteMoE
from tests.layers.shards import per_rank, whole_and_file

P, N, HIDDEN = 4, 3, 16


def mixer(H, G, **kw):
    return Mamba2Mixer(hidden_size=HIDDEN, num_heads=H, head_dim=P, d_state=N, n_groups=G, conv_kernel=4,
                       chunk_size=8, **kw)


@pytest.mark.parametrize("H, G, R", [(8, 1, 2), (8, 1, 4), (8, 2, 2), (8, 2, 4), (8, 8, 4), (4, 4, 2)])
def test_mamba2_rank_holds_its_heads_and_the_groups_they_read(tmp_path, H, G, R, no_collectives):
    whole, path = whole_and_file(lambda: mixer(H, G), tmp_path)
    parts = per_rank(lambda: mixer(H, G), R, path)
    x = torch.randn(5, HIDDEN)
    I = H * P
    z, xs, B, C, dt = whole.in_proj(x).split([I, I, G * N, G * N, H], dim=1)
    conv_x, conv_B, conv_C = whole.conv1d.weight.split([I, G * N, G * N])
    y = torch.randn(5, I)
    for r, part in enumerate(parts):
        heads = list(range(r * H // R, (r + 1) * H // R))
        groups = sorted({h // (H // G) for h in heads})
        want = torch.cat([pick(z, H, heads), pick(xs, H, heads), pick(B, G, groups), pick(C, G, groups),
                          dt[:, heads]], dim=1)
        torch.testing.assert_close(part.in_proj(x), want)
        want_conv = torch.cat([pick_rows(conv_x, H, heads), pick_rows(conv_B, G, groups), pick_rows(conv_C, G, groups)])
        assert torch.equal(part.conv1d.weight, want_conv)
        for name in ("A_log", "D", "dt_bias"):
            assert torch.equal(getattr(part, name), getattr(whole, name)[heads])
        assert torch.equal(part.norm.weight, whole.norm.weight.view(H, P)[heads].flatten())
        spec = part.cache_spec(ops_dtypes())
        assert spec.ssm_shape == (len(heads), P, N) and spec.conv_shape == (3, len(heads) * P + 2 * len(groups) * N)
        assert part.norm_spans_ranks == (R > G)
    torch.testing.assert_close(sum(p.out_proj(by_rank(y, R, r)) for r, p in enumerate(parts)), whole.out_proj(y))


def pick(t, parts, chosen):
    """The columns of t (rows, parts * width) of the parts listed in `chosen` (heads or groups)."""
    return t.reshape(t.shape[0], parts, -1)[:, chosen].flatten(1)


def pick_rows(t, parts, chosen):
    """The rows of t (parts * height, ...) of the parts listed in `chosen`."""
    return t.reshape(parts, -1, *t.shape[1:])[chosen].flatten(0, 1)


def ops_dtypes():
    from mambaserve.cache.spec import CacheDtypes

    return CacheDtypes.of(torch.float32)


def by_rank(t, R, r):
    """Rank r's contiguous 1/R of t's features."""
    n = t.shape[1] // R
    return t[:, r * n:(r + 1) * n]


@pytest.mark.parametrize("H, G, R, before", [(8, 1, 4, False), (8, 2, 4, True), (8, 1, 2, True)])
def test_gated_norm_of_a_group_spread_over_ranks(tmp_path, monkeypatch, H, G, R, before):
    whole, path = whole_and_file(lambda: mixer(H, G, norm_before_gate=before), tmp_path)
    parts = per_rank(lambda: mixer(H, G, norm_before_gate=before), R, path)
    I = H * P
    y, z = torch.randn(6, I), torch.randn(6, I)
    want = ops.reference.rms_norm_gated(y, whole.norm.weight, z, whole.eps, I // G, before)
    sent = []  # pass 1: each rank's (T, n_groups) sums of squares; pass 2: their total to every rank
    monkeypatch.setattr(mamba2, "all_reduce", lambda t, group: sent.append(t.clone()) or t)
    for r, p in enumerate(parts):
        p._gated_norm_over_ranks(by_rank(y, R, r), by_rank(z, R, r))
    total = sum(sent)
    monkeypatch.setattr(mamba2, "all_reduce", lambda t, group: total)
    got = torch.cat([p._gated_norm_over_ranks(by_rank(y, R, r), by_rank(z, R, r)) for r, p in enumerate(parts)], 1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("H, G, R, reason", [(6, 3, 2, "n_groups=3"), (6, 1, 4, "Mamba2 heads"),
                                             (8, 2, 3, "Mamba2 heads")])
def test_mamba2_splits_that_do_not_fit_are_refused(H, G, R, reason):
    with building_with(TensorParallelGroup(rank=0, world_size=R)), torch.device("meta"), \
            pytest.raises(ValueError, match=reason):
        mixer(H, G)


@pytest.mark.parametrize("Q, K, R", [(4, 1, 2), (4, 2, 4), (8, 4, 2), (4, 4, 4), (8, 2, 8)])
def test_attention_rank_holds_its_query_heads_and_the_kv_heads_they_read(tmp_path, Q, K, R, no_collectives):
    D = 4
    def build():
        return Attention(hidden_size=HIDDEN, num_heads=Q, num_kv_heads=K, head_dim=D, scale=0.5, bias=True)

    whole, path = whole_and_file(build, tmp_path)
    parts = per_rank(build, R, path)
    x = torch.randn(3, HIDDEN)
    q, k = whole.q_proj(x).view(3, Q, D), whole.k_proj(x).view(3, K, D)
    for r, part in enumerate(parts):
        q_heads = list(range(r * Q // R, (r + 1) * Q // R))
        kv_heads = sorted({h // (Q // K) for h in q_heads})
        torch.testing.assert_close(part.q_proj(x).view(3, -1, D), q[:, q_heads])
        torch.testing.assert_close(part.k_proj(x).view(3, -1, D), k[:, kv_heads])
        assert part.num_kv_heads == len(kv_heads) == max(1, K // R)
        # the kernel's grouping of the rank's heads (local head i reads local kv head i // group)
        # is the whole layer's
        group = part.num_heads // part.num_kv_heads
        assert [kv_heads[i // group] for i in range(len(q_heads))] == [h // (Q // K) for h in q_heads]
    out = torch.randn(3, Q * D)
    torch.testing.assert_close(sum(p.o_proj(by_rank(out, R, r)) for r, p in enumerate(parts)), whole.o_proj(out))


def test_attention_kv_heads_that_do_not_replicate_evenly_are_refused():
    with building_with(TensorParallelGroup(rank=0, world_size=4)), torch.device("meta"), \
            pytest.raises(ValueError, match="exceeds num_key_value_heads=3"):
        Attention(hidden_size=HIDDEN, num_heads=12, num_kv_heads=3, head_dim=4, scale=0.5)


@pytest.mark.parametrize("R", [2, 4])
def test_mamba1_rank_holds_its_channels(tmp_path, R, no_collectives):
    def build():
        return MambaMixer(hidden_size=HIDDEN, intermediate_size=16, d_state=N, conv_kernel=4, time_step_rank=2,
                          use_bias=True)

    whole, path = whole_and_file(build, tmp_path)
    parts = per_rank(build, R, path)
    x = torch.randn(5, HIDDEN)
    xs, z = whole.in_proj(x).chunk(2, dim=1)
    inner = torch.randn(5, 16)
    for r, part in enumerate(parts):
        torch.testing.assert_close(part.in_proj(x), torch.cat([by_rank(xs, R, r), by_rank(z, R, r)], dim=1))
        assert torch.equal(part.A_log, whole.A_log[r * 16 // R:(r + 1) * 16 // R])
    # x_proj row-parallel: its parts sum to dt, B and C; out_proj likewise (bias once)
    torch.testing.assert_close(sum(p.x_proj(by_rank(inner, R, r)) for r, p in enumerate(parts)), whole.x_proj(inner))
    torch.testing.assert_close(sum(p.out_proj(by_rank(inner, R, r)) for r, p in enumerate(parts)),
                               whole.out_proj(inner))


@pytest.mark.parametrize("R", [2, 4])
def test_moe_rank_holds_each_experts_features(tmp_path, R):
    whole, path = whole_and_file(lambda: GraniteMoE(HIDDEN, 8, num_experts=3, top_k=2), tmp_path)
    parts = per_rank(lambda: GraniteMoE(HIDDEN, 8, num_experts=3, top_k=2), R, path)
    gate, up = whole.input_linear.weight.chunk(2, dim=1)  # (E, I, H) each
    n = 8 // R
    for r, part in enumerate(parts):
        want = torch.cat([gate[:, r * n:(r + 1) * n], up[:, r * n:(r + 1) * n]], dim=1)
        assert torch.equal(part.input_linear.weight, want)
        assert torch.equal(part.output_linear.weight, whole.output_linear.weight[:, :, r * n:(r + 1) * n])
        assert torch.equal(part.router.layer.weight, whole.router.layer.weight)  # the router is whole
