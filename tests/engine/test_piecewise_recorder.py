"""The piecewise recorder's bookkeeping, on the CPU with a stand-in for CUDA graphs.

What runs on the GPU (capture and replay) is tested in test_gpu.py; here: a split point's
inputs are staged into buffers shared by every split point with that input shape, so that the
recorded forward pins none of the model's own tensors (at 8,192 tokens a 9B hybrid's in_proj
outputs would otherwise hold 29 GiB for as long as the graphs live).
"""

import gc
import weakref

import torch

from mambaserve.engine import piecewise


class _FakeGraph:
    def capture_begin(self, pool=None):
        pass

    def capture_end(self):
        pass


def test_split_point_inputs_are_staged_in_shared_buffers(monkeypatch):
    monkeypatch.setattr(piecewise.torch.cuda, "CUDAGraph", _FakeGraph)
    piece = piecewise._Piece()
    buffers: dict = {}
    rec = piecewise._Recorder(piece, pool=None, ctx=None, buffers=buffers)
    rec.begin()
    seen = []

    def hole(a, b, ctx):
        seen.append((a, b))
        return a[:, :3] * 2 + b.sum()

    outs, refs = [], []
    for _layer in range(3):  # three layers: same shapes, so the same buffers
        a, b = torch.randn(5, 7), torch.randn(2)
        refs.append(weakref.ref(a))
        out = rec.hole(hole, (a, b), None)
        assert torch.equal(out, a[:, :3] * 2 + b.sum())  # the hole saw the staged copies
        outs.append(out)
        del a, b
    rec.end()
    gc.collect()
    assert all(r() is None for r in refs), "a recorded hole keeps a model tensor alive"
    assert len(piece.holes) == 3 and len(piece.graphs) == 4
    staged = {id(t) for fn, args, out in piece.holes for t in args}
    assert len(staged) == 2  # one buffer per (argument, shape), shared by the three holes
    assert len({id(out) for *_, out in piece.holes}) == 1  # and one output buffer
    assert all(seen_a is args[0] for (seen_a, _), (_, args, _) in zip(seen, piece.holes))  # replays read them
