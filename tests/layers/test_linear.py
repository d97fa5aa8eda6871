"""The parallel linear layers and their shards, one process standing for every rank.

Each rank's layer is built with `building_with(its group)` and loaded from a safetensors file of
the whole layer's weights; the collectives are replaced by the identity, so each rank's output
is its own part: the column parallel parts concatenated, the row parallel parts summed, the
vocabulary parts summed (embeddings) or concatenated (logits) must give the whole layer's.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from mambaserve.distributed import TensorParallelGroup, building_with
from mambaserve.layers import linear
from mambaserve.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    shards_of,
)
from tests.layers.shards import per_rank, whole_and_file


def test_shard_reads_only_its_ranges_and_pads_with_zeros(tmp_path):
    full = torch.randn(10, 3)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    p = torch.full((6, 3), float("nan"))
    shard = Shard(0, 10, ((1, 3), (7, 9)))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        shard.load(p, f.get_slice("w"), "w")
    assert torch.equal(p[:4], torch.cat([full[1:3], full[7:9]])) and torch.equal(p[4:], torch.zeros(2, 3))
    cols = torch.full((10, 2), float("nan"))
    Shard(1, 3, ((1, 3),)).load(cols, full, "w")  # a tensor works as the slice
    assert torch.equal(cols, full[:, 1:3])
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \(10, 3\), expected \(12, 3\)"):
        Shard(0, 12, ((0, 6),)).load(p, full, "w")


def test_one_rank_registers_no_shard_and_computes_the_plain_layer():
    x = torch.randn(5, 8)
    col, row = ColumnParallelLinear(8, 6, bias=True), RowParallelLinear(8, 6, bias=True)
    emb, head = VocabParallelEmbedding(11, 8), ParallelLMHead(11, 8)
    torch.nn.init.normal_(head.weight)
    assert not shards_of(torch.nn.ModuleList([col, row, emb, head]))
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias)) and col.weight.shape == (6, 8)
    ids = torch.tensor([0, 10, 4])
    assert torch.equal(emb(ids), emb.weight[ids]) and torch.equal(head(x), x @ head.weight.T)


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_parts_concatenate_and_row_parts_sum_to_the_whole(tmp_path, world_size, no_collectives):
    x = torch.randn(5, 8)
    whole, path = whole_and_file(lambda: ColumnParallelLinear(8, 12, bias=True), tmp_path)
    parts = per_rank(lambda: ColumnParallelLinear(8, 12, bias=True), world_size, path)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=1), whole(x))
    def packed():  # [gate; up], each split
        return ColumnParallelLinear(8, 12, ranges=linear.packed_ranges([6, 6], linear.current_group(), "the test"))

    whole, path = whole_and_file(packed, tmp_path)
    parts = per_rank(packed, 2, path)
    gate, up = whole(x).chunk(2, dim=1)
    torch.testing.assert_close(torch.cat([p(x).chunk(2, dim=1)[0] for p in parts], dim=1), gate)
    torch.testing.assert_close(torch.cat([p(x).chunk(2, dim=1)[1] for p in parts], dim=1), up)
    whole, path = whole_and_file(lambda: RowParallelLinear(12, 8, bias=True), tmp_path)
    parts = per_rank(lambda: RowParallelLinear(12, 8, bias=True), world_size, path)
    y = torch.randn(5, 12)
    n = 12 // world_size
    torch.testing.assert_close(sum(p(y[:, r * n:(r + 1) * n]) for r, p in enumerate(parts)), whole(y))  # bias once


@pytest.mark.parametrize("vocab, world_size", [(11, 4), (12, 2), (3, 4)])
def test_vocabulary_parts_give_the_whole_embedding_and_logits(tmp_path, vocab, world_size, no_collectives):
    whole, path = whole_and_file(lambda: VocabParallelEmbedding(vocab, 8), tmp_path)
    parts = per_rank(lambda: VocabParallelEmbedding(vocab, 8), world_size, path)
    ids = torch.randint(0, vocab, (9,))
    torch.testing.assert_close(sum(p(ids) for p in parts), whole(ids))
    assert all(p.weight.shape[0] == -(-vocab // world_size) for p in parts)
    head_whole, path = whole_and_file(lambda: ParallelLMHead(vocab, 8), tmp_path)
    heads = per_rank(lambda: ParallelLMHead(vocab, 8), world_size, path)
    h = torch.randn(4, 8)
    torch.testing.assert_close(torch.cat([p(h) for p in heads], dim=-1)[:, :vocab], head_whole(h))


def test_uneven_split_is_a_value_error():
    with building_with(TensorParallelGroup(rank=0, world_size=4)), \
            pytest.raises(ValueError, match="does not divide the output features: 6 is not a multiple of 4"):
        ColumnParallelLinear(8, 6)
