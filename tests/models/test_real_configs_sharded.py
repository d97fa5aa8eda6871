"""Per-rank weights of every real architecture in benchmarks/configs under tensor parallelism,
built on the meta device (no memory): each rank holds 1/N of every parameter, except the parts
that stay whole on every rank, listed here by name, and the two by-design extras (B and C of a
Mamba2 group replicated on the ranks that share it, a KV head replicated when the ranks
outnumber them), counted from the whole model's sizes; the vocabulary pads to N equal rows."""

import math
import re
from pathlib import Path

import pytest
import torch

from mambaserve.distributed import TensorParallelGroup, building_with
from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.loader import load_config
from mambaserve.models import get_model_class

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
SUPPORTED = sorted(p.name for p in CONFIGS.glob("*.json"))

# whole on every rank: RMSNorms (not the Mamba2 mixers' gated norm, which is split by head),
# routers, Zamba2's per-depth linear and its adapters' A, Nemotron's MoE latent projections, and
# the biases of row-parallel projections (added once, after the sum)
WHOLE = re.compile(r"(^|\.|_)(norm|norm_f|layernorm)\.weight$|router\.(layer\.)?weight$"
                   r"|\.gate\.(weight|e_score_correction_bias)$|\.linear\.weight$|adapter_list\.\d+\.0\.weight$"
                   r"|latent_proj\.(weight|bias)$|(o_proj|out_proj|down_proj|output_linear)\.bias$")
GATED_NORM = re.compile(r"(mixer|mamba)\.norm\.weight$")


def _is_whole(name: str) -> bool:
    return bool(WHOLE.search(name)) and not GATED_NORM.search(name)


def _build(config, rank=0, world_size=1):
    with torch.device("meta"), building_with(TensorParallelGroup(rank=rank, world_size=world_size)):
        return get_model_class(config)(config)


def _expected_numel(name: str, p: torch.Tensor, owner, N: int) -> int:
    """What rank 0 of N holds of the whole parameter `name` (p) of module `owner`'s layer."""
    if _is_whole(name):
        return p.numel()
    if isinstance(owner, Mamba2Mixer) and re.search(r"(in_proj|conv1d)\.(weight|bias)$", name):
        H, G, d = owner.num_heads, owner.n_groups, owner.d_state
        groups = G // N if G % N == 0 else 1  # a group spread over ranks: replicated on each
        inner = H * owner.head_dim // N
        rows = (2 * inner + H // N if "in_proj" in name else inner) + 2 * groups * d
        return rows * (p.numel() // p.shape[0])
    if isinstance(owner, Attention) and re.search(r"(k_proj|v_proj)(\.|_adapter_list\.\d+\.1\.)(weight|bias)$", name):
        K = owner.num_kv_heads
        return max(1, K // N) * owner.head_dim * (p.numel() // p.shape[0])
    if re.search(r"(embed_tokens|embeddings|lm_head)\.weight$", name):
        return math.ceil(p.shape[0] / N) * p.shape[1]
    assert p.numel() % N == 0, name
    return p.numel() // N


def _owners(model) -> dict[str, torch.nn.Module]:
    """Per parameter name, the Mamba2 mixer or attention layer it belongs to (else None)."""
    owners = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (Mamba2Mixer, Attention)):
            for p_name, _ in mod.named_parameters():
                owners[f"{mod_name}.{p_name}"] = mod
    return owners


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("file", SUPPORTED)
def test_each_rank_holds_its_share_of_the_weights(file, world_size):
    config = load_config(CONFIGS / file)
    whole = _build(config)
    if world_size == 8 and config.model_type == "granitemoehybrid" and config.num_attention_heads == 12:
        with pytest.raises(ValueError, match="attention heads"):  # the tiny Granites: 12 heads
            _build(config, 0, world_size)
        return
    ranks = [_build(config, r, world_size) for r in (0, world_size - 1)]
    owners = _owners(whole)
    whole_params = dict(whole.named_parameters())
    for rank in ranks:
        local = dict(rank.named_parameters())
        assert local.keys() == whole_params.keys()
        for name, p in whole_params.items():
            assert local[name].numel() == _expected_numel(name, p, owners.get(name), world_size), name
    total = sum(p.numel() for p in whole_params.values())
    whole_parts = sum(p.numel() for n, p in whole_params.items() if _is_whole(n))
    per_rank = sum(p.numel() for p in ranks[0].parameters())
    # 1/N of the whole, the whole parts N-fold less shared, and the replicated B/C and KV rows
    assert per_rank >= total / world_size + whole_parts * (1 - 1 / world_size) - 1
    assert per_rank <= 1.25 * total / world_size + whole_parts
