"""Cache specs: byte counts from shapes and dtypes, and the collection of a model's list from
what its layers declare (shared layers with several indices, gaps and duplicates caught)."""

import pytest
import torch

from mambaserve.cache.spec import AttentionSpec, CacheDtypes, CacheSpec, MambaSpec, collect_cache_spec
from mambaserve.cache.tensors import allocate_caches

DTYPES = CacheDtypes.of(torch.bfloat16, torch.float32)


def test_bytes_follow_shapes_and_dtypes():
    m2 = MambaSpec((3, 160), (4, 16, 8), torch.bfloat16, torch.float32)  # Mamba2
    m1 = MambaSpec((2, 24), (24, 5), torch.float16, torch.float16)  # Mamba-1
    a = AttentionSpec(num_kv_heads=3, head_dim=8, dtype=torch.bfloat16)
    assert (m2.conv_bytes, m2.ssm_bytes, m2.bytes) == (3 * 160 * 2, 4 * 16 * 8 * 4, 960 + 2048)
    assert m1.bytes == 2 * 24 * 2 + 24 * 5 * 2
    assert a.bytes_per_token == 2 * 3 * 8 * 2 and a.bytes_per_block(16) == 16 * 96
    spec = CacheSpec(mamba=[m2, m1], attention=[a, a])
    assert spec.bytes_per_slot == m2.bytes + m1.bytes and spec.bytes_per_block(16) == 2 * 16 * 96
    assert spec.has_attention and not CacheSpec(mamba=[m1]).has_attention
    assert CacheDtypes.of(torch.float16) == CacheDtypes(torch.float16, torch.float16, torch.float16)


class _Layer:
    def __init__(self, indices, spec):
        self.cache_indices, self._spec = indices, spec

    def cache_spec(self, dtypes):
        assert dtypes is DTYPES
        return self._spec


def test_collection_orders_by_index_and_expands_shared_layers():
    m = [MambaSpec((3, 8 * i), (i, 4, 2), torch.bfloat16, torch.float32) for i in (1, 2)]
    a = [AttentionSpec(2, 8, torch.bfloat16), AttentionSpec(4, 16, torch.bfloat16)]
    layers = [_Layer((1,), m[1]), object(), _Layer((0, 2), a[0]), _Layer((0,), m[0]), _Layer((1,), a[1])]
    spec = collect_cache_spec(layers, DTYPES)
    assert spec.mamba == m and spec.attention == [a[0], a[1], a[0]]


@pytest.mark.parametrize("indices", [[(0,), (0,)], [(0,), (2,)]])
def test_collection_rejects_duplicate_or_missing_indices(indices):
    spec = AttentionSpec(2, 8, torch.bfloat16)
    with pytest.raises(AssertionError):
        collect_cache_spec([_Layer(i, spec) for i in indices], DTYPES)


def test_allocation_follows_the_spec():
    spec = CacheSpec(mamba=[MambaSpec((3, 40), (4, 5, 6), torch.bfloat16, torch.float32)],
                     attention=[AttentionSpec(2, 8, torch.float16)])
    caches = allocate_caches(spec, num_slots=3, num_blocks=5, block_size=4, device="cpu")
    (conv, ssm), = caches.mamba
    (k, v), = caches.kv
    assert conv.shape == (3, 3, 40) and conv.dtype == torch.bfloat16 and conv.stride(-1) == 1
    assert ssm.shape == (3, 4, 5, 6) and ssm.dtype == torch.float32
    assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.float16 and k.data_ptr() != v.data_ptr()
    assert sum(t.numel() * t.element_size() for t in (conv, ssm)) == 3 * spec.bytes_per_slot
    assert sum(t.numel() * t.element_size() for t in (k, v)) == 5 * spec.bytes_per_block(4)
