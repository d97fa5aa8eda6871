"""FP8 ops: quantization against the compressed-tensors library, `fp8_linear` against float64
references of its two paths, FP8 experts in `fused_moe`, the FP8 KV cache in paged attention."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve import ops
from mambaserve.ops.fp8 import FP8_DTYPE, reference_scaled_mm
from tests.conftest import HAS_CUDA, rel_err

# Triton runs on CUDA tensors when there is a GPU, else on CPU tensors through the interpreter.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _weights(n, k, dtype=torch.float32):
    return torch.randn(n, k, dtype=dtype) * torch.rand(n, 1, dtype=dtype) * 0.3  # rows of different ranges


@pytest.mark.parametrize("per_row", [True, False])
def test_quantize_matches_compressed_tensors(per_row):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    assert ct
    w = _weights(24, 40)
    scheme = preset_name_to_scheme("FP8_DYNAMIC" if per_row else "FP8", ["Linear"])
    if per_row:
        mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        mn, mx = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(mn.clamp(max=0), mx.clamp(min=0), scheme.weights)
    want = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    q, s = ops.quantize_fp8(w, per_row=per_row)
    torch.testing.assert_close(s.reshape(-1), want["weight_scale"].reshape(-1), rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), want["weight"].view(torch.uint8))


def test_quantize_rounds_to_within_half_an_fp8_step_and_handles_zero_rows():
    w = _weights(9, 33)
    w[3] = 0
    q, s = ops.quantize_fp8(w)
    assert s.shape == (9, 1) and torch.isfinite(s).all() and (s > 0).all()
    back = ops.dequantize_fp8(q, s, torch.float64)
    # e4m3 has 3 mantissa bits: relative rounding error at most 2^-4 of the value (normal range)
    assert ((back - w.double()).abs() <= w.double().abs() * 2 ** -4 + s.double() * 2 ** -9).all()
    assert (back[3] == 0).all()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (5, 1500), (3, 7)])
def test_quantize_rows_kernel_matches_the_reference(static, shape):
    # values on the FP8 grid times a power of two: Triton's interpreter rounds float32 -> e4m3 wrongly
    # where rounding carries into the next binade, so exact comparisons use values that need no rounding
    # (the GPU test below compares arbitrary values)
    x = torch.randn(shape).mul(30).clamp(-440, 440).to(FP8_DTYPE).float() * 0.125
    x[:, -1] = -56.0  # each row's amax 448 / 8: scale 1/8, so that x / scale needs no rounding
    x = x.to(DEVICE)
    scale = torch.tensor([0.125], device=DEVICE) if static else None
    want_q, want_s = ops.fp8.quantize_fp8_reference(x, scale)
    with ops.backend("triton"):
        q, s = ops.quantize_fp8(x, scale)
    assert torch.equal(s.reshape(-1), want_s.reshape(-1))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(not HAS_CUDA, reason="the kernel on real hardware")
@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows_kernel_is_exact_on_the_gpu(static):
    x = (torch.randn(37, 3000, device="cuda") * 5).to(torch.bfloat16)
    scale = torch.tensor([0.02], device="cuda") if static else None
    q, s = ops.quantize_fp8(x, scale)
    want_q, want_s = ops.fp8.quantize_fp8_reference(x, scale)
    assert torch.equal(s.reshape(-1), want_s.reshape(-1))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("shape", [(1, 32, 48), (7, 33, 17)])
def test_fp8_linear_reference_is_the_dequantized_linear(per_channel, shape):
    m, k, n = shape
    x, w, b = torch.randn(m, k), _weights(n, k), torch.randn(n)
    q, s = ops.quantize_fp8(w, per_row=per_channel)
    got = ops.fp8_linear(x, q, s.reshape(-1), b)
    want = F.linear(x.double(), q.double() * s.double().reshape(-1, 1) if per_channel else q.double() * s.double(),
                    b.double())
    assert rel_err(got, want) < 1e-6
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert ops.fp8_linear(x[:0], q, s.reshape(-1), b).shape == (0, n)


def test_fp8_linear_refuses_bad_weights():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ops.fp8_linear(x, torch.randn(8, 16), torch.ones(8))
    q, _ = ops.quantize_fp8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="1 or 8 elements"):
        ops.fp8_linear(x, q, torch.ones(3))
    with pytest.raises(ValueError, match=r"\(N, 12\)"):
        ops.fp8_linear(torch.randn(3, 12), q, torch.ones(8))


@pytest.mark.skipif(not HAS_CUDA, reason="torch._scaled_mm needs a CUDA GPU with FP8 (Hopper)")
@pytest.mark.parametrize("per_channel,static", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("m", [17, 64])  # more rows than the decode GEMV (tests/ops/test_fp8_gemv.py) takes
def test_scaled_mm_path_matches_its_float64_math(per_channel, static, m):
    k, n = 256, 384
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    q, s = ops.quantize_fp8(_weights(n, k).cuda(), per_row=per_channel)
    in_scale = torch.tensor([x.float().abs().max().item() / 448 * 1.3], device="cuda") if static else None
    got = ops.fp8_linear(x, q, s.reshape(-1), None, in_scale)
    want = reference_scaled_mm(x, q, s, in_scale)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2


def _expert_weights(E, inter, hidden):
    w1 = torch.randn(E, 2 * inter, hidden) * 0.2
    w2 = torch.randn(E, hidden, inter) * 0.2
    q1, s1 = ops.quantize_fp8(w1)
    q2, s2 = ops.quantize_fp8(w2)
    return q1, s1[..., 0], q2, s2[..., 0]


@pytest.mark.parametrize("impl,num_tokens", [(None, 3), ("direct", 5), ("triton", 19)])
def test_fused_moe_fp8_experts_match_the_dequantized_experts(impl, num_tokens):
    E, inter, hidden, top_k = 5, 24, 40, 2
    q1, s1, q2, s2 = _expert_weights(E, inter, hidden)
    x = torch.randn(num_tokens, hidden)
    w = torch.rand(num_tokens, top_k)
    ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(num_tokens)])
    deq1, deq2 = ops.dequantize_fp8(q1, s1, torch.float64), ops.dequantize_fp8(q2, s2, torch.float64)
    want = ops.reference.fused_moe(x.double(), deq1, deq2, w.double(), ids)
    got_ref = ops.fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2)
    assert rel_err(got_ref, want) < 1e-5
    d = DEVICE
    with ops.backend("triton"):
        got = ops.fused_moe(x.to(d), q1.to(d), q2.to(d), w.to(d), ids.to(d), impl=impl, w1_scale=s1.to(d),
                            w2_scale=s2.to(d))
    assert rel_err(got.cpu(), want) < 1e-4


def test_fused_moe_refuses_half_given_or_misshaped_scales():
    q1, s1, q2, s2 = _expert_weights(3, 8, 16)
    x, w, ids = torch.randn(2, 16), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="come together"):
        ops.fused_moe(x, q1, q2, w, ids, w1_scale=s1)
    with pytest.raises(ValueError, match="FP8 experts"):
        ops.fused_moe(x, q1, q2, w, ids, w1_scale=s1[:, :4], w2_scale=s2)


@pytest.mark.parametrize("rows,inter", [(5, 24), (3, 1500)])  # one block per row; a row in two blocks
def test_silu_mul_quantize_matches_the_float64_product(rows, inter):
    h = torch.randn(rows, 2 * inter) * torch.rand(rows, 1) * 4  # rows of different ranges
    h[1] = 0.0  # a row of zeros keeps a finite scale
    g, u = h.double().chunk(2, dim=-1)
    want = F.silu(g) * u
    results = {}
    for backend in ("reference", "triton"):
        with ops.backend(backend):
            q, s = ops.silu_mul_quantize_fp8(h.to(DEVICE))
        q, s = results[backend] = q.cpu(), s.cpu()
        assert q.dtype == FP8_DTYPE and q.shape == (rows, inter) and s.shape == (rows,)
        amax = want.abs().amax(-1)
        assert torch.allclose(s.double(), (amax / 448).clamp_min(1 / 229376), rtol=1e-5)
        # e4m3 keeps 3 mantissa bits: within half a step, 1/16 of the value, or of the scale near 0
        err = (q.double() * s.double()[:, None] - want).abs()
        ok = err <= want.abs() / 16 + s.double()[:, None] / 2**9 + 1e-12
        if backend == "triton" and DEVICE == "cpu":
            # Triton's interpreter rounds float32 -> e4m3 wrongly where rounding carries into the next
            # binade (31.7 -> 16, not 32; see test_quantize_rows_kernel_matches_the_reference): only there
            ref_q = results["reference"][0].float()
            ok |= q.float() == ref_q / 2
        assert ok.all(), backend


def _quantized_moe_reference(x, q1, s1, q2, s2, w, ids):
    """float64 math of the scaled_grouped_mm path: tokens quantized per row, h rounded to bf16
    (the grouped mm's output), the SiLU product quantized per row, then the down product."""
    from mambaserve.ops.fp8 import quantize_fp8_reference
    xq, xs = quantize_fp8_reference(x)
    xd = xq.double() * xs.double()
    out = torch.zeros(x.shape[0], q2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = (xd[t] @ (q1[e].double() * s1[e].double()[:, None]).t()).to(torch.bfloat16).double()
            g, u = h.chunk(2)
            aq, a_s = quantize_fp8_reference((F.silu(g) * u)[None])
            y = (aq.double() * a_s.double()) @ (q2[e].double() * s2[e].double()[:, None]).t()
            out[t] += w[t, k].double() * y[0].to(torch.bfloat16).double()
    return out


@pytest.mark.skipif(not HAS_CUDA, reason="torch._scaled_grouped_mm needs a CUDA GPU with FP8 (Hopper)")
@pytest.mark.parametrize("num_tokens", [2700, 6000])  # past SCALED_GROUPED_MM_MIN_ROWS_PER_EXPERT rows per expert
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_experts_on_scaled_grouped_mm_match_their_float64_math(num_tokens, fast_accum, monkeypatch):
    """granite-4.0-tiny-preview's experts in FP8 (62, top-6, hidden 1536, inter 512): the default
    choice at prefill sizes is the FP8 x FP8 grouped mm, and it computes the quantized math."""
    monkeypatch.setattr(ops.fp8, "FP8_FAST_ACCUM", fast_accum)
    E, inter, hidden, top_k = 62, 512, 1536, 6
    q1, s1, q2, s2 = _expert_weights(E, inter, hidden)
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    w = torch.rand(num_tokens, top_k).softmax(-1)
    ids = torch.stack([torch.randperm(E - 3)[:top_k] for _ in range(num_tokens)])  # 3 experts get no rows
    calls = []
    real = torch._scaled_grouped_mm
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = lambda t: t.cuda()  # noqa: E731
    out = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    with ops.backend("triton"):
        ops.fused_moe(c(x), c(q1), c(q2), c(w), c(ids), w1_scale=c(s1), w2_scale=c(s2), out=out)
    assert len(calls) == 2, "FP8 experts at prefill sizes did not take torch._scaled_grouped_mm"
    sel = torch.randperm(num_tokens)[:40]  # the float64 loop over 40 tokens
    want = _quantized_moe_reference(x[sel].float(), q1, s1, q2, s2, w[sel], ids[sel])
    weight_only = ops.reference.fused_moe(x[sel].double(), ops.dequantize_fp8(q1, s1, torch.float64),
                                          ops.dequantize_fp8(q2, s2, torch.float64), w[sel].double(), ids[sel])
    got = out[sel.cuda()].cpu()
    print(f"fast_accum={fast_accum}: rel err {rel_err(got, want):.2e} vs the quantized math, "
          f"{rel_err(got, weight_only):.2e} vs the weight-only math")
    assert rel_err(got, want) < (3e-2 if fast_accum else 1e-2)
    assert rel_err(got, weight_only) < 7e-2  # activation rounding only


def _fp8_kv_case(block_size=4, kv_heads=2, group=3, head_dim=16, lens=((5, 9), (1, 13), (3, 3))):
    """A packed batch (new tokens, context length) per sequence over random FP8 caches."""
    n_blocks = sum(-(-c // block_size) for _, c in lens) + 2
    perm = torch.randperm(n_blocks)
    tables, start = [], 0
    width = max(-(-c // block_size) for _, c in lens)
    for _, c in lens:
        nb = -(-c // block_size)
        tables.append(perm[start:start + nb].tolist() + [0] * (width - nb))
        start += nb
    qsl = [0]
    for q_len, _ in lens:
        qsl.append(qsl[-1] + q_len)
    T = qsl[-1]
    q = torch.randn(T, kv_heads * group, head_dim)
    k_cache = torch.zeros(n_blocks, block_size, kv_heads, head_dim, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k_full = torch.randn(n_blocks * block_size, kv_heads, head_dim) * 3
    v_full = torch.randn(n_blocks * block_size, kv_heads, head_dim) * 2
    slots = torch.arange(n_blocks * block_size)
    return (q, k_cache, v_cache, k_full, v_full, slots, torch.tensor(tables, dtype=torch.int32),
            torch.tensor([c for _, c in lens], dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_kv_cache_writes_scaled_values_and_attention_dequantizes_them(backend):
    q, kc, vc, k_full, v_full, slots, table, seq_lens, qsl = _fp8_kv_case()
    k_scale, v_scale = 0.02, 0.011
    if backend == "triton":
        # Triton's interpreter (3.x) rounds float32 -> e4m3 wrongly where the rounding carries into
        # the next binade (127.99 -> 64): on the interpreter the keys and values are chosen on the
        # FP8 grid (times the scale), so that the write is exact and the test sees the kernel's logic
        k_full = k_full.clamp(-400, 400).to(FP8_DTYPE).float() * k_scale
        v_full = v_full.clamp(-400, 400).to(FP8_DTYPE).float() * v_scale
        k_full[0, 0, 0] = 1000 * k_scale  # clamped to 448
    d = DEVICE if backend == "triton" else "cpu"
    q, kc, vc, k_full, v_full, slots, table, seq_lens, qsl = (t.to(d) for t in (q, kc, vc, k_full, v_full, slots,
                                                                                table, seq_lens, qsl))
    with ops.backend(backend):
        ops.reshape_and_cache(k_full, v_full, kc, vc, slots, k_scale, v_scale)
    # the independent reference: quantize K and V the same way, then float64 attention over them
    kq = (k_full / k_scale).clamp(-448, 448).to(FP8_DTYPE)
    vq = (v_full / v_scale).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(kc.view(torch.uint8).reshape(kq.shape), kq.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8).reshape(vq.shape), vq.view(torch.uint8))
    k64 = (kq.double() * k_scale).reshape(kc.shape)
    v64 = (vq.double() * v_scale).reshape(vc.shape)
    want = ops.reference.paged_attention(q.double().cpu(), k64.cpu(), v64.cpu(), table.cpu(), seq_lens.cpu(),
                                         qsl.cpu(), 0.25)
    with ops.backend(backend):
        got = ops.paged_attention(q, kc, vc, table, seq_lens, qsl, 0.25, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(got.cpu(), want) < 1e-5


def test_fp8_kv_cache_refuses_mixed_caches_and_bad_scales():
    q, kc, vc, k_full, v_full, slots, table, seq_lens, qsl = _fp8_kv_case()
    with pytest.raises(ValueError, match="both be FP8"):
        ops.paged_attention(q, kc, vc.float(), table, seq_lens, qsl, 0.25)
    with pytest.raises(ValueError, match="k_scale and v_scale must be > 0"):
        ops.reshape_and_cache(k_full, v_full, kc, vc, slots, 0.0, 1.0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_linear_partials_reads_fp8_weights_with_their_row_scales(backend, num_tokens):
    x, w = torch.randn(num_tokens, 100), _weights(37, 100)
    q, s = ops.quantize_fp8(w)
    want = x.double() @ (q.double() * s.double()).t()
    d = DEVICE if backend == "triton" else "cpu"
    with ops.backend(backend):
        parts = ops.linear_partials(x.to(d), q.to(d), s.reshape(-1).to(d))
    assert rel_err(parts.sum(0).cpu(), want) < 1e-5
    with pytest.raises(ValueError, match="weight_scale"):
        ops.linear_partials(x, q, s)  # (N, 1): not the (N,) the kernels take
