"""benchmarks/floor.py: the bytes and FLOPs of a step against figures worked out by hand for a tiny
Granite config (every count below is written from the config's numbers, not from the code's walk
over the model), the expected distinct experts against a simulation, the kernel groups of the
names our profiles report, and the profiler's floor table on a made-up measurement."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import floor  # noqa: E402
import profile_step  # noqa: E402

from mambaserve.loader import build_model  # noqa: E402

# layers mamba, attention, mamba, attention; hidden 48; attention 4 heads x 12 (2 KV heads);
# Mamba2 6 heads x 16, d_state 8, 2 groups, expand 2 (I = 96), conv width 4, chunk 8;
# 5 experts of 32 (top 2), a shared expert of 40 (not a multiple of 32: stays a dense MLP)
TINY = dict(
    vocab_size=211, hidden_size=48, intermediate_size=32, shared_intermediate_size=40, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2,
    mamba_n_heads=6, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, mamba_chunk_size=8,
    mamba_d_conv=4, layer_types=["mamba", "attention", "mamba", "attention"], position_embedding_type="nope",
    tie_word_embeddings=True, architectures=["GraniteMoeHybridForCausalLM"],
)
# by hand, per layer: in_proj 48 x (2 * 96 + 2 * 2 * 8 + 6) = 48 x 230, out_proj 96 x 48;
# attention q, o 48 x 48, k, v 48 x 24; shared MLP 48 x 80 + 40 x 48; router 5 x 48;
# one expert 2 * 32 x 48 + 48 x 32 = 4,608; conv (96 + 32) channels x 4 taps + 128 biases
GEMM_PARAMS = 2 * (48 * 230 + 96 * 48) + 2 * (2 * 48 * 48 + 2 * 48 * 24) + 4 * (48 * 80 + 40 * 48)
ROUTER_PARAMS = 4 * 5 * 48
EXPERT = 2 * 32 * 48 + 48 * 32
CONV_STATE = 3 * 128 * 2  # (width - 1) x conv_dim, bf16
SSM_STATE = 6 * 16 * 8 * 2  # heads x head_dim x d_state, bf16
KV_TOKEN = 2 * 2 * 12 * 2  # K and V, 2 heads x 12, bf16


@pytest.fixture(scope="module")
def shape():
    config = transformers.GraniteMoeHybridConfig(**TINY)
    model = build_model(config, torch.bfloat16, "meta")
    model.finalize_weights()
    return floor.model_shape(model)


def test_model_shape_by_hand(shape):
    assert shape.matmul_params["gemv/gemm"] == GEMM_PARAMS
    assert shape.matmul_params["moe"] == ROUTER_PARAMS
    assert shape.weight_bytes["gemv/gemm"] == 2 * GEMM_PARAMS
    assert shape.weight_bytes["moe"] == 2 * ROUTER_PARAMS
    # norms: 2 per layer + the final one (48 each), the 2 gated norms (96 each), bf16
    assert shape.weight_bytes["norm"] == 2 * (9 * 48 + 2 * 96)
    assert shape.weight_bytes["conv"] == 2 * 2 * (128 * 4 + 128)
    assert shape.weight_bytes["state update"] == 4 * 2 * 3 * 6  # A_log, D, dt_bias in float32
    assert shape.lm_head_params == 211 * 48 and shape.lm_head_bytes == 2 * 211 * 48  # tied: read once, as lm_head
    assert shape.embed_row_bytes == 2 * 48
    assert [m.expert_params for m in shape.moe] == [EXPERT] * 4 and shape.moe[0].top_k == 2
    assert shape.active_params_per_token == GEMM_PARAMS + ROUTER_PARAMS + 4 * 2 * EXPERT
    assert [(a.num_heads, a.num_kv_heads, a.head_dim) for a in shape.attention] == [(4, 2, 12)] * 2
    assert shape.mamba[0].conv_state_bytes == CONV_STATE and shape.mamba[0].ssm_state_bytes == SSM_STATE


def test_fp8_model_shape_by_hand():
    """quantization="fp8": the selected weights 1 byte an element plus a float32 scale per output
    row (Mamba in_proj 230 + out_proj 48 rows, attention 48 + 24 + 24 + 48, shared MLP 80 + 48, an
    expert 64 + 48), the router, norms and lm_head as before; matrix parameters unchanged."""
    from mambaserve.layers.quantization import resolve_quantization, widen_scales

    config = transformers.GraniteMoeHybridConfig(**TINY)
    model = build_model(config, torch.bfloat16, "meta", quantization=resolve_quantization(config, "fp8"))
    widen_scales(model)
    model.finalize_weights()
    fp8 = floor.model_shape(model)
    rows = 2 * (230 + 48) + 2 * (48 + 24 + 24 + 48) + 4 * (80 + 48)
    assert fp8.weight_bytes["gemv/gemm"] == GEMM_PARAMS + 4 * rows
    assert fp8.matmul_params["gemv/gemm"] == GEMM_PARAMS and fp8.matmul_params["moe"] == ROUTER_PARAMS
    assert fp8.weight_bytes["moe"] == 2 * ROUTER_PARAMS
    assert [(m.expert_params, m.expert_bytes) for m in fp8.moe] == [(EXPERT, EXPERT + 4 * (64 + 48))] * 4
    assert fp8.lm_head_bytes == 2 * 211 * 48 and fp8.embed_row_bytes == 2 * 48
    assert fp8.mamba[0].conv_state_bytes == CONV_STATE and fp8.attention[0].kv_bytes_per_token == KV_TOKEN


def test_fp8_shape_of_a_config_halves_granite_tiny_weight_bytes():
    bf16 = floor.shape_of_config(str(BENCH / "configs" / "granite-4.0-tiny-preview.json"))
    fp8 = floor.shape_of_config(str(BENCH / "configs" / "granite-4.0-tiny-preview.json"), quantization="fp8")
    assert fp8.active_params_per_token == bf16.active_params_per_token
    ratio = fp8.weight_bytes["gemv/gemm"] / bf16.weight_bytes["gemv/gemm"]
    assert 0.5 < ratio < 0.505  # 1 byte instead of 2, plus 4 bytes per row of K >= 1024


def test_decode_step_by_hand(shape):
    B, L = 3, 10
    cost = floor.step_cost(shape, floor.Step.decode(B, L))
    experts = 5 * (1 - (1 - 2 / 5) ** 3)  # distinct experts of 3 tokens x top 2 of 5, per layer
    assert cost.bytes["moe"] == pytest.approx(2 * ROUTER_PARAMS + 4 * experts * 2 * EXPERT)
    assert cost.bytes["gemv/gemm"] == 2 * GEMM_PARAMS + 2 * 211 * 48
    assert cost.bytes["conv"] == 2 * 2 * (128 * 4 + 128) + 2 * B * 2 * CONV_STATE  # 2 layers, read + write
    assert cost.bytes["state update"] == 4 * 2 * 3 * 6 + 2 * B * 2 * SSM_STATE
    assert cost.bytes["scan"] == 0
    assert cost.bytes["attention"] == 2 * B * (L + 1) * KV_TOKEN
    assert cost.bytes["other"] == B * 2 * 48
    assert cost.flops["gemv/gemm"] == 2 * GEMM_PARAMS * B + 2 * 211 * 48 * B
    assert cost.flops["moe"] == 2 * B * (ROUTER_PARAMS + 4 * 2 * EXPERT)
    assert cost.flops["attention"] == 2 * B * 4 * 4 * 12 * (L + 1)  # 2 layers x 4 heads x 12, L + 1 keys
    assert cost.flops["state update"] == 2 * B * 4 * 6 * 16 * 8
    assert cost.flops["conv"] == 2 * B * 2 * 128 * 4
    assert cost.floor_s(1e9, 1e12) == pytest.approx(cost.total_bytes / 1e9)


def test_prefill_chunks_by_hand(shape):
    # 13 tokens in chunks of 8: chunk 1 writes the states, chunk 2 reads and writes them
    steps = floor.prefill_steps(13, 8)
    assert [s.seqs for s in steps] == [((8, 0),), ((5, 8),)]
    cost = floor.steps_cost(shape, steps)
    assert cost.bytes["scan"] == 2 * (1 + 2) * SSM_STATE and cost.bytes["state update"] == 2 * 4 * 2 * 3 * 6
    # SSD: per chunk of c tokens, c (c + 1) / 2 pairs x (2 groups x 8 + 6 heads x 16), plus 4 x 6 x 16 x 8 a token
    ssd = 2 * (36 + 15) * (2 * 8 + 6 * 16) + 4 * 13 * 6 * 16 * 8
    assert cost.flops["scan"] == 2 * ssd
    # attention: (query, key) pairs 8 * 9 / 2 + 5 * 8 + 5 * 6 / 2 under the causal mask, KV written once
    assert cost.flops["attention"] == 2 * 4 * 4 * 12 * (36 + 40 + 15)
    assert cost.bytes["attention"] == 2 * (8 + 13) * KV_TOKEN  # chunk 2 reads the first 8 back
    assert cost.flops["gemv/gemm"] == 2 * GEMM_PARAMS * 13 + 2 * 2 * 211 * 48  # logits: one row a chunk
    assert cost.bytes["gemv/gemm"] == 2 * (2 * GEMM_PARAMS + 2 * 211 * 48)  # weights read once a chunk


def test_bad_steps(shape):
    for bad in (floor.Step(()), floor.Step(((0, 3),)), floor.Step(((2, -1),))):
        with pytest.raises(ValueError):
            floor.step_cost(shape, bad)
    with pytest.raises(ValueError):
        floor.prefill_steps(0, 8)


def test_expected_experts_against_a_simulation():
    E, k = 62, 6
    assert floor.expected_experts(E, k, 1) == pytest.approx(k)
    assert floor.expected_experts(E, k, 0) == 0
    gen = torch.Generator().manual_seed(0)
    for T in (2, 8, 32):
        hits = [torch.rand(T, E, generator=gen).topk(k, dim=1).indices.unique().numel() for _ in range(400)]
        assert floor.expected_experts(E, k, T) == pytest.approx(sum(hits) / len(hits), rel=0.03)
        assert floor.expected_experts(E, k, T) <= min(E, T * k)


def test_packed_prefill_steps():
    steps = floor.packed_prefill_steps(3, 5, 8)
    assert [s.seqs for s in steps] == [((5, 0), (3, 0)), ((2, 3), (5, 0))]
    assert [s.seqs for s in floor.packed_prefill_steps(1, 31500, 8192)] == [
        ((8192, 0),), ((8192, 8192),), ((8192, 16384),), ((6924, 24576),)]


def test_kernel_groups_of_profiled_names():
    names = {
        "_rms_norm_gated_kernel": "norm", "_direct_gate_up_kernel": "moe", "_router_topk_kernel": "moe",
        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": "gemv/gemm", "_linear_partials_kernel": "gemv/gemm",
        "_causal_conv1d_update_kernel": "conv", "_selective_state_update_kernel": "state update",
        "_ssd_state_update_kernel": "state update", "_chunk_scan_kernel": "scan", "_state_passing_kernel": "scan",
        "_paged_attention_kernel": "attention", "_combine_splits_kernel": "attention", "_combine_kernel": "moe",
        "_reshape_and_cache_kernel": "attention", "Memcpy": "other",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_"
        "17GroupProblemShape": "moe",
        "void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_128x64_64x3_tn_align2>": "gemv/gemm",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>": "other",
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel": "moe",
    }
    for name, group in names.items():
        assert floor.kernel_group(name) == group, name
    assert floor.grouped_us({"_chunk_scan_kernel": 3.0, "_chunk_state_kernel": 2.0, "Memset": 1.0}) == {
        **dict.fromkeys(floor.GROUPS, 0.0), "scan": 5.0, "other": 1.0}


def test_table_rows_and_gap_shares(shape):
    cost = floor.step_cost(shape, floor.Step.decode(1, 4))
    bw, rate = 1e9, 1e12
    group_floor = {g: max(cost.bytes[g] / bw, cost.flops[g] / rate) * 1e6 for g in floor.GROUPS}
    measured = {g: group_floor[g] + (10.0 if g == "norm" else 30.0 if g == "moe" else 0.0) for g in floor.GROUPS}
    rows = floor.table_rows(cost, bw, rate, measured)
    by = {r["group"]: r for r in rows}
    gap = sum(measured.values()) - cost.floor_s(bw, rate) * 1e6
    assert by["norm"]["excess_us"] == pytest.approx(10.0) and by["moe"]["excess_us"] == pytest.approx(30.0)
    assert by["norm"]["gap_share"] == pytest.approx(10.0 / gap) and by["total"]["excess_us"] == pytest.approx(gap)
    text = floor.format_table("t", rows)
    assert "norm" in text and "of gap" in text and len(text.splitlines()) == len(floor.GROUPS) + 4
    assert all(math.isnan(r.get("gap_share", math.nan)) or r["gap_share"] <= 1 for r in rows)


def test_profiler_floor_of_a_made_up_profile(shape):
    """profile_step.add_floor: a decode phase of 4 steps at contexts 100..103 gets the mean step's
    table, the prefill phase its chunks' sum."""
    args = type("Args", (), dict(batch_size=2, input_len=100, decode_steps=4, mixed_decodes=0))()
    measured = dict.fromkeys(floor.GROUPS, 5.0)
    res = {"prefill": {"group_us_per_step": measured}, "decode": {"group_us_per_step": measured}}
    hw = {"copy_bandwidth_bytes_per_s": 4e12, "bf16_matmul_flops_per_s": 8e14}
    profile_step.add_floor(res, shape, args, 128, hw)
    mean = floor.steps_cost(shape, [floor.Step.decode(2, 100 + j) for j in range(4)])
    total = {r["group"]: r for r in res["decode"]["floor"]["rows"]}["total"]
    assert total["bytes"] == pytest.approx(mean.total_bytes / 4)
    assert res["prefill"]["floor"]["engine_steps"] == 2  # 200 tokens in steps of 128
    pre = {r["group"]: r for r in res["prefill"]["floor"]["rows"]}["total"]
    assert pre["flops"] == pytest.approx(floor.steps_cost(shape, floor.packed_prefill_steps(2, 100, 128)).total_flops)
    for phase in res.values():
        phase.update(kernels_per_step=400.0, kernel_ms_per_step=2.0, wall_ms_per_step=2.5)
    result = {"model": "tiny", "input_len": 100, "batch_size": 2, "modes": {"graphed": res}}
    lines = profile_step.summary_lines(result)
    floor_ms = total["floor_us"] / 1e3
    assert len(lines) == 2 and "400 launches/step" in lines[1] and f"floor {floor_ms:.3f} ms" in lines[1]
    assert f"wall / floor {2.5 / floor_ms:.2f}" in lines[1]


def test_real_granite_active_parameters():
    """granite-4.0-tiny-preview reads about 1.39 B active parameters a batch-1 decode step (the
    issue's figure): 36 Mamba2 mixers, 4 attention layers, 40 MoEs of top 6 of 62 experts plus the
    shared expert, and the tied 49,160 x 1,536 lm_head."""
    shape = floor.shape_of_config(str(BENCH / "configs" / "granite-4.0-tiny-preview.json"))
    H = 1536
    mamba = 36 * (H * (2 * 3072 + 2 * 128 + 48) + 3072 * H)
    attention = 4 * (2 * H * H + 2 * H * 512)
    moe = 40 * (62 * H + 6 * 3 * 512 * H + 3 * 1024 * H)
    assert shape.active_params_per_token == mamba + attention + moe
    assert (shape.active_params_per_token + shape.lm_head_params) / 1e9 == pytest.approx(1.39, abs=0.01)


@pytest.mark.parametrize("name", ["mamba-130m", "zamba2-2.7b"])
def test_families_the_floor_does_not_model_are_refused(name):
    """Mamba-1 mixers and Zamba2's shared blocks: a ValueError, not a floor missing their work."""
    with pytest.raises(ValueError, match="does not model"):
        floor.shape_of_config(str(BENCH / "configs" / f"{name}.json"))


def test_profile_step_runs_an_fp8_engine_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The script end to end on a tiny checkpoint with --quantization fp8 (no GPU: no kernels,
    no floor): the engine built with it, the JSON and the summary lines saying so."""
    import json

    from tests.models.tiny import checkpoint

    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--model", checkpoint("granite-moe"), "--modes", "eager",
                                      "--input-len", "8", "--decode-steps", "2", "--quantization", "fp8",
                                      "--no-floor", "--output-json", str(out)])
    built = []
    import mambaserve

    orig = mambaserve.LLM
    monkeypatch.setattr(mambaserve, "LLM", lambda *a, **kw: built.append(kw.get("quantization")) or orig(*a, **kw))
    assert profile_step.main() == 0
    assert built == ["fp8"]
    assert json.loads(out.read_text())["quantization"] == "fp8"
    assert "fp8 in8 bs1 eager decode]" in capsys.readouterr().out
