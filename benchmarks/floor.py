"""The hardware floor of an engine step: the bytes that must move and the FLOPs that must run.

A step is a set of sequences, each bringing `new` tokens on top of `context` tokens already in
its caches (a decode: new 1; a first prefill chunk: context 0). Its floor, on a GPU of copy
bandwidth `bw` (bytes/s) and matrix rate `rate` (FLOP/s), is max(bytes / bw, flops / rate),
where
- bytes: every weight the step uses read once (embeddings: only the rows of its tokens; a MoE
  layer's experts: only those its tokens can hit, see `expected_experts`), every Mamba conv and
  SSM state of the batch read once (when it has a context) and written once, every cached K and
  V read once and the new tokens' K and V written once. Activations are left out: a fully fused
  step keeps them on chip, so they are not part of what must move.
- FLOPs: the matrix products: 2 * (weights used per token) per token (each token's top_k
  experts), lm_head for one row per sequence (the logits a step samples from), attention's
  QK^T and PV over the causal context (4 * heads * head_dim per (query, key) pair), and the
  SSD algorithm's products (Dao & Gu 2024, section 6: per chunk of c tokens, C B^T over the
  causal c (c + 1) / 2 pairs per group and its product with x per head; the chunk states
  B^T x and their readout C h, 2 * head_dim * d_state each per token and head) or, for a
  decode, the one-step recurrence (h = dA h + dt x B^T and y = h C: 4 * head_dim * d_state
  per head).
Both are split by kernel group (`GROUPS`: the group whose kernels do that work), so that a
profiled step's time per group can be set against its own floor.

`model_shape(model)` reads what the floor needs from a built model (the meta device is enough:
no weights are read): the parameters by group, each Mamba2 mixer, attention layer and MoE
layer. `step_cost(shape, step)` is pure arithmetic on that (unit-tested on the CPU against
figures worked out by hand). The profiler (`profile_step.py`) measures bw and rate on the GPU
and sets the floor beside the measured kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# kernel groups of a step, in the order the table prints them
GROUPS = ("norm", "gemv/gemm", "moe", "conv", "scan", "state update", "attention", "other")


@dataclass(frozen=True)
class MambaLayer:
    """One Mamba2 mixer: its state's shapes and element sizes (bytes)."""

    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_dim: int
    conv_kernel: int
    chunk_size: int
    conv_itemsize: int
    ssm_itemsize: int

    @property
    def conv_state_bytes(self) -> int:
        return (self.conv_kernel - 1) * self.conv_dim * self.conv_itemsize

    @property
    def ssm_state_bytes(self) -> int:
        return self.num_heads * self.head_dim * self.d_state * self.ssm_itemsize


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer (one KV cache): heads, KV heads, head size, KV element size (bytes)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_itemsize: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_itemsize


@dataclass(frozen=True)
class MoELayer:
    """One routed MoE layer: num_experts routed experts of which each token takes top_k, each
    expert expert_params parameters (expert_bytes bytes); always-on experts (a shared expert
    stored as experts) count as dense weights, not here."""

    num_experts: int
    top_k: int
    expert_params: int
    expert_bytes: int


@dataclass
class ModelShape:
    """What the floor needs of a model. weight_bytes / matmul_params: the always-read weights
    by group (bytes) and the parameters of those that multiply every token (matrices: not norms,
    conv taps or per-head scalars); lm_head_* the output projection (one row of logits per
    sequence), embed_row_bytes one embedding row."""

    hidden_size: int
    vocab_size: int
    weight_bytes: dict[str, int] = field(default_factory=dict)
    matmul_params: dict[str, int] = field(default_factory=dict)
    lm_head_params: int = 0
    lm_head_bytes: int = 0
    embed_row_bytes: int = 0
    mamba: list[MambaLayer] = field(default_factory=list)
    attention: list[AttentionLayer] = field(default_factory=list)
    moe: list[MoELayer] = field(default_factory=list)

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies (lm_head and the embedding lookup left out)."""
        return sum(self.matmul_params.values()) + sum(m.top_k * m.expert_params for m in self.moe)


@dataclass(frozen=True)
class Step:
    """One engine step: (new tokens, context tokens before them) per sequence."""

    seqs: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.seqs)

    @staticmethod
    def decode(batch: int, context: int) -> Step:
        """batch sequences decoding one token each, context tokens already in their caches."""
        return Step(((1, context),) * batch)

    @staticmethod
    def prefill(tokens: int, context: int = 0) -> Step:
        """One prompt chunk of `tokens` tokens after `context` cached ones."""
        return Step(((tokens, context),))

    @staticmethod
    def mixed(decodes: int, context: int, prompt: int) -> Step:
        """decodes decoding sequences at `context` plus one new prompt of `prompt` tokens."""
        return Step(((1, context),) * decodes + ((prompt, 0),))


def prefill_steps(tokens: int, chunk: int) -> list[Step]:
    """A prompt of `tokens` tokens as the engine runs it: chunks of at most `chunk` tokens."""
    if tokens < 1 or chunk < 1:
        raise ValueError(f"tokens ({tokens}) and chunk ({chunk}) must be positive")
    return [Step.prefill(min(chunk, tokens - c), c) for c in range(0, tokens, chunk)]


def expected_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected number of distinct experts hit by num_tokens tokens each routed to top_k distinct
    experts of num_experts uniformly: E (1 - (1 - k / E)^T). top_k at one token, at most
    min(E, T k), E as T grows (random dummy weights route about uniformly; a trained router is
    skewed, which only lowers this)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _ssd_flops(layer: MambaLayer, new: int, context: int) -> float:
    """The SSD products of one sequence's `new` tokens (chunks aligned at its first new token)."""
    H, P, N, G, Q = layer.num_heads, layer.head_dim, layer.d_state, layer.n_groups, layer.chunk_size
    pairs = 0
    for c0 in range(0, new, Q):
        c = min(Q, new - c0)
        pairs += c * (c + 1) // 2
    return 2.0 * pairs * (G * N + H * P) + 4.0 * new * H * P * N


@dataclass
class StepCost:
    """bytes and flops of a step, by kernel group (`GROUPS`)."""

    bytes: dict[str, float]
    flops: dict[str, float]

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def floor_s(self, bandwidth: float, rate: float) -> float:
        """max(bytes / bandwidth, flops / rate), seconds; bandwidth in bytes/s, rate in FLOP/s."""
        return max(self.total_bytes / bandwidth, self.total_flops / rate)

    def group_floor_s(self, bandwidth: float, rate: float) -> dict[str, float]:
        """Each group's own floor, seconds (their sum may exceed the step's: a group's bytes and
        another's FLOPs could overlap)."""
        return {g: max(self.bytes[g] / bandwidth, self.flops[g] / rate) for g in GROUPS}

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost({g: self.bytes[g] + other.bytes[g] for g in GROUPS},
                        {g: self.flops[g] + other.flops[g] for g in GROUPS})


def step_cost(shape: ModelShape, step: Step) -> StepCost:
    """The floor's bytes and FLOPs of one step of the model (see the module docstring).

    Raises ValueError for a step with no sequence or a sequence with new < 1 or context < 0.
    """
    if not step.seqs or any(n < 1 or c < 0 for n, c in step.seqs):
        raise ValueError(f"a step needs sequences of new >= 1 and context >= 0 tokens, got {step.seqs}")
    b = dict.fromkeys(GROUPS, 0.0)
    f = dict.fromkeys(GROUPS, 0.0)
    T, S = step.num_tokens, len(step.seqs)
    for g, n in shape.weight_bytes.items():
        b[g] += n
    for g, n in shape.matmul_params.items():
        f[g] += 2.0 * n * T
    b["gemv/gemm"] += shape.lm_head_bytes
    f["gemv/gemm"] += 2.0 * shape.lm_head_params * S
    b["other"] += shape.embed_row_bytes * T
    for m in shape.moe:
        b["moe"] += expected_experts(m.num_experts, m.top_k, T) * m.expert_bytes
        f["moe"] += 2.0 * m.top_k * m.expert_params * T
    for layer in shape.mamba:
        for new, ctx in step.seqs:
            touches = 2 if ctx > 0 else 1  # a fresh sequence's state is written, not read
            b["conv"] += touches * layer.conv_state_bytes
            f["conv"] += 2.0 * new * layer.conv_dim * layer.conv_kernel
            if new == 1 and ctx > 0:
                b["state update"] += touches * layer.ssm_state_bytes
                f["state update"] += 4.0 * layer.num_heads * layer.head_dim * layer.d_state
            else:
                b["scan"] += touches * layer.ssm_state_bytes
                f["scan"] += _ssd_flops(layer, new, ctx)
    for layer in shape.attention:
        for new, ctx in step.seqs:
            b["attention"] += (ctx + new) * layer.kv_bytes_per_token  # the context read, the new ones written
            pairs = new * ctx + new * (new + 1) // 2  # (query, key) pairs under the causal mask
            f["attention"] += 4.0 * layer.num_heads * layer.head_dim * pairs
    return StepCost(b, f)


def steps_cost(shape: ModelShape, steps: list[Step]) -> StepCost:
    """The summed cost of several steps (a chunked prefill: weights read once per chunk)."""
    total = step_cost(shape, steps[0])
    for s in steps[1:]:
        total = total + step_cost(shape, s)
    return total


def _param_group(name: str) -> str:
    """The kernel group that reads an always-read parameter, by its (HF) name."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return "norm"
    if "conv1d" in name:
        return "conv"
    if leaf in ("A_log", "D", "dt_bias"):
        return "state update"
    if "router" in name:
        return "moe"
    return "gemv/gemm"


def _is_scale(t: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether t, among an MoE's expert tensors, is an FP8 weight's scale (float32, one dimension
    short of the FP8 weights), not a weight that multiplies."""
    fp8 = [w for w in tensors if w.dtype == torch.float8_e4m3fn]
    return bool(fp8) and t.dtype == torch.float32 and t.dim() < fp8[0].dim()


def model_shape(model: torch.nn.Module, conv_itemsize: int | None = None, ssm_itemsize: int | None = None,
                kv_itemsize: int | None = None) -> ModelShape:
    """The floor's view of a built model (parameters on any device; meta is enough).

    Walks the Mamba2 mixers, attention layers and routed MoE layers (Granite's `GraniteMoE`,
    Jamba's `SparseMoeBlock`); every other parameter is an always-read weight, grouped by name
    (`_param_group`). Bytes are the parameters' own: an FP8 weight 1 per element, plus its
    float32 scales (not counted as matrix parameters). State and KV element sizes default to
    the model dtype's (the embedding's: never quantized).
    Raises ValueError for a model with a layer the floor does not model (Mamba-1 mixers,
    ungated per-expert MoEs, blocks shared by several depths), rather than a floor that leaves
    their bytes or FLOPs out.
    """
    from mambaserve.layers.attention import Attention
    from mambaserve.layers.mamba1 import MambaMixer as Mamba1Mixer
    from mambaserve.layers.mamba2 import Mamba2Mixer
    from mambaserve.layers.moe import GraniteMoE, SparseMoeBlock, UngatedExperts

    lm_head = model.lm_head.weight
    emb = next(m for n, m in model.named_modules() if n.endswith(("embed_tokens", "embeddings"))).weight
    item = emb.element_size()  # the model dtype's, also where FP8 weights are 1 byte
    shape = ModelShape(hidden_size=lm_head.shape[1], vocab_size=lm_head.shape[0])
    shape.weight_bytes = dict.fromkeys(GROUPS, 0)
    shape.matmul_params = dict.fromkeys(GROUPS, 0)
    expert_params: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, (Mamba1Mixer, UngatedExperts)):
            raise ValueError(f"the floor does not model {type(mod).__name__} layers")
        if isinstance(mod, Mamba2Mixer):
            shape.mamba.append(MambaLayer(mod.num_heads, mod.head_dim, mod.d_state, mod.n_groups, mod.conv_dim,
                                          mod.conv_kernel, mod.chunk_size, conv_itemsize or item,
                                          ssm_itemsize or item))
        elif isinstance(mod, Attention):
            if len(mod.cache_indices) > 1:
                raise ValueError("the floor does not model shared blocks (Zamba2's: weights used at several depths)")
            shape.attention.append(AttentionLayer(mod.num_heads, mod.num_kv_heads, mod.head_dim, kv_itemsize or item))
        elif isinstance(mod, (GraniteMoE, SparseMoeBlock)):
            if isinstance(mod, GraniteMoE):
                E, k = mod.router.layer.weight.shape[0], mod.top_k
                tensors = [p for lin in (mod.input_linear, mod.output_linear) for p in lin.parameters()]
                stored = mod.input_linear.weight.shape[0]  # E routed + num_shared always-on experts
            else:
                E, k = mod.router.weight.shape[0], mod.router.top_k
                tensors = list(mod.experts.parameters())
                stored = E
            # FP8 experts: their weights 1 byte an element and their per-row scales read too
            per_expert = sum(t.numel() for t in tensors if not _is_scale(t, tensors)) // stored
            per_bytes = sum(t.numel() * t.element_size() for t in tensors) // stored
            shape.moe.append(MoELayer(E, k, per_expert, per_bytes))
            shared = stored - E  # absorbed shared-expert slices: always read, always multiplied
            shape.weight_bytes["moe"] += shared * per_bytes
            shape.matmul_params["moe"] += shared * per_expert
            expert_params.update(id(t) for t in tensors)
    shape.embed_row_bytes = emb.shape[1] * emb.element_size()
    shape.lm_head_params, shape.lm_head_bytes = lm_head.numel(), lm_head.numel() * lm_head.element_size()
    seen = {id(lm_head), id(emb)} | expert_params
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        group = _param_group(name)
        shape.weight_bytes[group] += p.numel() * p.element_size()
        if p.dim() >= 2 and group in ("gemv/gemm", "moe") and not name.endswith("_scale"):
            shape.matmul_params[group] += p.numel()
    return shape


def shape_of_config(model: str, dtype: torch.dtype = torch.bfloat16, ssm_dtype: torch.dtype | None = None,
                    quantization: str | None = None) -> ModelShape:
    """`model_shape` of a config file or checkpoint directory, the model built on the meta device
    (no memory, no weights read). ssm_dtype: the SSM state's (None: the model's, as the engine's
    mamba_ssm_cache_dtype "auto" for most families); quantization: the engine's ("fp8": the
    layers it selects with FP8 weights and per-row scales, as after loading)."""
    from mambaserve.layers.quantization import resolve_quantization, widen_scales
    from mambaserve.loader import build_model, load_config

    config = load_config(model)
    net = build_model(config, dtype, "meta", quantization=resolve_quantization(config, quantization))
    widen_scales(net)
    if hasattr(net, "finalize_weights"):
        net.finalize_weights()  # the layout the engine runs (Granite's shared expert inside its MoE)
    ssm = ssm_dtype or getattr(net, "default_mamba_ssm_cache_dtype", None)
    if isinstance(ssm, str):
        ssm = getattr(torch, ssm)
    return model_shape(net, ssm_itemsize=torch.empty((), dtype=ssm).element_size() if ssm else None)


# (substring of a lower-cased kernel name, group), first match wins: MoE's grouped GEMMs before
# the plain GEMMs, attention's split combine before the MoE combine
_KERNEL_GROUPS = (
    ("combine_splits", "attention"), ("paged_attention", "attention"), ("reshape_and_cache", "attention"),
    ("flash", "attention"), ("attention", "attention"),
    ("state_update", "state update"), ("conv1d", "conv"),
    ("_chunk_", "scan"), ("state_passing", "scan"), ("ssd", "scan"), ("_bmm", "scan"),
    ("moe", "moe"), ("direct_gate_up", "moe"), ("direct_down", "moe"), ("grouped", "moe"), ("groupproblem", "moe"),
    ("_combine_kernel", "moe"), ("silu_mul", "moe"), ("router", "moe"), ("topk", "moe"), ("radix", "moe"),
    ("searchsorted", "moe"), ("gather", "moe"), ("index_put", "moe"),
    ("gemv", "gemv/gemm"), ("linear_partials", "gemv/gemm"), ("sum_splits", "gemv/gemm"),
    ("quantize_rows", "gemv/gemm"), ("scaled_mm", "gemv/gemm"), ("gemm", "gemv/gemm"), ("nvjet", "gemv/gemm"),
    ("cutlass", "gemv/gemm"), ("cublas", "gemv/gemm"), ("xmma", "gemv/gemm"), ("splitk", "gemv/gemm"),
    ("norm", "norm"),
)


def kernel_group(name: str) -> str:
    """The group (`GROUPS`) of a CUDA kernel, by its name as the profiler reports it: our Triton
    kernels' names, cuBLAS's (nvjet, cutlass) and PyTorch's own; "other" for the rest (copies,
    memsets, elementwise ops, the sampler's arg-max)."""
    low = name.lower()
    for key, group in _KERNEL_GROUPS:
        if key in low:
            return group
    return "other"


def grouped_us(kernels: dict[str, float]) -> dict[str, float]:
    """Kernel name -> time (us) summed into groups (every group present, 0 when absent)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for name, t in kernels.items():
        out[kernel_group(name)] += t
    return out


def packed_prefill_steps(batch: int, tokens: int, budget: int) -> list[Step]:
    """batch prompts of `tokens` tokens each as the scheduler packs them: steps of at most
    `budget` tokens, prompts in order, a prompt cut where a step fills (chunked prefill)."""
    if batch < 1 or tokens < 1 or budget < 1:
        raise ValueError(f"batch ({batch}), tokens ({tokens}) and budget ({budget}) must be positive")
    steps, seqs, room = [], [], budget
    for _ in range(batch):
        done = 0
        while done < tokens:
            n = min(room, tokens - done)
            seqs.append((n, done))
            done += n
            room -= n
            if room == 0:
                steps.append(Step(tuple(seqs)))
                seqs, room = [], budget
    if seqs:
        steps.append(Step(tuple(seqs)))
    return steps


def table_rows(cost: StepCost, bandwidth: float, rate: float, measured_us: dict[str, float] | None = None
               ) -> list[dict]:
    """Per group: bytes, FLOPs, floor (us) and, with measured kernel time per group (us), the
    measured time, its excess over the group's floor and its share of the step's gap (the
    measured total minus the step's floor). One row per group, then a "total" row."""
    floors = cost.group_floor_s(bandwidth, rate)
    step_floor_us = cost.floor_s(bandwidth, rate) * 1e6
    measured_total = sum(measured_us.values()) if measured_us else None
    gap = (measured_total - step_floor_us) if measured_us else None
    rows = []
    for g in GROUPS:
        row = {"group": g, "bytes": cost.bytes[g], "flops": cost.flops[g], "floor_us": floors[g] * 1e6}
        if measured_us is not None:
            t = measured_us.get(g, 0.0)
            row.update(measured_us=t, excess_us=t - row["floor_us"],
                       gap_share=(t - row["floor_us"]) / gap if gap and gap > 0 else math.nan)
        rows.append(row)
    total = {"group": "total", "bytes": cost.total_bytes, "flops": cost.total_flops, "floor_us": step_floor_us,
             "bytes_floor_us": cost.total_bytes / bandwidth * 1e6, "flops_floor_us": cost.total_flops / rate * 1e6}
    if measured_us is not None:
        total.update(measured_us=measured_total, excess_us=gap, gap_share=1.0 if gap and gap > 0 else math.nan)
    rows.append(total)
    return rows


def format_table(title: str, rows: list[dict]) -> str:
    """The rows of `table_rows` as an aligned text table."""
    measured = "measured_us" in rows[0]
    head = f"{'group':13s} {'MB':>10s} {'GFLOP':>10s} {'floor us':>10s}"
    if measured:
        head += f" {'kernel us':>10s} {'excess us':>10s} {'of gap':>7s}"
    lines = [title, head]
    for r in rows:
        line = f"{r['group']:13s} {r['bytes'] / 1e6:10.2f} {r['flops'] / 1e9:10.2f} {r['floor_us']:10.1f}"
        if measured:
            share = r["gap_share"]
            line += f" {r['measured_us']:10.1f} {r['excess_us']:10.1f} {share:7.1%}" if share == share else \
                f" {r['measured_us']:10.1f} {r['excess_us']:10.1f} {'-':>7s}"
        lines.append(line)
    t = rows[-1]
    lines.append(f"{'':13s} floor = max(bytes {t['bytes_floor_us']:.1f} us, FLOPs {t['flops_floor_us']:.1f} us)")
    return "\n".join(lines)
