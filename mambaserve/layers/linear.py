"""Tensor-parallel linear layers and the shards of the checkpoint tensors they hold.

Megatron-LM's split (Shoeybi et al. 2019, arXiv 1909.08053, section 3): a column-parallel
linear holds some rows of the weight (output features) and its output stays split; a
row-parallel one holds the matching columns (input features) and its partial products are
summed over the ranks by one all-reduce. A column-parallel layer followed by a row-parallel
one (in_proj and out_proj, q/k/v and o_proj, up and down) thus costs one all-reduce.

A `Shard` says which part of the checkpoint tensor a parameter holds: along one dimension,
the concatenation of some index ranges of the full tensor (a packed weight such as Mamba2's
in_proj [z | x | B | C | dt] holds one range of each segment), zero-padded to the local size
(the vocabulary's last shard). Its `load` reads only those ranges from a safetensors slice: a
rank never reads the whole tensor. Layers register the shards of their parameters with
`set_shard`; the loader reads them with `shards_of`.

Every class here is the plain layer at tensor_parallel_size 1: an `nn.Linear` or
`nn.Embedding` with the whole weight, no shard registered, no collective, the same ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.distributed import TensorParallelGroup, all_gather, all_reduce, current_group


def divide(size: int, group: TensorParallelGroup, what: str) -> int:
    """size / world_size, or ValueError naming `what` when the ranks cannot share it evenly."""
    if size % group.world_size:
        raise ValueError(f"tensor_parallel_size={group.world_size} does not divide {what}: {size} is not a multiple "
                         f"of {group.world_size}")
    return size // group.world_size


def even_range(size: int, group: TensorParallelGroup, what: str) -> tuple[int, int]:
    """The rank's contiguous 1/world_size of range(size): (start, end). ValueError as `divide`."""
    n = divide(size, group, what)
    return group.rank * n, (group.rank + 1) * n


def packed_ranges(sizes: list[int], group: TensorParallelGroup, what: str) -> list[tuple[int, int]]:
    """The rank's range of each segment of a packed dimension (segments of `sizes`, back to
    back; e.g. [gate; up]), each split evenly."""
    ranges, offset = [], 0
    for size in sizes:
        start, end = even_range(size, group, what)
        ranges.append((offset + start, offset + end))
        offset += size
    return ranges


@dataclass(frozen=True)
class Shard:
    """A parameter holding, along `dim`, the ranges `ranges` (start, end) of a checkpoint
    tensor that is `full_size` long there, back to back, then zeros up to its own length."""

    dim: int
    full_size: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Rows (along dim) that come from the checkpoint."""
        return sum(end - start for start, end in self.ranges)

    @torch.no_grad()
    def load(self, param: torch.Tensor, loaded, name: str) -> None:
        """Copy the shard of `loaded` (a safetensors slice, as `safe_open.get_slice` gives, or a
        tensor) into `param`, reading only its ranges. Raises ValueError naming the tensor when
        its shape is not the full shape of `param`'s shard."""
        shape = tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape)
        want = list(param.shape)
        want[self.dim] = self.full_size
        if shape != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(want)}")
        index = [slice(None)] * len(shape)
        offset = 0
        for start, end in self.ranges:
            if end > start:
                index[self.dim] = slice(start, end)
                param.narrow(self.dim, offset, end - start).copy_(loaded[tuple(index)])
            offset += end - start
        if offset < param.shape[self.dim]:
            param.narrow(self.dim, offset, param.shape[self.dim] - offset).zero_()


def set_shard(module: nn.Module, param_name: str, shard: Shard, group: TensorParallelGroup) -> None:
    """Register that module.<param_name> holds `shard` (nothing at tensor_parallel_size 1:
    the parameter is the whole tensor)."""
    if group.world_size == 1:
        return
    if "tp_shards" not in module.__dict__:
        module.tp_shards = {}
    module.tp_shards[param_name] = shard


def shards_of(model: nn.Module) -> dict[str, Shard]:
    """Every registered shard of `model`, by full parameter name."""
    return {f"{mod_name}.{p}" if mod_name else p: shard
            for mod_name, mod in model.named_modules() for p, shard in getattr(mod, "tp_shards", {}).items()}


class LinearBase(nn.Linear):
    """An nn.Linear whose product goes through `quant_method` when one is set (an FP8 weight:
    `layers.quantization`), else F.linear. supports_fp8=False marks an instance whose weight
    another op reads as it is (it then stays in the model dtype)."""

    quant_method = None
    supports_fp8 = True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): this layer's product with a bias of the caller's choice."""
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W_r^T (+ b_r): the rows `ranges` of the full (output_size, input_size) weight
    (default: the rank's even share). x: (T, input_size) -> (T, local rows), split like the
    weight; no collective."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 ranges: list[tuple[int, int]] | None = None, what: str = "the output features"):
        group = current_group()
        ranges = ranges or [even_range(output_size, group, what)]
        super().__init__(input_size, sum(e - s for s, e in ranges), bias=bias)
        self.tp_group = group
        set_shard(self, "weight", Shard(0, output_size, tuple(ranges)), group)
        if bias:
            set_shard(self, "bias", Shard(0, output_size, tuple(ranges)), group)


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x_r W_r^T, + b: the columns `ranges` of the full (output_size,
    input_size) weight (default: the rank's even share); the bias is whole and added once (by
    rank 0 before the sum). x: (T, local columns) -> (T, output_size). reduce_results=False
    leaves the rank's partial sum for the caller to add to others before one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 ranges: list[tuple[int, int]] | None = None, reduce_results: bool = True,
                 what: str = "the input features"):
        group = current_group()
        ranges = ranges or [even_range(input_size, group, what)]
        super().__init__(sum(e - s for s, e in ranges), output_size, bias=bias)
        self.tp_group = group
        self.reduce_results = reduce_results
        set_shard(self, "weight", Shard(1, input_size, tuple(ranges)), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        if group.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x, self.bias if group.is_driver else None)
        return all_reduce(y, group) if self.reduce_results else y


def linear_of_partial(linear: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """A whole (replicated, from `replicated_linear`) linear applied to a rank's partial sum x: its partial share of
    linear(sum of x), the bias added by rank 0 only (the MoE latent projection after experts
    whose outputs are partial)."""
    group = linear.tp_group
    if group.world_size == 1 or linear.bias is None or group.is_driver:
        return linear(x)
    return linear.matmul(x, None)


def replicated_linear(input_size: int, output_size: int, bias: bool = False) -> LinearBase:
    """A linear whole on every rank (small projections), which knows its group."""
    layer = LinearBase(input_size, output_size, bias=bias)
    layer.tp_group = current_group()
    return layer


def _vocab_range(vocab_size: int, group: TensorParallelGroup) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank r holds token ids [start, end), padded to the rows."""
    per = math.ceil(vocab_size / group.world_size)
    start = min(group.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings split by vocabulary: rank r holds ids [vocab_start, vocab_end), in
    ceil(vocab / world_size) rows (the last rank's tail zero-padded). ids: (T,) -> (T, dim):
    each rank embeds its own ids, zeros for the others, and one all-reduce sums them."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        group = current_group()
        start, end, per = _vocab_range(num_embeddings, group)
        super().__init__(per, embedding_dim)
        self.tp_group, self.vocab_start, self.vocab_end = group, start, end
        self.vocab_size = num_embeddings
        set_shard(self, "weight", Shard(0, num_embeddings, ((start, end),)), group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~mine[..., None], 0)
        return all_reduce(out, self.tp_group)


class ParallelLMHead(nn.Module):
    """The output projection split by vocabulary like `VocabParallelEmbedding` (and tied to it
    when the embeddings are: the same rows). hidden: (n, dim) -> logits (n, vocab_size) in the
    weight's dtype: each rank's rows, all-gathered and cut to the vocabulary; callers pass only
    the rows sampling needs."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        group = current_group()
        start, end, per = _vocab_range(vocab_size, group)
        self.tp_group, self.vocab_size = group, vocab_size
        self.weight = nn.Parameter(torch.empty(per, hidden_size))
        set_shard(self, "weight", Shard(0, vocab_size, ((start, end),)), group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # (n, rows of this rank)
        if self.tp_group.world_size == 1:
            return logits
        return all_gather(logits, self.tp_group, dim=-1)[..., : self.vocab_size]
