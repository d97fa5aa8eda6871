"""Sparse mixtures of experts.

Granite: top-k softmax routing over SiLU-gated experts (Shazeer et al. 2017): the router's
logits are computed in float32, the top-k are kept and renormalised by a softmax over those k.
The experts run in `mambaserve.ops.fused_moe`. Parameter names follow the HF checkpoint:
`router.layer`, `input_linear` (E, 2I, H) and `output_linear` (E, H, I).

Sigmoid group-limited routing (DeepSeek-V3, arXiv 2412.19437, section 2.1.2; Nemotron-H's MoE
layers) over ungated experts down(act(up(x))): `SigmoidGroupRouter` and `UngatedExperts`, with
the checkpoint's per-expert names `experts.{e}.up_proj` / `experts.{e}.down_proj`. These
experts are plain PyTorch (one matrix product pair per routed expert): `ops.fused_moe` computes
SiLU-gated experts only.

Jamba: softmax routing over all experts, the top-k probabilities kept as they are (not
renormalised over the k: Jamba's `JambaTopKRouter`), `SoftmaxTopKRouter`; SiLU-gated experts
stored per expert in the checkpoint (`experts.{e}.gate_proj` / `up_proj` / `down_proj`) and
stacked once loaded into the fused MoE's layout (`SparseMoeBlock`).

Tensor parallelism splits the intermediate features of every expert (each rank holds its
slice of each expert's gate/up rows and down columns); routers are whole on every rank and,
reading the same replicated input, choose the same experts everywhere. Each rank's expert
sum is partial; a MoE block all-reduces it once, together with its shared expert's partial sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import ops
from mambaserve.distributed import all_reduce, current_group
from mambaserve.layers.activation import get_activation
from mambaserve.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard, even_range, set_shard

_WHAT = "the experts' intermediate size"


class _Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class _ExpertWeights(nn.Module):
    """Holds one stacked (num_experts, out, in) weight under the checkpoint's `.weight` name
    (FP8: with `weight_scale`, `layers.quantization`)."""

    expert_weights = True  # one linear per expert: a "Linear" target of a quantization config

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class GraniteMoE(nn.Module):
    """x: (num_tokens, hidden) -> (num_tokens, hidden).

    A shared expert (Granite's `shared_mlp`) whose size is a multiple of the experts' can be
    absorbed (`absorb_shared_expert`): it becomes n always-on extra experts of the same fused
    MoE, each taking an equal slice of its gate, up and down weights (silu(g) * u is per
    feature, so the slices sum to the shared expert exactly). One MoE then computes routed
    and shared experts: at decode, three kernels instead of two matrix products, an activation
    and an add beside the MoE's own.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = _Router(hidden_size, num_experts)
        tp = self.tp_group = current_group()
        I = intermediate_size
        i0, i1 = even_range(I, tp, _WHAT)
        self.input_linear = _ExpertWeights(num_experts, 2 * (i1 - i0), hidden_size)
        self.output_linear = _ExpertWeights(num_experts, hidden_size, i1 - i0)
        set_shard(self.input_linear, "weight", Shard(1, 2 * I, ((i0, i1), (I + i0, I + i1))), tp)  # [gate; up]
        set_shard(self.output_linear, "weight", Shard(2, I, ((i0, i1),)), tp)
        self.num_shared = 0  # extra always-on experts holding an absorbed shared expert

    @torch.no_grad()
    def absorb_shared_expert(self, shared: nn.Module) -> bool:
        """Move a FusedGatedMLP (input_linear (2S, H) = [gate; up], output_linear (H, S)) into
        extra experts when S is a multiple of the expert size I: S / I experts, appended to the
        stacked weights, which then hold E + S / I experts (one tensor each, so `.to()` and the
        memory count see them whole; the router still picks among the first E). Returns False
        (and changes nothing) when the sizes don't fit or a shared expert is already absorbed."""
        if self.num_shared:
            return False
        w1, w2 = self.input_linear.weight, self.output_linear.weight
        E, two_i, H = w1.shape
        inter = two_i // 2
        s_in, s_out = shared.input_linear.weight, shared.output_linear.weight
        S = s_in.shape[0] // 2
        if S == 0 or S % inter or s_in.shape[1] != H or s_out.shape != (H, S) or s_in.dtype != w1.dtype \
                or s_out.dtype != w2.dtype:
            return False
        fp8 = getattr(self.input_linear, "fp8_scheme", None) is not None
        if fp8:  # per-row scales (widened after loading) go with their rows
            sc1, sc2 = self.input_linear.weight_scale, self.output_linear.weight_scale  # (E, 2I), (E, H)
            sh1, sh2 = shared.input_linear.weight_scale, shared.output_linear.weight_scale  # (2S,), (H,)
            sc1_all = torch.cat([sc1, torch.cat([sh1[:S].view(-1, inter), sh1[S:].view(-1, inter)], 1)])
            sc2_all = torch.cat([sc2, sh2.expand(S // inter, H)])
        n = S // inter
        w1_all = torch.empty(E + n, two_i, H, dtype=w1.dtype, device=w1.device)
        w2_all = torch.empty(E + n, H, inter, dtype=w2.dtype, device=w2.device)
        w1_all[:E], w2_all[:E] = w1, w2
        for j in range(n):
            rows = slice(j * inter, (j + 1) * inter)
            w1_all[E + j, :inter] = s_in[:S][rows]  # gate slice
            w1_all[E + j, inter:] = s_in[S:][rows]  # up slice
            w2_all[E + j] = s_out[:, rows]
        self.input_linear.weight = nn.Parameter(w1_all, requires_grad=False)
        self.output_linear.weight = nn.Parameter(w2_all, requires_grad=False)
        if fp8:
            self.input_linear.weight_scale = nn.Parameter(sc1_all.contiguous(), requires_grad=False)
            self.output_linear.weight_scale = nn.Parameter(sc2_all.contiguous(), requires_grad=False)
        self.num_shared = n
        return True

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None, partials: bool = False) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden); add (T, hidden), e.g. the shared expert's output, is
        added inside the MoE's last kernel. partials=True returns (num_parts, T, hidden) terms
        summing to the output, for `RMSNorm.add_and_norm` to add (see ops.fused_moe). Under
        tensor parallelism `add` is the shared expert's partial sum, added before the one
        all-reduce of the output (which is then (T, hidden))."""
        # (T, top_k + num_shared) each: the absorbed shared expert's slices are always on
        top_weights, top_ids = ops.router_topk(x, self.router.layer.weight, self.top_k, x.dtype, self.num_shared)
        scales = dict(w1_scale=getattr(self.input_linear, "weight_scale", None),
                      w2_scale=getattr(self.output_linear, "weight_scale", None))
        if self.tp_group.world_size > 1:
            out = ops.fused_moe(x, self.input_linear.weight, self.output_linear.weight, top_weights, top_ids, add,
                                **scales)
            return all_reduce(out, self.tp_group)
        return ops.fused_moe(x, self.input_linear.weight, self.output_linear.weight, top_weights, top_ids, add,
                             as_partials=partials, **scales)


class SigmoidGroupRouter(nn.Module):
    """DeepSeek-V3 routing. x: (num_tokens, hidden) -> weights (num_tokens, top_k) float32, ids
    (num_tokens, top_k) int64.

    s = sigmoid(x W^T) in float32; choosing uses s + e_score_correction_bias, restricted to the
    topk_group expert groups (of n_group) whose two best biased scores sum highest; the weights
    are the unbiased s of the chosen experts, divided by their sum when norm_topk_prob, times
    routed_scaling_factor. HF names: `weight` (E, hidden), `e_score_correction_bias` (E,).
    """

    float32_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        if num_experts % n_group or topk_group > n_group:
            raise ValueError(f"{num_experts} experts don't split into n_group={n_group} groups of which "
                             f"topk_group={topk_group} are kept")
        if top_k > num_experts // n_group * topk_group:
            raise ValueError(f"top_k={top_k} exceeds the experts of the {topk_group} kept groups")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, E = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)  # (T, n_group)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
        ids = choice.topk(self.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class _Expert(nn.Module):
    def __init__(self, size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = ColumnParallelLinear(size, intermediate_size, bias=False, what=_WHAT)
        self.down_proj = RowParallelLinear(intermediate_size, size, bias=False, reduce_results=False, what=_WHAT)


class UngatedExperts(nn.ModuleList):
    """out[t] = sum_k weights[t, k] * down_e(act(up_e(x_t))), e = ids[t, k], summed in float32.

    x: (num_tokens, size); weights, ids: (num_tokens, top_k) -> (num_tokens, size) in x.dtype.
    A list of experts, so the names are the checkpoint's `{e}.up_proj` / `{e}.down_proj`.
    Under tensor parallelism the output is the rank's partial sum (the caller all-reduces).
    Eager: the (token, k) pairs are sorted by expert and each routed expert runs once on its
    rows (this reads the per-expert counts on the host). While a CUDA graph is being captured no
    host read is allowed, so every expert runs on every token and its rows are selected: the
    same result for num_experts / top_k times the work.
    """

    def __init__(self, size: int, intermediate_size: int, num_experts: int, activation: str):
        super().__init__(_Expert(size, intermediate_size) for _ in range(num_experts))
        self.act = get_activation(activation)

    def _run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ex = self[e]
        return ex.down_proj(self.act(ex.up_proj(x)))

    def _per_pair_sorted(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # (T * k,) pairs in expert order
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        xs = x[order // k]  # (T * k, size)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._run(e, xs[start : start + n])
                start += n
        y = torch.empty_like(ys)
        y[order] = ys  # back to (token, k) order
        return y.view(T, k, -1)

    def _per_pair_dense(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = x.new_zeros(ids.shape[0], ids.shape[1], x.shape[1])  # (T, k, size)
        for e in range(len(self)):
            y = torch.where((ids == e)[..., None], self._run(e, x)[:, None, :], y)
        return y

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        y = self._per_pair_dense(x, ids) if capturing else self._per_pair_sorted(x, ids)
        return (y.float() * weights.float()[..., None]).sum(1).to(x.dtype)


class SoftmaxTopKRouter(nn.Module):
    """Jamba's routing (Lieber et al. 2024, arXiv 2403.19887; transformers' `JambaTopKRouter`).

    x: (num_tokens, hidden) -> weights (num_tokens, top_k) in x.dtype, ids (num_tokens, top_k)
    integer, largest first. p = softmax(x W^T) over all experts, in float32 (the logits in x's
    dtype, as the checkpoint's Linear computes them); the weights are the top_k entries of p,
    not renormalised over the k (`ops.router_topk(..., renormalize=False)`; Granite's
    renormalised weights differ by the factor sum of the chosen p). HF name: `weight` (E, hidden).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.router_topk(x, self.weight, self.top_k, x.dtype, renormalize=False)


class _GatedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=False, what=_WHAT)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=False, what=_WHAT)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, reduce_results=False,
                                           what=_WHAT)


class _StackedExperts(nn.Module):
    """The fused layout (transformers' in-memory names): gate_up_proj (E, 2I, H) = [gate; up]
    per expert, down_proj (E, H, I); FP8 weights with per-row float32 scales gate_up_proj_scale
    (E, 2I) and down_proj_scale (E, H), else None."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.gate_up_proj_scale = self.down_proj_scale = None
        if gate_up_scale is not None:
            self.gate_up_proj_scale = nn.Parameter(gate_up_scale, requires_grad=False)
            self.down_proj_scale = nn.Parameter(down_scale, requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Top-k routed SiLU-gated experts (Jamba's `feed_forward` on its MoE layers).

    x: (num_tokens, hidden) -> (num_tokens, hidden); out[t] = sum_k w[t, k] *
    down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k], with (w, ids) from
    `SoftmaxTopKRouter`. The checkpoint holds each expert apart (`experts.{e}.gate_proj`,
    `up_proj`, `down_proj`); `stack_experts()` (the model's finalize_weights, once the weights are
    in) moves them into one (E, 2I, H) and one (E, H, I) tensor for `ops.fused_moe`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.router = SoftmaxTopKRouter(hidden_size, num_experts, top_k)
        self.experts: nn.Module = nn.ModuleList(
            _GatedExpert(hidden_size, intermediate_size) for _ in range(num_experts))
        self.tp_group = current_group()

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Per-expert weights -> the fused layout, expert by expert into preallocated tensors (peak
        memory: one layer's experts twice). Does nothing when already stacked."""
        if isinstance(self.experts, _StackedExperts):
            return
        first = self.experts[0]
        inter, hidden = first.gate_proj.weight.shape
        E = len(self.experts)
        w = first.gate_proj.weight
        w1 = torch.empty(E, 2 * inter, hidden, dtype=w.dtype, device=w.device)
        w2 = torch.empty(E, hidden, inter, dtype=w.dtype, device=w.device)
        for e, ex in enumerate(self.experts):
            w1[e, :inter], w1[e, inter:], w2[e] = ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight
        s1 = s2 = None
        if getattr(first.gate_proj, "fp8_scheme", None) is not None:  # per-row scales, widened after loading
            s1 = torch.stack([torch.cat([ex.gate_proj.weight_scale, ex.up_proj.weight_scale]) for ex in self.experts])
            s2 = torch.stack([ex.down_proj.weight_scale for ex in self.experts])
        self.experts = _StackedExperts(w1, w2, s1, s2)

    def forward(self, x: torch.Tensor, partials: bool = False) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden); partials=True returns (num_parts, T, hidden) terms
        summing to the output, for `RMSNorm.add_and_norm` (see ops.fused_moe); under tensor
        parallelism the output is all-reduced, (T, hidden)."""
        assert isinstance(self.experts, _StackedExperts), "stack_experts() runs once the weights are loaded"
        weights, ids = self.router(x)
        ex = self.experts
        scales = dict(w1_scale=ex.gate_up_proj_scale, w2_scale=ex.down_proj_scale)
        if self.tp_group.world_size > 1:
            out = ops.fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids, **scales)
            return all_reduce(out, self.tp_group)
        return ops.fused_moe(x, ex.gate_up_proj, ex.down_proj, weights, ids, as_partials=partials, **scales)
