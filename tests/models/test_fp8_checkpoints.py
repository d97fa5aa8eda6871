"""compressed-tensors FP8 checkpoints of the Granite 4.0-H and Jamba families, written by the
library: loaded, run through packed prefill and decode steps, and compared with the same model
built from the library's dequantized weights (logits equal to float32 rounding)."""

import json

import pytest
import torch

from mambaserve.loader import load_model
from mambaserve.ops.fp8 import FP8_DTYPE
from tests.conftest import rel_err
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.harness import Harness

pytest.importorskip("compressed_tensors")

CASES = [
    # per-tensor weights, static input scales; the router (a plain Linear) is quantized in the
    # checkpoint and dequantized at load; the shared expert is absorbed into the FP8 MoE
    ("granite-moe-absorbed", "FP8", ["lm_head"]),
    # per-channel weights, dynamic per-token activations; Mamba in_proj left in float32
    ("granite-moe", "FP8_DYNAMIC", ["lm_head", "re:.*mamba.in_proj$"]),
    ("granite-dense-rope", "FP8_DYNAMIC", ["lm_head"]),
    # Jamba: per-expert Linear layers stacked after loading, Mamba-1 dt_proj dequantized at load
    ("jamba", "FP8_DYNAMIC", ["lm_head", "re:.*router"]),
    ("jamba-moe-every-layer", "FP8", ["lm_head", "re:.*router", "re:.*x_proj"]),
]


def _run(model, prompts):
    h = Harness(model, len(prompts), max(len(p) for p in prompts) + 3)
    out = [h.step({i: p for i, p in enumerate(prompts)})]
    for step in range(3):
        out.append(h.step({i: [3 + step + i] for i in range(len(prompts))}))
    return torch.cat([torch.cat([o[i] for i in sorted(o)]) for o in out])


@pytest.mark.parametrize("name,preset,ignore", CASES)
def test_fp8_checkpoint_logits_equal_the_dequantized_model(name, preset, ignore):
    fp8_dir, deq_dir = write_fp8_checkpoint(name, preset, ignore)
    ours = load_model(fp8_dir)  # quantization detected from the checkpoint's quantization_config
    ref = load_model(deq_dir)
    fp8_params = [n for n, p in ours.named_parameters() if p.dtype == FP8_DTYPE]
    assert fp8_params and not any(p.dtype == FP8_DTYPE for p in ref.parameters())
    assert not any("lm_head" in n or "router" in n for n in fp8_params)
    if "re:.*mamba.in_proj$" in ignore:
        assert not any("in_proj" in n for n in fp8_params)
    g = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 11)]
    got, want = _run(ours, prompts), _run(ref, prompts)
    assert rel_err(got, want) < 1e-5


def test_explicit_compressed_tensors_and_kv_scales_load(tmp_path):
    fp8_dir, _ = write_fp8_checkpoint("granite-moe", "FP8_DYNAMIC", ["lm_head"], kv_scales=True)
    model = load_model(fp8_dir, quantization="compressed-tensors", kv_scales=True)
    attn = model.model.layers[1].self_attn
    assert 0.002 <= attn.kv_scales()[0] <= 0.012 and 0.002 <= attn.kv_scales()[1] <= 0.012
    plain = load_model(fp8_dir)  # the checkpoint's kv_cache_scheme alone also gives the layers their scales
    assert plain.model.layers[1].self_attn.kv_scales() == attn.kv_scales()


@pytest.mark.parametrize("edit,match", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"), "8-bit float"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "strategy 'block'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None), "weight-only"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "dynamic per token"),
    (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'"),
])
def test_unsupported_compressed_tensors_schemes_are_refused(edit, match):
    fp8_dir, _ = write_fp8_checkpoint("granite-dense-rope", "FP8_DYNAMIC", ["lm_head"])
    path = f"{fp8_dir}/config.json"
    cfg = json.load(open(path))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ValueError, match=match):
        load_model(fp8_dir)


def test_an_fp8_tensor_for_a_layer_the_config_leaves_alone_is_named():
    fp8_dir, _ = write_fp8_checkpoint("granite-dense-rope", "FP8_DYNAMIC", ["lm_head"])
    path = f"{fp8_dir}/config.json"
    cfg = json.load(open(path))
    cfg["quantization_config"]["ignore"].append("re:.*o_proj")
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ValueError, match="o_proj"):
        load_model(fp8_dir)


ONLINE_FAMILIES = ["granite-moe", "granite-moe-absorbed", "bamba", "mamba2-untied", "falcon-h1", "jamba", "zamba2",
                   "nemotron-h-moe", "mamba1"]


@pytest.mark.parametrize("name", ONLINE_FAMILIES)
def test_online_fp8_equals_the_model_of_its_rounded_weights(name, tmp_path):
    """quantization="fp8" on a float32 checkpoint equals the plain model loaded from a copy whose
    selected weights were rounded to FP8 per output row beforehand (the layers' FP8 path, the
    loader's quantization, and each family's finalize_weights on FP8 layers: Granite's absorbed
    shared expert, Jamba's stacked experts, Falcon-H1's folded multipliers)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mambaserve import ops
    from mambaserve.layers.quantization import prepare_fp8_modules, resolve_quantization
    from mambaserve.loader import load_config
    from mambaserve.models import get_model_class
    from tests.models.tiny import checkpoint

    src = checkpoint(name)
    config = load_config(src)
    with torch.device("meta"):
        selected = prepare_fp8_modules(get_model_class(config)(config), resolve_quantization(config, "fp8"))
    assert selected
    tensors = load_file(f"{src}/model.safetensors")
    for mod in selected:
        w = tensors[f"{mod}.weight"]
        q, s = ops.fp8.quantize_fp8_reference(w)
        tensors[f"{mod}.weight"] = q.float() * s
    shutil.copytree(src, tmp_path / "rounded")
    save_file(tensors, tmp_path / "rounded" / "model.safetensors")
    ours, ref = load_model(src, quantization="fp8"), load_model(str(tmp_path / "rounded"))
    assert any(p.dtype == FP8_DTYPE for p in ours.parameters())
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (2, 9)]
    assert rel_err(_run(ours, prompts), _run(ref, prompts)) < 1e-5
