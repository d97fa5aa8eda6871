"""Low-rank adapters keyed by the depth that uses them (Hu et al. 2021, "LoRA", section 4.1).

Zamba2's shared transformer blocks run at several depths with the same weights; each depth adds
its own low-rank term to some projections: W x + B_d(A_d x). The adapters of all depths live
in one `nn.ModuleDict`, keyed by depth, named `{d}.0.weight` (A_d: rank x in_features) and
`{d}.1.weight` (B_d: out_features x rank), as in the checkpoints.

Under tensor parallelism A_d is whole on every rank and B_d holds the output rows of the
projection it adds to (column-parallel, the same rows as that projection's shard).
"""

from __future__ import annotations

from torch import nn

from mambaserve.layers.linear import ColumnParallelLinear


def lora_adapters(keys, in_features: int, rank: int, out_features: int,
                  out_ranges: list[tuple[int, int]] | None = None) -> nn.ModuleDict:
    """One bias-free x -> B(A(x)) per key of `keys` (ints or strings), stored under str(key).
    out_ranges: the rank's rows of B (of out_features; default: its even share)."""
    return nn.ModuleDict({
        str(k): nn.Sequential(nn.Linear(in_features, rank, bias=False),
                              ColumnParallelLinear(rank, out_features, bias=False, ranges=out_ranges))
        for k in keys
    })
