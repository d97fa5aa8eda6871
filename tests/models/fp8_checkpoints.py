"""Tiny FP8 checkpoints in the compressed-tensors layout, written with the `compressed-tensors`
library (its scheme presets, scale computation, compressor and config model), beside the
same checkpoint with the weights dequantized by the library (the reference model).

The transformers models of these families keep their experts as 3-D parameters, not Linear
modules, so layers are chosen from the checkpoint's tensor names: every `X.weight` whose
module leaf is a projection (HF's Linear layers, and Granite's stacked `input_linear` /
`output_linear` experts, quantized expert by expert), unless the library's name matching puts
it in `ignore`. Plain helpers, no tests.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny import checkpoint

LINEAR_LEAVES = ("in_proj", "out_proj", "x_proj", "dt_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                 "up_proj", "down_proj", "input_linear", "output_linear", "layer")


def _compress(w: torch.Tensor, scheme):
    """The library's FP8 compression of one 2-D weight: (fp8 weight, float32 scale)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    if scheme.weights.strategy == "channel":
        mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        mn, mx = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(mn.clamp(max=0), mx.clamp(min=0), scheme.weights)
    out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out["weight"], out["weight_scale"]


def write_fp8_checkpoint(name: str, preset: str, ignore: list[str], kv_scales: bool = False) -> tuple[str, str]:
    """(FP8 checkpoint dir, dequantized reference dir) of tiny config `name`, compressed-tensors
    scheme `preset` ("FP8": per-tensor weights, static per-tensor input_scale; "FP8_DYNAMIC":
    per-channel weights, dynamic per-token activations). kv_scales: a kv_cache_scheme with
    k_scale / v_scale per attention layer."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.utils.match import match_name

    src = Path(checkpoint(name))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    tensors = load_file(src / "model.safetensors")
    fp8, deq = {}, {}
    g = torch.Generator().manual_seed(7)
    for key, t in tensors.items():
        mod, _, leaf = key.rpartition(".")
        quantize = (leaf == "weight" and t.dim() in (2, 3) and mod.rpartition(".")[2] in LINEAR_LEAVES
                    and not any(match_name(mod, i) for i in ignore))
        if not quantize:
            fp8[key] = deq[key] = t
            continue
        slices = [_compress(w, scheme) for w in (t if t.dim() == 3 else [t])]  # expert by expert
        back = [dequantize(x_q=q, scale=sc, args=scheme.weights) for q, sc in slices]
        if t.dim() == 3:
            fp8[key] = torch.stack([q for q, _ in slices])
            fp8[f"{mod}.weight_scale"] = torch.stack([s for _, s in slices])
            deq[key] = torch.stack(back).to(t.dtype)
        else:
            (fp8[key], fp8[f"{mod}.weight_scale"]), deq[key] = slices[0], back[0].to(t.dtype)
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            fp8[f"{mod}.input_scale"] = torch.rand(1, generator=g) * 0.02 + 0.005  # as a calibration would give
    kv_scheme = None
    if kv_scales:
        kv_scheme = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        for key in list(tensors):
            if key.endswith("self_attn.k_proj.weight"):
                base = key[: -len("k_proj.weight")]
                fp8[base + "k_scale"] = torch.rand(1, generator=g) * 0.01 + 0.002
                fp8[base + "v_scale"] = torch.rand(1, generator=g) * 0.01 + 0.002
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format="float-quantized",
                                 quantization_status="compressed", kv_cache_scheme=kv_scheme)
    dirs = []
    for tag, state, qc in (("fp8", fp8, qconfig.model_dump(mode="json")), ("deq", deq, None)):
        dst = Path(tempfile.mkdtemp(prefix=f"mambaserve-{name}-{preset}-{tag}-"))
        for f in src.iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, dst / f.name)
        save_file({k: v.contiguous() for k, v in state.items()}, dst / "model.safetensors")
        if qc is not None:
            cfg = json.loads((dst / "config.json").read_text())
            cfg["quantization_config"] = qc
            (dst / "config.json").write_text(json.dumps(cfg, indent=1))
        dirs.append(str(dst))
    return dirs[0], dirs[1]
