"""`fp8_linear` at decode sizes: the weight-only FP8 GEMV (`gemv.fp8_gemv`) against float64
products of the dequantized weight, one split and several; the row-wise scale cache of the
`_scaled_mm` path; a model whose FP8 layers take the GEMV against its dequantized model."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve import ops
from mambaserve.ops import fp8
from mambaserve.ops.gemv import GPU_TILE, gemv_plan
from tests.conftest import HAS_CUDA, rel_err

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _case(m, n, k, per_row, dtype=torch.float32, device=DEVICE, x_stride=None):
    """x (m, k) whose rows are x_stride apart (a slice of a wider tensor), an FP8 weight (n, k)
    with rows of different ranges, its scale (n,) or (1,), a bias (n,)."""
    wide = torch.randn(m, x_stride or k, dtype=dtype, device=device)
    x = wide[:, :k]
    w = torch.randn(n, k, device=device) * torch.rand(n, 1, device=device) * 0.3
    q, s = ops.quantize_fp8(w, per_row=per_row)
    return x, q, s.reshape(-1), torch.randn(n, dtype=dtype, device=device)


def _want(x, q, s, b):
    """float64: x times the dequantized weight (x itself not quantized), plus b."""
    s = s.double()
    w = q.double() * (s[:, None] if s.numel() > 1 else s)
    return F.linear(x.double(), w, None if b is None else b.double())


# (n, k) on the interpreter's plan (4 programs, blocks of 32, tiles of 512): one split or several
ONE_SPLIT, SPLITS = (37, 100), (70, 300)


def test_the_interpreter_cases_reach_one_split_and_several():
    assert gemv_plan(*ONE_SPLIT, 4, 32, 512)[3] == 1
    assert gemv_plan(*SPLITS, 4, 32, 512)[3] > 1


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("shape,per_row,bias", [(ONE_SPLIT, True, True), (ONE_SPLIT, False, False),
                                                (SPLITS, True, False), (SPLITS, False, True), ((5, 33), True, True)])
def test_fp8_gemv_matches_the_dequantized_weight(poison_empty, m, shape, per_row, bias):
    n, k = shape
    x, q, s, b = _case(m, n, k, per_row, x_stride=k + 7)  # rows k + 7 apart: a strided x
    b = b if bias else None
    want = _want(x, q, s, b)
    with ops.backend("triton"):
        got = ops.fp8_linear(x, q, s, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-5


def test_fp8_gemv_keeps_leading_dims_and_takes_an_n_by_1_scale():
    x, q, s, b = _case(6, 37, 100, True)
    with ops.backend("triton"):
        got = ops.fp8_linear(x.reshape(2, 3, 100), q, s.reshape(-1, 1), b)
    assert got.shape == (2, 3, 37)
    assert rel_err(got.reshape(6, 37), _want(x, q, s, b)) < 1e-5


def test_more_rows_than_the_gemv_takes_leave_it(monkeypatch):
    """17 rows on the interpreter: not the GEMV (on the CPU, the reference's F.linear)."""
    x, q, s, b = _case(17, 37, 100, True)
    calls = []
    orig = fp8.fp8_gemv
    monkeypatch.setattr(fp8, "fp8_gemv", lambda *a: calls.append(1) or orig(*a))
    with ops.backend("triton"):
        got = ops.fp8_linear(x, q, s, b)
        ops.fp8_linear(x[:16], q, s, b)
    assert calls == [1] and rel_err(got, _want(x, q, s, b)) < 1e-5


def test_fp8_linear_refuses_a_misshaped_bias():
    x, q, s, _ = _case(2, 37, 100, True)
    with pytest.raises(ValueError, match=r"bias must be \(37,\)"):
        ops.fp8_linear(x, q, s, torch.randn(36))


def test_row_scale_is_built_once_and_rebuilt_after_an_in_place_load():
    per_tensor = torch.tensor([0.5])
    first = fp8._row_scale(per_tensor, 12)
    assert first.shape == (1, 12) and first.is_contiguous() and (first == 0.5).all()
    assert fp8._row_scale(per_tensor, 12) is first  # cached: no copy per call
    per_tensor.mul_(3)  # as a loader's copy_ into the parameter
    again = fp8._row_scale(per_tensor, 12)
    assert again.is_contiguous() and (again == 1.5).all()
    per_row = torch.rand(12)
    view = fp8._row_scale(per_row, 12)
    assert view.shape == (1, 12) and view.data_ptr() == per_row.data_ptr()  # a view, nothing built
    half = per_row.half()
    assert torch.equal(fp8._row_scale(half, 12), half.float().reshape(1, 12))
    with torch.inference_mode():
        frozen = torch.tensor([0.25])
    assert (fp8._row_scale(frozen, 12) == 0.25).all()


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter on CPU tensors (the GPU cases cover the kernel there)")
@pytest.mark.parametrize("name", ["granite-moe", "bamba"])
def test_online_fp8_decoding_through_the_gemv_equals_the_model_of_its_rounded_weights(name, tmp_path, monkeypatch):
    """quantization="fp8" (weights per output row) decoding with its FP8 linear layers on the
    GEMV (the interpreter; every other op the reference) gives the logits of the plain model
    loaded from a copy whose selected weights were rounded to FP8 beforehand."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mambaserve.layers.quantization import prepare_fp8_modules, resolve_quantization
    from mambaserve.loader import load_config, load_model
    from mambaserve.models import get_model_class
    from tests.models.harness import Harness
    from tests.models.tiny import checkpoint

    src = checkpoint(name)
    config = load_config(src)
    with torch.device("meta"):
        selected = prepare_fp8_modules(get_model_class(config)(config), resolve_quantization(config, "fp8"))
    tensors = load_file(f"{src}/model.safetensors")
    for mod in selected:
        q, s = fp8.quantize_fp8_reference(tensors[f"{mod}.weight"])
        tensors[f"{mod}.weight"] = q.float() * s
    shutil.copytree(src, tmp_path / "rounded")
    save_file(tensors, tmp_path / "rounded" / "model.safetensors")
    ours, ref = load_model(src, quantization="fp8"), load_model(str(tmp_path / "rounded"))
    calls = []
    orig = fp8.fp8_gemv
    monkeypatch.setattr(fp8, "fp8_gemv", lambda *a: calls.append(1) or orig(*a))
    monkeypatch.setattr(fp8, "use_triton", lambda t: True)  # fp8_linear's GEMV on the interpreter
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (1, 4)]

    def run(model):
        h = Harness(model, len(prompts), max(len(p) for p in prompts) + 2)
        out = [h.step({i: p for i, p in enumerate(prompts)})]
        out += [h.step({i: [3 + step + i] for i in range(len(prompts))}) for step in range(2)]
        return torch.cat([torch.cat([o[i] for i in sorted(o)]) for o in out])

    got = run(ours)
    assert calls  # the GEMV ran
    assert rel_err(got, run(ref)) < 1e-5


@pytest.mark.skipif(not HAS_CUDA, reason="the GEMV on real hardware")
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(6448, 1536), (1536, 3072), (512, 1536), (64, 1536), (16384, 8192), (1000, 1000)])
@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_gemv_on_the_gpu_matches_the_dequantized_weight(m, n, k, per_row):
    x, q, s, b = _case(m, n, k, per_row, torch.bfloat16, "cuda", x_stride=k + 64)
    for bias in (b, None):
        out = ops.fp8_linear(x, q, s, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert rel_err(out, _want(x, q, s, bias)) < 5e-3  # the bf16 output's rounding


@pytest.mark.skipif(not HAS_CUDA, reason="counts CUDA kernels")
@pytest.mark.parametrize("n,k", [(6448, 1536), (1536, 3072), (512, 1536)])
def test_fp8_gemv_is_one_launch_at_decode_shapes(n, k):
    from torch.profiler import ProfilerActivity, profile

    x, q, s, b = _case(1, n, k, True, torch.bfloat16, "cuda")
    assert gemv_plan(n, k, torch.cuda.get_device_properties(0).multi_processor_count, 512, GPU_TILE)[3] == 1
    ops.fp8_linear(x, q, s, b)  # compiled before the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.fp8_linear(x, q, s, b)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1, kernels
