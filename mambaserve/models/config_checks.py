"""Config fields a family may carry that its model does not implement: refused, never ignored.

A checkpoint whose config sets such a field to another value would otherwise load and run as
another model, with no error. Each check raises ValueError naming the family, the field and its
value. Fields that only steer training or initialisation (dropout, `rescale_prenorm_residual`,
`time_step_floor`, `z_loss_coefficient`, router aux losses) or a kernel choice (`use_mambapy`,
`use_mamba_kernels`) change no output and are not checked.
"""

from __future__ import annotations

_SILU = ("silu", "swish")


def require_silu(config, family: str, field: str, where: str) -> None:
    """The activation config.<field> must be SiLU: `where` names what uses it (the Mamba conv,
    the MLP). A missing field is transformers' default, SiLU."""
    act = getattr(config, field, "silu")
    if act not in _SILU:
        raise ValueError(f"{family} {field}={act!r} is not supported: {where} runs SiLU only")


def require_value(config, family: str, field: str, supported, why: str) -> None:
    """config.<field> (missing: `supported`) must equal `supported`; `why` says what the other
    values would mean."""
    value = getattr(config, field, supported)
    if value != supported:
        raise ValueError(f"{family} {field}={value!r} is not supported ({why})")


def rope_type(config) -> str:
    """The config's RoPE type: `rope_parameters["rope_type"]` (transformers 5) or the older
    `rope_scaling["type"]`; "default" when neither is set."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default")


def require_default_rope(config, family: str) -> None:
    """Only unscaled RoPE (base^(-2i / rotary_dim)) is implemented: a scaled type (linear,
    dynamic, yarn, llama3, ...) would rotate by other angles."""
    kind = rope_type(config)
    if kind != "default":
        raise ValueError(f"{family} rope_type {kind!r} is not supported (only 'default', unscaled RoPE)")
