"""FP8 weights for the linear layers and experts: which layers a quantization config selects,
their parameters, and how they run.

Two sources, vLLM's names:
- "compressed-tensors": a checkpoint quantized in that format (llm-compressor's FP8 and
  FP8_DYNAMIC schemes, as published for Granite 4.0-H and Jamba). Its config.json holds a
  `quantization_config`: `config_groups`, each with `targets` (a class name, "Linear", or a
  module name, or "re:<regex>" matched from the name's start) and the `weights` /
  `input_activations` arguments (num_bits 8, type "float", symmetric; weights strategy
  "tensor" or "channel", static; activations strategy "token" and dynamic, or "tensor" and
  static with an `input_scale` tensor per layer), an `ignore` list in the same syntax (e.g.
  lm_head, routers, the Mamba in_proj), and `kv_cache_scheme` (per-tensor `k_scale` /
  `v_scale` of each attention layer). A quantized layer `X` stores `X.weight` in
  float8_e4m3fn, `X.weight_scale` (float32: (1,) per tensor, (N, 1) per channel) and, static
  activations, `X.input_scale` (1,). Parsed here from the dict: the `compressed-tensors`
  library is not needed to load (tests use it to write checkpoints).
- "fp8" (online): every linear layer of the model (not lm_head, embeddings, routers) and
  every MoE's experts get weights quantized per output channel as they load, activations
  per token at run time.

Selection follows compressed-tensors' matching: a module matches a target by its name, or by
class for "Linear" (our column-, row-parallel and replicated linears, and the stacked expert
weights, which hold one linear per expert). A matched module that cannot run FP8 (a plain
nn.Linear such as a router, or a layer whose weight another op reads raw:
`supports_fp8 = False`) stays in the model dtype, and the loader dequantizes its checkpoint
weight into it. Linear layers run `ops.fp8_linear`; experts `ops.fused_moe` with per-row
scales: weight-only FP8 below 32 routed rows per expert, and from there on Hopper FP8 x FP8
with the activations quantized per row at run time (dynamic scales: a static expert
input_scale is loaded but not used). After loading, every weight scale is widened to
one per output row (exact: a per-tensor scale repeated), the layout the kernels take.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from mambaserve import ops
from mambaserve.distributed import SINGLE, TensorParallelGroup
from mambaserve.layers.linear import Shard, set_shard
from mambaserve.ops.fp8 import FP8_DTYPE, quantize_fp8

METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class Fp8Scheme:
    """per_channel: one weight scale per output row (else one per tensor). static_input: the
    activations take the checkpoint's per-tensor input_scale (else dynamic, per token)."""

    per_channel: bool = True
    static_input: bool = False


ONLINE_FP8 = Fp8Scheme(per_channel=True, static_input=False)


@dataclass(frozen=True)
class QuantizationConfig:
    """method: "fp8" or "compressed-tensors"; groups: (targets, scheme) pairs; ignore: the
    modules left unquantized; kv_cache_scales: the checkpoint holds k_scale / v_scale."""

    method: str
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()
    kv_cache_scales: bool = False

    def scheme_for(self, name: str, module: nn.Module) -> Fp8Scheme | None:
        """The scheme of module `name`, or None when no group targets it or it is ignored."""
        if any(_matches(name, module, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, module, t) for t in targets):
                return scheme
        return None


def _matches(name: str, module: nn.Module, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == "Linear":
        return isinstance(module, nn.Linear) or getattr(module, "expert_weights", False)
    return target == name or any(c.__name__ == target for c in type(module).__mro__)


def _fp8_args(args: dict | None, what: str, *, allow_token: bool) -> str:
    """Check one compressed-tensors QuantizationArgs dict for FP8; returns its strategy."""
    if not isinstance(args, dict):
        raise ValueError(f"compressed-tensors {what}: expected a dict of quantization arguments, got {args!r}")
    if args.get("num_bits") != 8 or args.get("type") != "float" or args.get("symmetric", True) is not True:
        raise ValueError(f"compressed-tensors {what} {args}: only symmetric 8-bit float (FP8) is supported")
    strategy = args.get("strategy", "tensor")
    allowed = ("tensor", "token") if allow_token else ("tensor", "channel")
    if strategy not in allowed:
        raise ValueError(f"compressed-tensors {what} strategy {strategy!r} is not supported (FP8 {what}: {allowed})")
    return strategy


def parse_compressed_tensors(qc: dict) -> QuantizationConfig:
    """A checkpoint's `quantization_config` (compressed-tensors, FP8) -> QuantizationConfig.
    Raises ValueError, naming the field, for anything but FP8 weights (per tensor or per
    channel) with FP8 activations (dynamic per token or static per tensor)."""
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"quantization_config quant_method {qc.get('quant_method')!r}: expected 'compressed-tensors'")
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized", None):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: only FP8 'float-quantized'")
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        w = _fp8_args(group.get("weights"), f"{gname} weights", allow_token=False)
        if group["weights"].get("dynamic", False):
            raise ValueError(f"compressed-tensors {gname}: dynamic weight scales are not supported")
        if group.get("input_activations") is None:
            raise ValueError(f"compressed-tensors {gname}: weight-only FP8 (no input_activations) is not supported")
        a = _fp8_args(group["input_activations"], f"{gname} input_activations", allow_token=True)
        dynamic = bool(group["input_activations"].get("dynamic", False))
        if (a == "token") != dynamic:
            raise ValueError(f"compressed-tensors {gname} input_activations: FP8 activations are dynamic per token "
                             f"or static per tensor, got strategy {a!r} with dynamic={dynamic}")
        if group.get("output_activations") is not None:
            raise ValueError(f"compressed-tensors {gname}: output_activations quantization is not supported")
        targets = group.get("targets") or []
        groups.append((tuple([targets] if isinstance(targets, str) else targets),
                       Fp8Scheme(per_channel=w == "channel", static_input=a == "tensor")))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and _fp8_args(kv, "kv_cache_scheme", allow_token=False) != "tensor":
        raise ValueError("compressed-tensors kv_cache_scheme: only per-tensor FP8 k/v scales are supported")
    ignore = qc.get("ignore") or []
    ignore = tuple([ignore] if isinstance(ignore, str) else ignore)
    return QuantizationConfig("compressed-tensors", tuple(groups), ignore, kv_cache_scales=kv is not None)


def resolve_quantization(hf_config, quantization: str | None) -> QuantizationConfig | None:
    """The quantization a model is built with: the engine's `quantization` and the checkpoint's
    `quantization_config` (detected when quantization is None, as vLLM does). Raises
    ValueError for "compressed-tensors" without such a config, for "fp8" on a checkpoint that
    is already quantized, or for a method this engine does not read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    if quantization not in (None, *METHODS):
        raise ValueError(f"quantization must be None or one of {METHODS}, got {quantization!r}")
    if qc is not None:
        method = qc.get("quant_method")
        if quantization is not None and quantization != method:
            raise ValueError(f"the checkpoint is quantized with {method!r} (its quantization_config); "
                             f"quantization={quantization!r} does not apply to it")
        if method != "compressed-tensors":
            raise ValueError(f"checkpoints quantized with {method!r} are not supported (only compressed-tensors FP8)")
        return parse_compressed_tensors(qc)
    if quantization == "compressed-tensors":
        raise ValueError("quantization='compressed-tensors' but the checkpoint's config.json has no "
                         "quantization_config")
    if quantization == "fp8":
        return QuantizationConfig("fp8", ((("Linear",), ONLINE_FP8),), ignore=("lm_head",))
    return None


class Fp8LinearMethod:
    """How a linear layer with an FP8 weight runs: `ops.fp8_linear`."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, bias, getattr(layer, "input_scale", None))


def _fp8_param(shape, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)


def _make_fp8(module: nn.Module, scheme: Fp8Scheme, group) -> None:
    """Swap module.weight for an FP8 one and add weight_scale (and input_scale), with the
    weight's row shard when the scale is per row (the output rows are the first dimension
    of a linear's weight, the second of stacked experts')."""
    w = module.weight
    row_dim = w.dim() - 2
    module.weight = _fp8_param(w.shape, w.device)
    shape = list(w.shape[:-1]) + [1] if scheme.per_channel else list(w.shape[:-2]) + [1, 1][-(w.dim() - 1):]
    module.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=w.device), requires_grad=False)
    shard = getattr(module, "tp_shards", {}).get("weight")
    if shard is not None and scheme.per_channel and shard.dim == row_dim:
        set_shard(module, "weight_scale", Shard(row_dim, shard.full_size, shard.ranges), group)
    if scheme.static_input and not getattr(module, "expert_weights", False):
        module.input_scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=w.device), requires_grad=False)
    module.fp8_scheme = scheme
    if isinstance(module, nn.Linear):
        module.quant_method = Fp8LinearMethod(scheme)


def prepare_fp8_modules(model: nn.Module, qconfig: QuantizationConfig, group: TensorParallelGroup = SINGLE
                        ) -> dict[str, Fp8Scheme]:
    """Give every module that `qconfig` selects and that can run FP8 its FP8 parameters (on the
    meta device, before the model is materialised; `group`: the rank's, whose shards the
    per-row scales follow). Returns {module name: scheme} of those,
    and records on the model (`fp8_dequantize`) the selected modules that stay in the model
    dtype, whose checkpoint FP8 weights the loader dequantizes."""
    chosen, dequantize = {}, {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() < 2 or name == "lm_head":
            continue
        scheme = qconfig.scheme_for(name, module)
        if scheme is None:
            continue
        capable = (getattr(module, "expert_weights", False) or hasattr(module, "quant_method")) \
            and getattr(module, "supports_fp8", True)
        (chosen if capable else dequantize)[name] = scheme
    for name, scheme in chosen.items():
        _make_fp8(model.get_submodule(name), scheme, group)
    model.fp8_dequantize = dequantize if qconfig.method == "compressed-tensors" else {}
    model.quantization_method = qconfig.method
    return chosen


def fp8_modules(model: nn.Module):
    """(name, module) of every module holding an FP8 weight."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "fp8_scheme", None) is not None]


@torch.no_grad()
def fill_quantized(module: nn.Module, weight: torch.Tensor) -> None:
    """Quantize a float weight (the module's weight shape) into module.weight and its scale,
    with the module's scheme (per row, or one scale for the weight / for each expert)."""
    per_row = module.fp8_scheme.per_channel
    if per_row:
        q, s = quantize_fp8(weight, per_row=True)
    else:
        flat = weight.reshape(-1, weight.shape[-2] * weight.shape[-1]) if weight.dim() == 3 else weight.reshape(1, -1)
        q, s = quantize_fp8(flat, per_row=True)
        q = q.reshape(weight.shape)
    module.weight.copy_(q)
    module.weight_scale.copy_(s.reshape(module.weight_scale.shape))


@torch.no_grad()
def init_dummy_fp8(model: nn.Module, seed: int, std: float) -> None:
    """Dummy weights for the FP8 modules: N(0, std) drawn on the device, then quantized."""
    for name, module in fp8_modules(model):
        g = torch.Generator(device=module.weight.device).manual_seed(seed + len(name) * 7919)
        w = torch.empty(module.weight.shape, dtype=torch.float32, device=module.weight.device)
        fill_quantized(module, w.normal_(0.0, std, generator=g))
        if hasattr(module, "input_scale"):
            module.input_scale.fill_(0.1)


@torch.no_grad()
def widen_scales(model: nn.Module) -> None:
    """After loading: every weight scale becomes one float32 per output row, (N,) for a
    linear, (E, N) for stacked experts (a per-tensor scale repeated: the same weights)."""
    for _, m in fp8_modules(model):
        w = m.weight
        rows = w.shape[:-1]
        s = m.weight_scale.float().reshape(*w.shape[:-2], -1)  # (..., 1 or N)
        m.weight_scale = nn.Parameter(s.expand(*rows).contiguous(), requires_grad=False)
