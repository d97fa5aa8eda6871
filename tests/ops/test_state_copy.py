"""`ops.copy_state_rows` (Triton under the interpreter, and the reference) against row-by-row
copies, and the state stacks of `allocate_caches` it copies through."""

import pytest
import torch

from mambaserve.cache.spec import CacheSpec, MambaSpec
from mambaserve.cache.tensors import allocate_caches
from mambaserve.ops import backend, copy_state_rows
from tests.conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _stacks(seed: int):
    g = torch.Generator().manual_seed(seed)
    # a row of 2 x 5 x 3 = 30 elements (under BLOCK), one of 2 x 4100 (two blocks, a ragged tail)
    return [torch.randn(3, 9, 2, 5, 3, generator=g).bfloat16().to(DEVICE),
            torch.randn(2, 9, 2, 4100, generator=g).to(DEVICE)]


@pytest.mark.parametrize("impl", ["reference", "triton", "auto"])
def test_copy_state_rows_equals_row_by_row_copies(impl):
    pairs = [(7, 1), (0, 4), (8, 2)]
    stacks, want = _stacks(0), _stacks(0)
    for s in want:
        for src, dst in pairs:
            s[:, dst] = s[:, src].clone()
    with backend(impl):
        copy_state_rows(stacks, pairs)
    for got, w in zip(stacks, want):
        assert torch.equal(got, w)  # copied rows equal their sources; every other row bit-identical


@pytest.mark.parametrize("pairs, match", [
    ([(0, 9)], "must be in"), ([(-1, 2)], "must be in"), ([(0, 2), (1, 2)], "distinct"),
    ([(0, 2), (2, 3)], "not sources"),
])
def test_copy_state_rows_rejects_bad_pairs_and_writes_nothing(pairs, match):
    stacks = _stacks(1)
    before = [s.clone() for s in stacks]
    with pytest.raises(ValueError, match=match):
        copy_state_rows(stacks, pairs)
    assert all(torch.equal(s, b) for s, b in zip(stacks, before))


def test_copy_state_rows_rejects_stacks_of_other_row_counts():
    with pytest.raises(ValueError, match="contiguous"):
        copy_state_rows([torch.randn(2, 5, 3), torch.randn(2, 6, 3)], [(0, 1)])


def test_allocate_caches_stacks_layers_of_one_shape_and_dtype():
    """Layers 0 and 2 share shapes, layer 1 has another SSM dtype: every layer's states are views
    of a stack, so a copy through the stacks writes every layer's row."""
    specs = [MambaSpec((3, 8), (2, 4, 4), torch.bfloat16, torch.float32),
             MambaSpec((3, 8), (2, 4, 4), torch.bfloat16, torch.bfloat16),
             MambaSpec((3, 8), (2, 4, 4), torch.bfloat16, torch.float32)]
    caches = allocate_caches(CacheSpec(mamba=specs, attention=[]), num_slots=5, num_blocks=1, block_size=4,
                             device="cpu")
    assert sorted((tuple(s.shape), s.dtype) for s in caches.state_stacks) == sorted(
        [((3, 5, 3, 8), torch.bfloat16), ((2, 5, 2, 4, 4), torch.float32), ((1, 5, 2, 4, 4), torch.bfloat16)],
        key=str)
    for conv, ssm in caches.mamba:
        conv[2].normal_()
        ssm[2].normal_()
    copy_state_rows(caches.state_stacks, [(2, 4)])
    for conv, ssm in caches.mamba:
        assert torch.equal(conv[4], conv[2]) and torch.equal(ssm[4], ssm[2]) and conv[2].abs().sum() > 0
        assert conv.is_contiguous() and ssm.is_contiguous() and not conv[0].any()
