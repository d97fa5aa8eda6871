"""What a model's caches are: per-layer shapes, dtypes and byte counts, as plain descriptions.

Two kinds of cache, as in the Mamba2 hybrids (vLLM's `kv_cache_interface.py` draws the same
line):
- `MambaSpec`: the fixed-size state one request holds in one Mamba layer, in a state slot:
  a conv state (width - 1, conv_dim) and an SSM state ((nheads, headdim, dstate) for Mamba2,
  (d_inner, dstate) for Mamba-1). Its size does not grow with the sequence.
- `AttentionSpec`: the keys and values one token holds in one attention layer, in paged blocks
  of `block_size` tokens: K and V of (num_kv_heads, head_dim) each.
`CacheSpec` lists them by cache index (`mamba[i]` is the i-th Mamba layer's, `attention[j]` the
j-th KV cache's) and sums their bytes for the pool sizing.

Every stateful layer declares its own spec (`StatefulLayer`); the model collects them; the
engine sizes the pools from the byte counts and `cache.tensors` allocates from the shapes.
Under tensor parallelism each rank's layers declare their own shard (its Mamba heads and
channels, its KV heads): every rank allocates the same number of slots and blocks, each
holding the rank's part of a request's state, and one scheduler hands them out for all.
This module knows no layer, model or engine: a spec is data that later features (state
checkpoints for prefix caching, FP8 KV) extend with fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class CacheDtypes:
    """The dtypes the engine keeps each cache in: `conv` (the conv state holds the layer's input
    activations: the model dtype), `ssm` (the engine's mamba_ssm_cache_dtype: float32 keeps
    long decodes from drifting), `kv` (keys and values: the model dtype)."""

    conv: torch.dtype
    ssm: torch.dtype
    kv: torch.dtype

    @classmethod
    def of(cls, dtype: torch.dtype, ssm: torch.dtype | None = None) -> CacheDtypes:
        """Every cache in `dtype`, the SSM state in `ssm` when given."""
        return cls(conv=dtype, ssm=ssm or dtype, kv=dtype)


@dataclass(frozen=True)
class MambaSpec:
    """Per-request state of one Mamba layer: conv_shape (width - 1, conv_dim) in conv_dtype,
    ssm_shape (nheads, headdim, dstate) (Mamba2) or (d_inner, dstate) (Mamba-1) in ssm_dtype.
    saves_inside_prefill: the layer's prefill ops write state checkpoints at positions inside
    a chunk (`ForwardContext.state_saves`); without it a chunk must end at each checkpoint."""

    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    saves_inside_prefill: bool = False

    @property
    def conv_bytes(self) -> int:
        return math.prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        return math.prod(self.ssm_shape) * self.ssm_dtype.itemsize

    @property
    def bytes(self) -> int:
        """Bytes of one request's state in this layer (one slot)."""
        return self.conv_bytes + self.ssm_bytes


@dataclass(frozen=True)
class AttentionSpec:
    """Per-token KV entry of one attention layer: K and V of (num_kv_heads, head_dim) in dtype."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


@dataclass
class CacheSpec:
    """A model's caches by cache index: mamba[i] of the i-th Mamba layer, attention[j] of the
    j-th KV cache (a layer shared by several depths holds one KV cache per depth)."""

    mamba: list[MambaSpec] = field(default_factory=list)
    attention: list[AttentionSpec] = field(default_factory=list)

    @property
    def has_attention(self) -> bool:
        return bool(self.attention)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of conv + SSM state one request holds across all Mamba layers."""
        return sum(m.bytes for m in self.mamba)

    @property
    def min_inner_save_offset(self) -> int | None:
        """How many rows of a prefill chunk must precede a state checkpoint saved inside it (the
        conv's width - 1 inputs come from the chunk); None when some Mamba layer cannot save
        inside a chunk (or there is none), so that chunks end at checkpoints."""
        if not self.mamba or not all(m.saves_inside_prefill for m in self.mamba):
            return None
        return max(1, max(m.conv_shape[0] for m in self.mamba))

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V one KV block of `block_size` tokens holds across all attention layers."""
        return sum(a.bytes_per_block(block_size) for a in self.attention)


@runtime_checkable
class StatefulLayer(Protocol):
    """A layer that keeps per-request state: the cache indices it reads (one for a plain layer;
    one per depth for a layer shared by several depths) and, in one method, the spec of each."""

    cache_indices: tuple[int, ...]

    def cache_spec(self, dtypes: CacheDtypes) -> MambaSpec | AttentionSpec: ...


def collect_cache_spec(layers, dtypes: CacheDtypes) -> CacheSpec:
    """The CacheSpec of `layers` (any iterable of modules; those that are not `StatefulLayer`s
    are skipped). Raises AssertionError when two layers declare one cache index of a kind or an
    index is left out: indices 0..n-1 of each kind must each be declared once."""
    declared: dict[type, dict[int, MambaSpec | AttentionSpec]] = {MambaSpec: {}, AttentionSpec: {}}
    for layer in layers:
        if not isinstance(layer, StatefulLayer):
            continue
        spec = layer.cache_spec(dtypes)
        table = declared[type(spec)]
        for i in layer.cache_indices:
            assert i not in table, f"two layers declare {type(spec).__name__} cache index {i}"
            table[i] = spec
    for kind, table in declared.items():
        assert sorted(table) == list(range(len(table))), f"{kind.__name__} cache indices {sorted(table)} leave gaps"
    return CacheSpec(mamba=[declared[MambaSpec][i] for i in range(len(declared[MambaSpec]))],
                     attention=[declared[AttentionSpec][i] for i in range(len(declared[AttentionSpec]))])
