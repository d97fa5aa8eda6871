"""What every model offers the engine: a packed forward, logits, and its cache declaration.

A model runs on a packed token batch: `forward(input_ids (num_tokens,), positions
(num_tokens,), ctx) -> hidden (num_tokens, hidden)`, then `compute_logits(hidden)`. Its
`cache_spec()` collects what each stateful layer declares (the per-request state of each Mamba
layer, the per-token KV entry of each attention layer), so the engine sizes and allocates
caches without reading HF config fields, and no family lists its caches itself.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from mambaserve.cache.spec import CacheDtypes, CacheSpec, collect_cache_spec
from mambaserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from mambaserve.layers.norm import RMSNorm


class HybridForCausalLM(nn.Module):
    """Common parts: logits, cache declaration, parameter initialisation for dummy weights.

    Subclasses set `self.lm_head` (or tie it), `self.logits_scale` and implement `forward`.
    Per-family settings the engine and loader read:
    - default_mamba_ssm_cache_dtype: the SSM state dtype the family is meant to run with
      ("float32" for Nemotron-H), used when the engine's mamba_ssm_cache_dtype is "auto";
      None means the model dtype.
    - checkpoint_ignore_prefixes: checkpoint tensors the model does not use (e.g. Nemotron's
      multi-token-prediction head "mtp."), skipped by the loader instead of rejected.
    - max_piecewise_tokens: the largest step the engine captures as piecewise CUDA graphs
      (None: up to its step budget), for models whose capture path costs more than eager.
    - finalize_weights(): called by the loader once the weights are in (layouts derived from
      them, e.g. Granite's shared expert joining its MoE).
    """

    logits_scale: float = 1.0
    default_mamba_ssm_cache_dtype: str | None = None
    checkpoint_ignore_prefixes: tuple[str, ...] = ()
    max_piecewise_tokens: int | None = None

    def __init__(self, config):
        super().__init__()
        self.config = config

    def make_lm_head(self, embeddings: VocabParallelEmbedding) -> None:
        """lm_head (vocabulary-parallel, as the embeddings), sharing the embedding matrix when
        the config ties them."""
        self.lm_head = ParallelLMHead(embeddings.vocab_size, embeddings.embedding_dim)
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = embeddings.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (n, hidden) -> float32 logits (n, vocab_size)."""
        logits = self.lm_head(hidden_states).float()
        if self.logits_scale != 1.0:
            logits = logits / self.logits_scale
        return logits

    def cache_dtypes(self, ssm_dtype: torch.dtype | None = None) -> CacheDtypes:
        """Every cache in the model dtype (lm_head's) but the SSM state: `ssm_dtype`, else the
        family's default_mamba_ssm_cache_dtype, else the model dtype."""
        default = self.default_mamba_ssm_cache_dtype
        return CacheDtypes.of(self.lm_head.weight.dtype, ssm_dtype or (getattr(torch, default) if default else None))

    def cache_spec(self, dtypes: CacheDtypes | None = None) -> CacheSpec:
        """The caches every stateful layer of the model declares (default dtypes:
        `cache_dtypes()`), by cache index."""
        return collect_cache_spec(self.modules(), dtypes or self.cache_dtypes())

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of a realistic scale, for benchmarks without a checkpoint.

        Matrices and embeddings ~ N(0, initializer_range); norms 1; Mamba A = -(1..nheads)
        (Mamba-1: -(1..d_state) for every channel, S4D-real),
        D = 1, the step-size bias (Mamba2's `dt_bias`, Mamba-1's `dt_proj.bias`) = softplus^-1
        of dt log-uniform in [time_step_min, time_step_max] (config fields, default [1e-3, 1e-1];
        Gu & Dao 2023, section 3.6 and appendix), so that softplus(bias) starts as such a dt.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = float(getattr(self.config, "initializer_range", 0.02))
        lo = math.log(float(getattr(self.config, "time_step_min", 1e-3)))
        hi = math.log(float(getattr(self.config, "time_step_max", 1e-1)))
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.float8_e4m3fn or leaf in ("weight_scale", "input_scale", "k_scale", "v_scale"):
                continue  # FP8 weights and their scales: the loader's init_dummy_fp8; KV scales stay 1
            if leaf == "A_log":  # (nheads,) in Mamba2, (d_inner, d_state) in Mamba-1: 1..last dim per row
                p.copy_(torch.log(torch.arange(1, p.shape[-1] + 1, dtype=torch.float32)).expand_as(p))
            elif leaf == "D":
                p.fill_(1.0)
            elif leaf == "dt_bias" or name.endswith("dt_proj.bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                # Draw on the parameter's device in chunks: fast for multi-GB models on the GPU.
                g = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
                p.normal_(0.0, std, generator=g)


class MambaBackbone(nn.Module):
    """transformers' `backbone` of the pure-SSM families (Mamba-1, Mamba2): `embeddings`, the
    blocks `layers.{i}` built by `block(config, i)`, and the final RMSNorm `norm_f`."""

    def __init__(self, config, block):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
