"""`CacheTensors.state_row_views`: the kept views of a state row, grouped by dtype."""

import torch

from mambaserve.cache.tensors import CacheTensors


def test_state_row_views_alias_the_rows_grouped_by_dtype():
    mamba = [(torch.randn(6, 3, 5).bfloat16(), torch.randn(6, 2, 4, 4)) for _ in range(3)]
    caches = CacheTensors(mamba=mamba, kv=[])
    views = caches.state_row_views(4)
    assert caches.state_row_views(4) is views  # kept
    assert [[v.dtype for v in g] for g in views] == [[torch.bfloat16] * 3, [torch.float32] * 3]
    src = [(torch.randn(3, 5).bfloat16(), torch.randn(2, 4, 4)) for _ in range(3)]
    torch._foreach_copy_(views[0] + views[1], [c for c, _ in src] + [s for _, s in src])
    for (conv, ssm), (c, s) in zip(mamba, src):
        assert torch.equal(conv[4], c) and torch.equal(ssm[4], s)  # written through to the cache
