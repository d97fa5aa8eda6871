"""Reading a transformers config into our layers: the parts every family shares.

The layer pattern (one parser for the four ways configs write it), the Mamba2 mixer and the
attention layer of a config with the usual field names, RoPE settings, and each layer's
cache index. Each function names the HF config fields it reads; a family
whose fields differ passes overrides (or builds the layer itself, as Mamba2, Zamba2 and
Nemotron-H do for their differently named Mamba fields).
"""

from __future__ import annotations

import math
from collections.abc import Collection

from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba2 import Mamba2Mixer
from mambaserve.layers.rotary import RotaryEmbedding
from mambaserve.models.config_checks import require_default_rope

# transformers' layer type names, old and new, -> our layer kinds
_KIND_NAMES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
               "full_attention": "attention", "mlp": "mlp", "moe": "moe", "hybrid": "hybrid"}
# Nemotron-H's hybrid_override_pattern symbols
_PATTERN_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def layer_kinds(config, allowed: Collection[str] = ("mamba", "attention")) -> list[str]:
    """One kind per layer: "mamba", "attention", "mlp", "moe" or "hybrid" (Zamba2's Mamba layer
    with a shared transformer block), from the first of these config fields that is set:
    - `layers_block_type` or `layer_types`: transformers' names ("mamba" / "linear_attention",
      "attention" / "full_attention", "mlp", "moe", "hybrid");
    - `hybrid_override_pattern`: Nemotron-H's symbols, one per layer (M, *, -, E);
    - `attn_layer_indices`: Bamba's attention layers, every other layer Mamba;
    - `attn_layer_period`, `attn_layer_offset`: Jamba's, layer i is attention when
      i % period == offset, every other layer Mamba.
    The pattern's length is checked against `num_hidden_layers` where the config sets it.
    Raises ValueError when no field is set, the length differs, or a layer's kind is unknown
    or not in `allowed` (the kinds the family has).
    """
    n = getattr(config, "num_hidden_layers", None)
    names = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if names is None and getattr(config, "hybrid_override_pattern", None) is not None:
        pattern = config.hybrid_override_pattern
        bad = sorted(set(pattern) - set(_PATTERN_SYMBOLS))
        if bad:
            raise ValueError(f"unknown layer symbols {bad} in hybrid_override_pattern; expected M, *, - or E")
        names = [_PATTERN_SYMBOLS[c] for c in pattern]
    if names is None and getattr(config, "attn_layer_indices", None) is not None and n is not None:
        attn = set(config.attn_layer_indices)
        names = ["attention" if i in attn else "mamba" for i in range(n)]
    if names is None and getattr(config, "attn_layer_period", None) is not None and n is not None:
        period, offset = config.attn_layer_period, config.attn_layer_offset
        if not 0 <= offset < period:
            raise ValueError(f"attn_layer_offset must lie in [0, attn_layer_period): {offset} of {period}")
        names = ["attention" if i % period == offset else "mamba" for i in range(n)]
    if names is None:
        raise ValueError("config gives no layer pattern (layers_block_type, layer_types, hybrid_override_pattern, "
                         "attn_layer_indices or attn_layer_period)")
    names = list(names)
    if n is not None and len(names) != n:
        raise ValueError(f"config's layer pattern has {len(names)} entries for num_hidden_layers={n}")
    unknown = sorted({name for name in names if _KIND_NAMES.get(name) not in allowed})
    if unknown:
        expected = sorted(name for name, kind in _KIND_NAMES.items() if kind in allowed)
        raise ValueError(f"unknown layer types {unknown} in the config's layer pattern; expected one of {expected}")
    return [_KIND_NAMES[name] for name in names]


def cache_indices(kinds: list[str]) -> list[int]:
    """Per layer of `kinds` (from `layer_kinds`), its cache index: how many layers before it
    hold the same kind of cache. "mamba" and "hybrid" layers (both hold a Mamba state) share one
    count, "attention" layers have their own; stateless kinds ("mlp", "moe") get -1."""
    counts = {"mamba": 0, "attention": 0}
    indices = []
    for kind in kinds:
        cache = "mamba" if kind == "hybrid" else kind
        indices.append(counts.get(cache, -1))
        if cache in counts:
            counts[cache] += 1
    return indices


def dt_limit(config) -> tuple[float, float]:
    """The time step's clamp from `time_step_limit` (absent or None: no clamp, (0, inf))."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return (0.0, math.inf)
    return (float(limit[0]), float(limit[1]))


def mamba_mixer_from_config(config, cache_index: int, **overrides) -> Mamba2Mixer:
    """The Mamba2 mixer of a config that names its fields `mamba_*` (Bamba, Granite 4.0-H,
    Falcon-H1): hidden_size, mamba_n_heads, mamba_d_head, mamba_d_state, mamba_n_groups,
    mamba_d_conv, mamba_chunk_size, mamba_expand (width = expand * hidden_size),
    mamba_conv_bias, mamba_proj_bias, rms_norm_eps (the gated norm's), time_step_limit.
    `overrides` replace or add Mamba2Mixer keywords (Falcon-H1's width and norm)."""
    kw = dict(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        d_state=config.mamba_d_state,
        n_groups=config.mamba_n_groups,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        intermediate_size=int(config.mamba_expand * config.hidden_size),
        use_conv_bias=config.mamba_conv_bias,
        use_bias=config.mamba_proj_bias,
        eps=config.rms_norm_eps,
        dt_limit=dt_limit(config),
        cache_index=cache_index,
    )
    return Mamba2Mixer(**{**kw, **overrides})


def attention_head_dim(config) -> int:
    """`head_dim`, else (absent or None) hidden_size // num_attention_heads, as transformers."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_from_config(config, cache_index, **overrides) -> Attention:
    """The attention layer of a config with transformers' usual fields: hidden_size,
    num_attention_heads, num_key_value_heads, head_dim (`attention_head_dim`) and
    attention_bias (absent: False); softmax scale 1/sqrt(head_dim) and no RoPE. `overrides`
    replace or add Attention keywords (scale, rotary, bias, Zamba2's input_size and adapters);
    an overridden head_dim also sets the default scale."""
    head_dim = overrides.pop("head_dim", None) or attention_head_dim(config)
    kw = dict(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        bias=getattr(config, "attention_bias", False),
        cache_index=cache_index,
    )
    return Attention(**{**kw, **overrides})


def rope_settings(config) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from `rope_parameters` (transformers >= 5) or the older
    top-level `rope_theta` / `partial_rotary_factor` (defaults 10000, 1). Raises ValueError for
    a `rope_type` other than "default", in either layout (`config_checks.require_default_rope`:
    scaled RoPE variants are not implemented)."""
    require_default_rope(config, type(config).__name__.removesuffix("Config") or "model")
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def rotary_from_config(config, head_dim: int, *, whole_head: bool = False) -> RotaryEmbedding:
    """RoPE over the first partial_rotary_factor of each head's features (`rope_settings`), or
    over all of them with `whole_head` (Falcon-H1, Zamba2 and Granite 4.0-H, which transformers
    rotates whole whatever the factor says). Raises ValueError when the factor gives an odd or
    empty rotary width."""
    theta, partial = rope_settings(config)
    rotary_dim = head_dim if whole_head else int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        # transformers then rotates a rounded-up even width at frequencies of the odd one's: not implemented
        raise ValueError(f"partial_rotary_factor={partial} of head_dim {head_dim} rotates {rotary_dim} features: "
                         "only an even number from 2 to head_dim is supported")
    return RotaryEmbedding(head_dim, rotary_dim, theta)
