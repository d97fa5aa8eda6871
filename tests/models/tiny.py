"""Tiny random-weight checkpoints built with transformers itself, for parity and engine tests."""

from __future__ import annotations

import functools
import tempfile

import torch

CONFIGS = {
    # MoE, NoPE, multipliers != 1, n_groups 2, tied embeddings
    "granite-moe": dict(
        arch="GraniteMoeHybrid", initializer_range=0.2, vocab_size=211, hidden_size=48, intermediate_size=32,
        shared_intermediate_size=40,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2,
        mamba_n_heads=6, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, mamba_chunk_size=8,
        layer_types=["mamba", "attention", "mamba", "attention"], position_embedding_type="nope",
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # a shared expert twice the experts' size: absorbed into the fused MoE as two extra experts
    "granite-moe-absorbed": dict(
        arch="GraniteMoeHybrid", initializer_range=0.2, vocab_size=173, hidden_size=40, intermediate_size=24,
        shared_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=3,
        mamba_n_heads=5, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8,
        layer_types=["mamba", "attention", "mamba"], position_embedding_type="nope",
        embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=1.5,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # dense shared MLP only, RoPE, untied, n_groups 1
    "granite-dense-rope": dict(
        arch="GraniteMoeHybrid", initializer_range=0.2, vocab_size=199, hidden_size=32, intermediate_size=32,
        shared_intermediate_size=56,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, num_local_experts=0, num_experts_per_tok=0,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8,
        layer_types=["attention", "mamba", "mamba"], position_embedding_type="rope", attention_multiplier=0.25,
        embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    "bamba": dict(
        arch="Bamba", initializer_range=0.2, vocab_size=203, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=6, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=3, mamba_expand=2, mamba_chunk_size=8, attn_layer_indices=[1],
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Bamba with the config's own attention head_dim (16 != hidden / heads = 10), MHA, 2 groups
    "bamba-head-dim": dict(
        arch="Bamba", initializer_range=0.2, vocab_size=161, hidden_size=40, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, mamba_n_heads=5, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8, attn_layer_indices=[0],
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    "mamba2": dict(
        arch="Mamba2", initializer_range=0.3, vocab_size=197, hidden_size=32, num_hidden_layers=2, num_heads=4,
        head_dim=16, state_size=8,
        n_groups=2, expand=2, chunk_size=8, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    "mamba2-untied": dict(
        arch="Mamba2", initializer_range=0.3, vocab_size=150, hidden_size=24, num_hidden_layers=2, num_heads=3,
        head_dim=16, state_size=8,
        n_groups=1, expand=2, chunk_size=8, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        time_step_limit=(0.01, 0.5),
    ),
    # Mamba-1: d_inner 72 (a partial channel block of the scan kernel), time_step_rank "auto"
    # (3), tied embeddings, float32 residual stream; A_log perturbed per channel by _perturb
    "mamba1": dict(
        arch="Mamba", initializer_range=0.3, vocab_size=190, hidden_size=36, state_size=16, num_hidden_layers=2,
        conv_kernel=4, expand=2, use_conv_bias=True, residual_in_fp32=True, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Mamba-1: d_state 24, conv width 3, projection biases, untied, residual stream in the model dtype
    "mamba1-untied": dict(
        arch="Mamba", initializer_range=0.3, vocab_size=170, hidden_size=40, state_size=24, num_hidden_layers=2,
        conv_kernel=3, expand=2, time_step_rank=5, use_conv_bias=True, use_bias=True, residual_in_fp32=False,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Zamba2: two shared blocks over three hybrid depths, attention and MLP adapters, RoPE,
    # time_step_min high enough that transformers' lower dt clamp binds; tied embeddings
    "zamba2": dict(
        arch="Zamba2", initializer_range=0.2, vocab_size=193, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"], num_mem_blocks=2,
        num_attention_heads=4, num_key_value_heads=4, use_shared_attention_adapter=True, adapter_rank=8,
        use_mem_rope=True,
        n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, mamba_expand=2, chunk_size=8, time_step_min=0.02,
        hidden_act="gelu", rms_norm_eps=1e-4, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Zamba2: one shared block, hybrid first layer, GQA, no attention adapters, NoPE. Tied
    # embeddings: transformers 5 ties the shared blocks' weights only when it ties embeddings.
    "zamba2-gqa": dict(
        arch="Zamba2", initializer_range=0.2, vocab_size=181, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
        layers_block_type=["hybrid", "mamba", "hybrid", "mamba"], num_mem_blocks=1,
        num_attention_heads=4, num_key_value_heads=2, use_shared_attention_adapter=False, adapter_rank=4,
        use_mem_rope=False,
        n_mamba_heads=6, mamba_d_state=16, mamba_ngroups=1, mamba_expand=2, chunk_size=8,
        hidden_act="gelu", tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Nemotron-H: Mamba, NoPE GQA attention and MLP-only layers; head_dim != hidden / heads,
    # Mamba width (heads x head_dim) != expand x hidden; the lower dt clamp binds
    "nemotron-h": dict(
        arch="NemotronH", initializer_range=0.2, vocab_size=191, hidden_size=48, intermediate_size=80,
        hybrid_override_pattern="M*-M-", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8, time_step_min=0.02,
        layer_norm_epsilon=1e-4, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Nemotron-H with MoE layers: grouped sigmoid routing, latent experts, shared expert, scaling;
    # tie_word_embeddings=True, which transformers ignores for Nemotron-H (lm_head stays its own)
    "nemotron-h-moe": dict(
        arch="NemotronH", initializer_range=0.2, vocab_size=187, hidden_size=32, intermediate_size=48,
        hybrid_override_pattern="ME*-E", num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, moe_latent_size=16, routed_scaling_factor=2.5,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Falcon-H1: parallel Mamba2 + GQA RoPE attention per layer, every muP multiplier != 1, no
    # gated norm in the mixer (y * silu(z)), Mamba width mamba_d_ssm (48) != expand x hidden, untied
    "falcon-h1": dict(
        arch="FalconH1", initializer_range=0.2, vocab_size=179, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=3, mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=8, mamba_rms_norm=False, embedding_multiplier=2.0, lm_head_multiplier=0.7,
        attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.6, ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.7], mlp_multipliers=[1.4, 0.6],
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Falcon-H1 flipped: gated RMSNorm over 2 groups with the gate first (norm_before_gate false),
    # in_proj / out_proj / attention / MLP biases, no conv bias, MHA, Mamba width expand x hidden, tied
    "falcon-h1-norm": dict(
        arch="FalconH1", initializer_range=0.2, vocab_size=167, hidden_size=24, intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=3, mamba_d_ssm=None, mamba_expand=2, mamba_n_heads=6,
        mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, mamba_d_conv=3, mamba_rms_norm=True, mamba_norm_before_gate=False,
        mamba_proj_bias=True, projectors_bias=True, mamba_conv_bias=False, attention_bias=True, mlp_bias=True,
        embedding_multiplier=0.5, lm_head_multiplier=1.5, attention_in_multiplier=1.25, attention_out_multiplier=0.75,
        key_multiplier=1.5, ssm_in_multiplier=0.9, ssm_out_multiplier=1.1, ssm_multipliers=[1.3, 0.6, 1.2, 0.9, 1.4],
        mlp_multipliers=[0.7, 1.2], rms_norm_eps=1e-4,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Falcon-H1 with the gated norm after the normalisation (norm_before_gate, the config default), 2 groups;
    # attention head_dim (16) != hidden / heads, as in the published configs
    "falcon-h1-norm-first": dict(
        arch="FalconH1", initializer_range=0.2, vocab_size=157, hidden_size=32, intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
        embedding_multiplier=1.5, lm_head_multiplier=0.8, key_multiplier=0.7, ssm_multipliers=[0.9, 1.1, 1.3, 0.8, 1.2],
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Jamba: Mamba-1 mixers with dt/B/C norms and NoPE GQA attention, alternating (period 2,
    # offset 1); MoE (4 experts, top-2, softmax not renormalised) on layers 0 and 2, dense MLPs
    # after the attention layers
    "jamba": dict(
        arch="Jamba", initializer_range=0.2, vocab_size=199, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
        pad_token_id=0,
    ),
    # Jamba: MoE after every layer, top-1 (its weight is that expert's softmax probability, not 1),
    # attention first (period 3, offset 0), 4:1 GQA, conv width 3, dt rank 5, no conv bias,
    # in/out_proj biases, tied embeddings
    "jamba-moe-every-layer": dict(
        arch="Jamba", initializer_range=0.2, vocab_size=173, hidden_size=40, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, num_experts=6, num_experts_per_tok=1,
        attn_layer_period=3, attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0,
        mamba_d_state=16, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=5, mamba_conv_bias=False, mamba_proj_bias=True,
        rms_norm_eps=1e-4, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # Shapes for tensor parallelism at 2 and 4 ranks (tests/engine/test_tensor_parallel.py):
    # granite: n_groups 1 (B/C replicated, the gated norm all-reduced), one KV head for 4 query
    # heads, a shared expert beside the MoE (40 is no multiple of 16: not absorbed), untied, a
    # vocabulary of 211 (padded on the last rank)
    "granite-tp": dict(
        arch="GraniteMoeHybrid", initializer_range=0.2, vocab_size=211, hidden_size=48, intermediate_size=16,
        shared_intermediate_size=40,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, num_local_experts=5, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=12, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8,
        layer_types=["mamba", "attention", "mamba", "attention"], position_embedding_type="nope",
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # granite: n_groups 2 (split at 2 ranks, each group on 2 ranks at 4), the shared expert absorbed
    # into the MoE (32 = 2 x 16), RoPE, tied embeddings
    "granite-tp-absorbed": dict(
        arch="GraniteMoeHybrid", initializer_range=0.2, vocab_size=199, hidden_size=32, intermediate_size=16,
        shared_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, mamba_chunk_size=8,
        layer_types=["mamba", "attention", "mamba"], position_embedding_type="rope", attention_multiplier=0.25,
        embedding_multiplier=2.0, residual_multiplier=0.7, logits_scaling=1.5,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
    # bamba: n_groups 8 (split at 2 and 4 ranks), 2 KV heads (replicated at 4 ranks), untied
    "bamba-tp": dict(
        arch="Bamba", initializer_range=0.2, vocab_size=203, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=12, mamba_d_state=8,
        mamba_n_groups=8, mamba_expand=2, mamba_chunk_size=8, attn_layer_indices=[1],
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    ),
}


def hf_model(name: str, seed: int = 0):
    """A transformers model of the named tiny config, float32, random weights, eval mode."""
    import transformers

    kw = dict(CONFIGS[name])
    arch = kw.pop("arch")
    config = getattr(transformers, f"{arch}Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    _perturb(model, seed)
    model.whole_dim_gated_norms = _per_group_gated_norm(model, config)
    return model


def n_groups_of(config) -> int:
    """The Mamba2 mixer's group count (B and C heads, gated-norm groups) of a config; 1 if none."""
    for field in ("mamba_n_groups", "n_groups", "mamba_ngroups"):
        if getattr(config, field, None):
            return int(getattr(config, field))
    return 1


def whole_dim_gated_norms(model, n_groups: int) -> list[str]:
    """The Mamba2 gated RMSNorm classes of a transformers model that do not normalise per group:
    each module is run on a random input and gate and compared with the per-group formula of
    mamba_ssm's RMSNormGated(group_size=d_ssm // ngroups), which the checkpoints were trained with.
    transformers 5.17 (the GPU machine's) normalises Mamba2's, Bamba's and GraniteMoeHybrid's
    over the whole inner dimension; 5.24 per group. Falcon-H1's, per group in every version and
    with its norm-before-gate option, is not checked."""
    found = []
    if n_groups == 1:
        return found
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        name = type(module).__name__
        if not name.endswith("RMSNormGated") or name.startswith("FalconH1") or name in found:
            continue
        width = module.weight.shape[0]
        x, z = torch.randn(3, width, generator=g), torch.randn(3, width, generator=g)
        with torch.no_grad():
            got = module(x, z)
            want = _gated_norm_per_group(module, x, z, width // n_groups)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            found.append(name)
    return found


def skip_unless_transformers_per_group(hf) -> None:
    """Skip a test that compares with `hf`'s outputs when the installed transformers normalises a
    Mamba2 gated norm of it over the whole inner dimension (`whole_dim_gated_norms`): the test would
    fail for transformers' reason, not ours. `tests/models/test_parity.py::test_gpu_n_groups_
    matches_our_cpu_float32` checks those models against our own CPU float32 path instead."""
    import pytest
    import transformers

    names = getattr(hf, "whole_dim_gated_norms", None)
    if names is None:
        names = whole_dim_gated_norms(hf, n_groups_of(hf.config))
    if names:
        reason = (f"transformers {transformers.__version__} normalises {', '.join(names)} over the whole inner "
                  f"dimension, not per group (n_groups={n_groups_of(hf.config)}): not a reference")
        print(reason)
        pytest.skip(reason)


def _per_group_gated_norm(model, config) -> list[str]:
    """Where the installed transformers normalises a gated norm over the whole inner dimension
    (`whole_dim_gated_norms`), its forward is replaced by the per-group formula, so that uses of the
    model that are not parity checks (router margins, tie-free tokens, saved checkpoints) see the
    right model; parity tests skip such a model (`skip_unless_transformers_per_group`). Returns the
    replaced classes' names."""
    n_groups = n_groups_of(config)
    names = whole_dim_gated_norms(model, n_groups)
    for module in model.modules():
        if type(module).__name__ in names:
            size = module.weight.shape[0] // n_groups
            module.forward = functools.partial(_gated_norm_per_group, module, group_size=size)
    return names


def _gated_norm_per_group(norm, hidden_states, gate=None, group_size=None):
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    if gate is not None:
        h = h * torch.nn.functional.silu(gate.to(torch.float32))
    g = h.view(*h.shape[:-1], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * g.view(h.shape).to(dtype)


@torch.no_grad()
def _perturb(model, seed):
    """Random init leaves norms at 1, D at 1, A at -(1..H): move them so a bug in their use shows."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g)).add_(0.05 * torch.randn(p.shape, generator=g))
        if name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g) - 1.0)
        if name.endswith("A_log") and p.dim() == 2:  # Mamba-1 inits every channel's rates alike
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zero at init; a buffer in transformers
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


@functools.cache
def checkpoint(name: str) -> str:
    """Path of a saved checkpoint of the tiny config (built once per test session)."""
    path = tempfile.mkdtemp(prefix=f"mambaserve-{name}-")
    hf_model(name).save_pretrained(path)
    return path


def _router_margin(router, hidden_states) -> torch.Tensor:
    """Per token, how far a transformers MoE router's choice is from a tie: the smallest gap between
    a chosen and a passed-over score (and, for group-limited routing, between the kept and the next
    group). hidden_states: (..., hidden) -> (num_tokens,) float32."""
    x = hidden_states.reshape(-1, router.weight.shape[1]).float()
    logits = x @ router.weight.float().T
    k = router.top_k
    if not hasattr(router, "e_score_correction_bias"):  # granite: softmax over the top-k logits
        top = logits.topk(k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]
    s = logits.sigmoid() + router.e_score_correction_bias.float()  # nemotron-h: DeepSeek-V3 routing
    grouped = s.view(len(s), router.num_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
    kept = group_scores[:, router.topk_group - 1]
    margin = kept - group_scores[:,
                                 router.topk_group] if router.topk_group < router.num_group else torch.full_like(kept,
                                                                                                                 float("inf"))
    keep = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices  # (T, topk_group)
    pool = grouped.gather(1, keep[:, :, None].expand(-1, -1, grouped.shape[-1])).flatten(1)
    top = pool.topk(min(k + 1, pool.shape[1]), dim=-1).values
    if top.shape[1] > k:
        margin = torch.minimum(margin, top[:, k - 1] - top[:, k])
    return margin


def tie_free_tokens(hf, lengths: list[int], min_margin: float = 0.02, tries: int = 32) -> list[list[int]]:
    """Random token sequences of the given lengths on which no MoE router of `hf` (float32) is near a
    tie: each token is drawn until every router's margin at its position is at least `min_margin`.

    In bfloat16 a near tie can pick another expert in one implementation and not the other, an O(1)
    change of that token's logits and, through the recurrent state, of later ones: not a bug, and not
    a bar a parity test can set. Models without routers get plain random tokens. Uses the global RNG.
    """
    vocab = hf.config.vocab_size
    routers = [m for m in hf.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    if not routers:
        return [torch.randint(3, vocab, (n,)).tolist() for n in lengths]
    margins: list[torch.Tensor] = []  # per router call: (tries,) margins at the last position

    def record(router, args, _out):
        margins.append(_router_margin(router, args[0]).view(tries, -1)[:, -1])

    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        seqs = []
        for n in lengths:
            seq: list[int] = []
            for _ in range(n):
                cands = torch.randint(3, vocab, (tries, 1))
                margins.clear()
                with torch.no_grad():
                    hf(torch.cat([torch.tensor(seq, dtype=torch.long).expand(tries, len(seq)), cands], 1))
                worst = torch.stack(margins).min(0).values  # (tries,)
                ok = (worst >= min_margin).nonzero()
                seq.append(int(cands[ok[0, 0] if len(ok) else worst.argmax(), 0]))
            seqs.append(seq)
    finally:
        for h in hooks:
            h.remove()
    return seqs


def routers_of(hf) -> list:
    """The MoE routers of a transformers model (Granite's, Nemotron-H's, Jamba's), in call order."""
    return [m for m in hf.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]


def router_margins(hf, tokens: list[int]) -> torch.Tensor:
    """Per position of one sequence, the smallest router margin (`_router_margin`) over every MoE
    layer of `hf` (float32, one forward): (len(tokens),) float32, inf where the model has no
    router. A position whose router input is exactly zero counts as inf: there every expert's
    output is zero too (Jamba's pad token has a zero embedding and its first Mamba layer's gate
    is then zero), so a tie there changes nothing."""
    margins = torch.full((len(tokens),), float("inf"))

    def record(router, args, _out):
        x = args[0].reshape(-1, args[0].shape[-1])
        m = _router_margin(router, x)
        m[x.float().abs().amax(-1) == 0] = float("inf")
        torch.minimum(margins, m, out=margins)

    hooks = [r.register_forward_hook(record) for r in routers_of(hf)]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return margins


def steps_before_near_tie(hf, prompt: list[int], output: list[int], min_margin: float = 0.02) -> int:
    """How many greedy steps of `output` (generated after `prompt`) come before any router of `hf`
    is within `min_margin` of a tie: step t's logits are computed at position len(prompt) + t - 1,
    so a near tie at position q can change every step from q - len(prompt) + 1 on (all of them
    for a prompt position). len(output) when no router is near a tie."""
    if not output:
        return 0
    near = (router_margins(hf, prompt + output[:-1]) < min_margin).nonzero()
    if not len(near):
        return len(output)
    return max(0, int(near[0, 0]) - len(prompt) + 1)
