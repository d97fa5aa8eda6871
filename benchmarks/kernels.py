"""GPU timings of mambaserve's Triton kernels at real model shapes, against the memory floor.

Each case is a name, a callable that runs one op call on inputs built in advance, the minimum
bytes the call must move through device memory (each input read once, each output written once)
and the FLOPs it must do. For each case the script prints and records:
  - gpu_us: device time of one call: the call is captured in a CUDA graph and the graph is
    replayed between CUDA events, with the L2 cache flushed (a 256 MiB write) before every
    replay; median over the replays. Host work is not included; the graph launch (a few us on
    this machine) is.
  - kernel_us: the sum of the call's kernel durations from the torch profiler, L2 flushed
    before each call: no launch overheads (what the call costs inside the engine's graphs).
  - host_us: host time to issue one eager call (Python, argument checks, launches), with the
    step's launch plans already built (in a ForwardContext) as the engine has them for every
    layer after the first.
  - GB/s and the fraction of the copy bandwidth measured in the same run (a 1 GiB
    device-to-device copy, bytes read plus written, at the start and at the end: the larger
    is used), and TFLOP/s and its fraction of the bf16 matrix rate measured in the same run
    (an 8192^3 torch.mm), from the smaller of gpu_us and kernel_us.

Shapes: the Mamba2 layer of granite-4.0-tiny-preview (benchmarks/configs/granite-4.0-tiny-preview.json:
hidden 1536, expand 2 -> d_inner 3072, 48 heads x 64, d_state 128, 1 group, conv width 4,
chunk 256), bfloat16 activations, float32 SSM state pool, bfloat16 conv state pool, inputs as
views of an in_proj-shaped output. Batches: one 31,500-token prefill; 8 x 2,048-token
prefills; 4 x 1,024-token prefills mixed with 60 decodes; decode batches of 1, 8, 64, 256.
Mamba-1 (mamba-130m: d_inner 1536, d_state 16, dt rank 48): the selective scan on a 2,048-token
prefill and on 4 x 512 prefills beside 60 decodes, and its decode update at batches 1, 64, 256.
FP8 linear layers at 1 and 8 rows (`FP8_LINEARS`: granite-4.0-tiny-preview's projections and a
16384 x 8192 one), beside F.linear with the same weight in bf16.

Extending: write a function that returns a list of `Case` and decorate it with `@register`
(cases of other ops, e.g. attention or MoE, belong here too). `--sweep` times alternative
launch configs of the kernels (on scratch state, never on live state) to tune the fixed configs;
the conv1d kernels' per-GPU table is tuned by benchmarks/tune_conv1d.py, the SSD scan's configs
by benchmarks/tune_ssd.py instead.

Usage: python3 benchmarks/kernels.py [--output-json PATH] [--only SUBSTRING] [--sweep]
Needs a CUDA GPU. Writes JSON to PATH (default: kernels-<gpu>.json in the current folder); the
results go to benchmarks/results/<gpu>/kernels/ (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mambaserve import ops  # noqa: E402
from mambaserve.forward_context import ForwardContext  # noqa: E402
from mambaserve.ops import conv1d as conv1d_mod  # noqa: E402
from mambaserve.ops import mamba1_scan as mamba1_scan_mod  # noqa: E402
from mambaserve.ops import state_update as state_update_mod  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


@dataclass
class Case:
    """One timed op call. fn runs the call on prepared inputs and returns its output."""

    name: str
    group: str
    fn: Callable[[], object]
    bytes: int
    flops: int = 0
    target_us: float | None = None  # our target for this case, if any
    baseline_us: float | None = None  # vLLM 0.33's Triton kernel on the H200 at the same shapes
    note: str = ""
    extra: dict = field(default_factory=dict)


CASE_BUILDERS: list[Callable[[], list[Case]]] = []


def register(builder: Callable[[], list[Case]]) -> Callable[[], list[Case]]:
    CASE_BUILDERS.append(builder)
    return builder


# --- timing --------------------------------------------------------------------------------

_FLUSH: torch.Tensor | None = None


def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    _FLUSH.zero_()


def gpu_time_us(fn: Callable[[], object], replays: int = 40, flush: bool = True) -> float:
    """Median device time of one call in microseconds (CUDA graph replay, L2 flushed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile (and build the plans, the first time) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        if flush:
            _flush_l2()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def host_time_us(fn: Callable[[], object], calls: int = 30) -> float:
    """Host time to issue one eager call (the device may still be running when it returns)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def kernel_time_us(fn: Callable[[], object], iters: int = 10) -> tuple[float, dict[str, float]]:
    """Device time of one call as the sum of its kernels' durations (torch profiler), L2
    flushed before each call; no launch or graph overheads. Also per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _flush_l2()
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for evt in prof.key_averages():
        name = evt.key
        if "FillFunctor" in name or "Buffer" in name or name.startswith(("Memset", "Memcpy")) or evt.count == 0:
            continue  # the L2 flush and profiler bookkeeping
        avg = getattr(evt, "device_time", None)
        if avg is None:
            avg = getattr(evt, "cuda_time", 0.0)
        if avg:
            per_kernel[name] = avg * evt.count / iters
    return sum(per_kernel.values()), per_kernel


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written, after half a
    second of copies to bring the clocks up."""
    src = torch.randn(2**28, device=DEV)  # 1 GiB of float32
    dst = torch.empty_like(src)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
    us = gpu_time_us(lambda: dst.copy_(src), replays=30, flush=False)
    return 2 * 2**30 / (us * 1e-6) / 1e9


def matmul_tflops() -> float:
    """bf16 matrix rate: an 8192^3 torch.mm (cuBLAS), after half a second of them to bring the
    clocks up; the denominator of each case's FLOP fraction."""
    a = torch.randn(8192, 8192, device=DEV).to(BF16)
    b = torch.randn(8192, 8192, device=DEV).to(BF16)
    c = torch.empty(8192, 8192, device=DEV, dtype=BF16)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        torch.mm(a, b, out=c)
        torch.cuda.synchronize()
    us = gpu_time_us(lambda: torch.mm(a, b, out=c), replays=10, flush=False)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


# --- the granite-4.0-tiny-preview Mamba2 layer ---------------------------------------------

D_INNER, NHEADS, HEADDIM, DSTATE, NGROUPS, WIDTH, CHUNK = 3072, 48, 64, 128, 1, 4, 256
CONV_DIM = D_INNER + 2 * NGROUPS * DSTATE  # 3328: x, B, C go through the conv
IN_PROJ = 2 * D_INNER + 2 * NGROUPS * DSTATE + NHEADS  # 6448: z, xBC, dt

BATCHES = {  # name: (sequence lengths, has an initial state)
    "prefill 31500": ([31500], [False]),
    "prefill 8x2048": ([2048] * 8, [False] * 8),
    "mixed 4x1024+60dec": ([1024] * 4 + [1] * 60, [False] * 4 + [True] * 60),
}
DECODE_BATCHES = (1, 8, 64, 256)
STATE_BYTES = NHEADS * HEADDIM * DSTATE * 4  # one sequence's float32 SSM state


def _context(qsl: list[int], state_indices: torch.Tensor, has_init: list[bool]) -> ForwardContext:
    """The forward context of a packed batch with these offsets (no caches, no attention): what
    the engine hands each layer, so that the ops get the step's plans as they do there."""
    lens = [b - a for a, b in zip(qsl, qsl[1:])]
    return ForwardContext.build(query_lens=lens, seq_lens=lens, state_indices=state_indices.tolist(),
                                has_initial_state=has_init, block_tables=None, block_size=1, device=DEV)


class Layer:
    """Inputs of one Mamba2 layer for a packed batch, as views into in_proj-shaped tensors."""

    def __init__(self, lens, has_init, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.lens = lens
        self.T = T = sum(lens)
        self.batch = batch = len(lens)
        self.num_slots = batch + 8
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        self.qsl = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        perm = torch.randperm(self.num_slots, generator=torch.Generator().manual_seed(seed))
        self.idx = perm[:batch].to(torch.int32).to(DEV)  # scattered slots, as in a running engine
        self.has = torch.tensor(has_init, device=DEV)
        zxbcdt = torch.randn(T, IN_PROJ, device=DEV, generator=g).to(BF16)  # in_proj output
        self.z = zxbcdt[:, :D_INNER].view(T, NHEADS, HEADDIM)
        self.xbc = zxbcdt[:, D_INNER:D_INNER + CONV_DIM]
        self.dt = zxbcdt[:, D_INNER + CONV_DIM:]
        conv_out = torch.randn(T, CONV_DIM, device=DEV, generator=g).to(BF16)  # conv1d output
        self.x = conv_out[:, :D_INNER].view(T, NHEADS, HEADDIM)
        self.B = conv_out[:, D_INNER:D_INNER + DSTATE].view(T, NGROUPS, DSTATE)
        self.C = conv_out[:, D_INNER + DSTATE:].view(T, NGROUPS, DSTATE)
        self.conv_w = (torch.randn(CONV_DIM, WIDTH, device=DEV, generator=g) * 0.5).to(BF16)
        self.conv_b = torch.randn(CONV_DIM, device=DEV, generator=g).to(BF16)
        self.conv_states = torch.randn(self.num_slots, WIDTH - 1, CONV_DIM, device=DEV, generator=g).to(BF16)
        self.ssm_states = torch.randn(self.num_slots, NHEADS, HEADDIM, DSTATE, device=DEV, generator=g)
        self.A = -torch.rand(NHEADS, device=DEV, generator=g) * 4 - 0.5
        self.D = torch.randn(NHEADS, device=DEV, generator=g)
        self.dt_bias = torch.randn(NHEADS, device=DEV, generator=g) - 2
        self.norm_w = torch.randn(D_INNER, device=DEV, generator=g).to(BF16)
        self.y = torch.randn(T, D_INNER, device=DEV, generator=g).to(BF16)
        self.ctx = _context(qsl, self.idx, has_init)  # the step's host offsets and launch plans

    def conv1d(self):
        return ops.causal_conv1d(self.xbc, self.conv_w, self.conv_b, self.conv_states, self.qsl, self.idx,
                                 self.has, "silu", blocks=self.ctx.conv_blocks())

    def conv1d_update(self):
        return ops.causal_conv1d_update(self.xbc, self.conv_states, self.conv_w, self.conv_b, self.idx, "silu")

    def chunk_scan(self):
        return ops.ssd_chunk_scan(self.x, self.dt, self.A, self.B, self.C, CHUNK, self.D, self.z,
                                    self.dt_bias, self.ssm_states, self.qsl, self.idx, self.has,
                                    chunks=self.ctx.ssd_chunks(CHUNK))

    def state_update(self):
        return ops.ssd_state_update(self.ssm_states, self.x, self.dt, self.A, self.B, self.C, self.D,
                                          self.z, self.dt_bias, self.idx)

    def norm(self):
        return ops.rms_norm_gated(self.y, self.norm_w, self.z.view(self.T, D_INNER), 1e-5, D_INNER)

    # minimum bytes and FLOPs
    def conv_bytes(self):
        n_init = int(self.has.sum())
        state_rows = (WIDTH - 1) * CONV_DIM * 2 * (n_init + self.batch)  # read where initial, write all
        return 2 * self.T * CONV_DIM * 2 + state_rows + CONV_DIM * (WIDTH + 1) * 2

    def conv_flops(self):
        return 2 * WIDTH * self.T * CONV_DIM

    def scan_bytes(self):
        n_init = int(self.has.sum())
        act = self.T * (3 * D_INNER + NHEADS + 2 * NGROUPS * DSTATE) * 2  # x, z, y, dt, B, C
        return act + (n_init + self.batch) * STATE_BYTES

    def scan_flops(self):
        pairs = sum(min(CHUNK, n - c) * (min(CHUNK, n - c) + 1) // 2 for n in self.lens for c in range(0, n, CHUNK))
        states = 2 * 2 * self.T * NHEADS * HEADDIM * DSTATE  # chunk states + state read-out
        return states + pairs * 2 * (NGROUPS * DSTATE + NHEADS * HEADDIM)

    def state_update_bytes(self):
        return self.batch * (2 * STATE_BYTES + (3 * D_INNER + NHEADS + 2 * NGROUPS * DSTATE) * 2)

    def norm_bytes(self):
        return 3 * self.T * D_INNER * 2


# vLLM 0.33 Triton kernels on the H200 at these shapes, and our targets
PREFILL_BASELINE_US = {"conv1d": 190.0, "ssd_chunk_scan": 810.0}
PREFILL_TARGET_US = {"conv1d": 140.0, "ssd_chunk_scan": 500.0}


@register
def mamba_prefill_cases() -> list[Case]:
    cases = []
    for name, (lens, has) in BATCHES.items():
        layer = Layer(lens, has)
        big = name == "prefill 31500"
        cases.append(Case(
            f"causal_conv1d {name}", "conv1d", layer.conv1d, layer.conv_bytes(), layer.conv_flops(),
            target_us=PREFILL_TARGET_US["conv1d"] if big else None,
            baseline_us=PREFILL_BASELINE_US["conv1d"] if big else None,
            note="target: >= 70% of copy bandwidth" if big else "one launch for the whole batch"))
        cases.append(Case(
            f"ssd_chunk_scan {name}", "ssd", layer.chunk_scan, layer.scan_bytes(), layer.scan_flops(),
            target_us=PREFILL_TARGET_US["ssd_chunk_scan"] if big else None,
            baseline_us=PREFILL_BASELINE_US["ssd_chunk_scan"] if big else None))
        cases.append(Case(f"rms_norm_gated {name}", "norm", layer.norm, layer.norm_bytes()))
    return cases


@register
def mamba_decode_cases() -> list[Case]:
    cases = []
    for batch in DECODE_BATCHES:
        layer = Layer([1] * batch, [True] * batch)
        conv_bytes = layer.conv_bytes()
        cases.append(Case(
            f"causal_conv1d_update decode {batch}", "conv1d", layer.conv1d_update, conv_bytes,
            layer.conv_flops(), target_us=11.0 if batch == 1 else None,
            baseline_us=11.0 if batch == 1 else None,
            note="target: >= 85% of copy bandwidth" if batch == 256 else "vLLM: 6-11 us"))
        cases.append(Case(
            f"causal_conv1d (varlen) decode {batch}", "conv1d", layer.conv1d, conv_bytes, layer.conv_flops(),
            note="the mixed-batch kernel on a decode-only batch"))
        ssu_bytes = layer.state_update_bytes()
        cases.append(Case(
            f"ssd_state_update decode {batch}", "state_update", layer.state_update, ssu_bytes,
            5 * batch * NHEADS * HEADDIM * DSTATE,
            target_us={1: 5.9, 256: 210.0}.get(batch), baseline_us={1: 5.9, 256: 210.0}.get(batch),
            note="target: >= 85% of copy bandwidth" if batch == 256 else ""))
    return cases


# --- FP8 linear layers at decode: granite-4.0-tiny-preview's projections (N, K) and a large one

FP8_LINEARS = {"in_proj": (6448, 1536), "out_proj": (1536, 3072), "q_proj": (1536, 1536), "k_proj": (512, 1536),
               "shared_mlp.input": (2048, 1536), "shared_mlp.output": (1536, 1024), "16384x8192": (16384, 8192)}


@register
def fp8_linear_decode_cases() -> list[Case]:
    """ops.fp8_linear at 1 and 8 rows (the weight-only FP8 GEMV) against F.linear with the bf16
    weight: bytes are the weight, its per-row scales, x and the output (bias: none)."""
    cases = []
    for layer, (n, k) in FP8_LINEARS.items():
        w = torch.randn(n, k, device=DEV) * 0.02
        q, s = ops.quantize_fp8(w)
        s = s.reshape(-1)
        wb = w.to(BF16)
        for m in (1, 8):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            io = 2 * m * (k + n)
            cases.append(Case(f"fp8_linear {m} x {n}x{k}", "fp8_gemv",
                              lambda x=x, q=q, s=s: ops.fp8_linear(x, q, s), n * k + 4 * n + io, 2 * m * n * k,
                              note=f"{layer}; the bf16 case below: the 2x to aim at"))
            cases.append(Case(f"bf16 F.linear {m} x {n}x{k}", "fp8_gemv",
                              lambda x=x, wb=wb: torch.nn.functional.linear(x, wb), 2 * n * k + io, 2 * m * n * k,
                              note=layer))
    return cases


# --- the mamba-130m Mamba-1 layer (benchmarks/configs/mamba-130m.json) ----------------------

M1_D_INNER, M1_DSTATE, M1_RANK = 1536, 16, 48
M1_BATCHES = {"prefill 2048": ([2048], [False]), "mixed 4x512+60dec": ([512] * 4 + [1] * 60, [False] * 4 + [True] * 60)}


class Mamba1Layer:
    """Inputs of one Mamba-1 selective scan for a packed batch: x, z as column slices of an
    in_proj-shaped output, B, C of an x_proj-shaped one; float32 (d_inner, d_state) state pool."""

    def __init__(self, lens, has_init, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.T = T = sum(lens)
        batch = len(lens)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        self.qsl = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        self.idx = torch.randperm(batch + 8,
                                  generator=torch.Generator().manual_seed(seed))[:batch].to(torch.int32).to(DEV)
        self.has = torch.tensor(has_init, device=DEV)
        xz = torch.randn(T, 2 * M1_D_INNER, device=DEV, generator=g).to(BF16)
        self.x, self.z = xz[:, :M1_D_INNER], xz[:, M1_D_INNER:]
        self.dt = (torch.randn(T, M1_D_INNER, device=DEV, generator=g) - 2).to(BF16)
        x_dbl = torch.randn(T, M1_RANK + 2 * M1_DSTATE, device=DEV, generator=g).to(BF16)
        self.B, self.C = x_dbl[:, M1_RANK:M1_RANK + M1_DSTATE], x_dbl[:, M1_RANK + M1_DSTATE:]
        self.A = -torch.arange(1, M1_DSTATE + 1, device=DEV, dtype=torch.float32).expand(M1_D_INNER, -1).contiguous()
        self.D = torch.randn(M1_D_INNER, device=DEV, generator=g)
        self.dt_bias = torch.randn(M1_D_INNER, device=DEV, generator=g)
        self.states = torch.randn(batch + 8, M1_D_INNER, M1_DSTATE, device=DEV, generator=g)
        self.ctx = _context(qsl, self.idx, has_init)  # the step's host offsets
        self.bytes = (T * (4 * M1_D_INNER + 2 * M1_DSTATE) * 2  # x, z, dt, y, B, C
                      + (int(self.has.sum()) + batch) * M1_D_INNER * M1_DSTATE * 4)

    def scan(self):
        return ops.selective_scan(self.x, self.dt, self.A, self.B, self.C, self.D, self.z, self.dt_bias, self.states,
                                  self.qsl, self.idx, self.has, query_start_loc_host=self.ctx.query_start_loc_host)

    def update(self):
        return ops.selective_scan_update(self.states, self.x, self.dt, self.A, self.B, self.C, self.D, self.z,
                                         self.dt_bias, self.idx)


@register
def mamba1_cases() -> list[Case]:
    cases = []
    for name, (lens, has) in M1_BATCHES.items():
        layer = Mamba1Layer(lens, has)
        cases.append(Case(f"selective_scan {name}", "mamba1", layer.scan, layer.bytes,
                          9 * layer.T * M1_D_INNER * M1_DSTATE,
                          note="token-sequential per (sequence, channel block): latency-bound on long prompts"))
    for batch in (1, 64, 256):
        layer = Mamba1Layer([1] * batch, [True] * batch)
        cases.append(Case(f"selective_scan_update decode {batch}", "mamba1", layer.update, layer.bytes,
                          9 * batch * M1_D_INNER * M1_DSTATE))
    return cases


# --- offline tuning --------------------------------------------------------------------------

SWEEPS = [  # (case name, module, config attribute, variants); the first variant is the default
    ("ssd_state_update decode 256", state_update_mod, "STATE_UPDATE_CONFIG", [
        {"block_p": 16, "num_warps": 4}, {"block_p": 8, "num_warps": 2}, {"block_p": 4, "num_warps": 4},
        {"block_p": 32, "num_warps": 4}]),
    ("selective_scan prefill 2048", mamba1_scan_mod, "SCAN_CONFIG", [
        {"block_d": 32, "num_warps": 2, "chunk": 0}, {"block_d": 16, "num_warps": 1, "chunk": 0},
        {"block_d": 16, "num_warps": 2, "chunk": 0}, {"block_d": 64, "num_warps": 4, "chunk": 0},
        {"block_d": 8, "num_warps": 1, "chunk": 0}, {"block_d": 16, "num_warps": 4, "chunk": 16},
        {"block_d": 8, "num_warps": 4, "chunk": 32}, {"block_d": 16, "num_warps": 8, "chunk": 32},
        {"block_d": 32, "num_warps": 8, "chunk": 16}]),
    ("selective_scan_update decode 256", mamba1_scan_mod, "UPDATE_CONFIG", [
        {"block_d": 32, "num_warps": 2}, {"block_d": 64, "num_warps": 4}, {"block_d": 128, "num_warps": 4},
        {"block_d": 16, "num_warps": 1}]),
]


def _fresh_case(name: str) -> Case:
    for builder in CASE_BUILDERS:
        for case in builder():
            if case.name == name:
                return case
    raise KeyError(name)


def sweep(copy_gbs: float, rows: list, save: Callable[[], None], budget_s: float) -> dict:
    """Time config variants (appended to rows, saved after each); each variant's first output
    (fresh state) is checked against the first variant's. Returns the fastest correct variant
    of each config, {(module, attr): variant}. Stops starting variants after budget_s."""
    best = {}
    t_end = time.perf_counter() + budget_s
    # a config swept on several cases is chosen on the first (later ones are for information);
    chooses = {}
    for case_name, module, attr, _ in SWEEPS:
        chooses.setdefault((module, attr), case_name)
    for case_name, module, attr, variants in SWEEPS:
        original = getattr(module, attr)
        base_out = None
        for variant in variants:
            if time.perf_counter() > t_end:
                break
            setattr(module, attr, variant)
            row = {"case": case_name, "config": f"{module.__name__}.{attr}", "variant": variant}
            try:
                case = _fresh_case(case_name)
                out = case.fn()
                torch.cuda.synchronize()
                if base_out is None:
                    base_out = out.float().clone()
                err = float((out.float() - base_out).norm() / base_out.norm())
                row["rel_err_vs_first"] = err
                row["gpu_us"] = gpu_time_us(case.fn)
                row["frac_bw"] = case.bytes / (row["gpu_us"] * 1e-6) / 1e9 / copy_gbs
                del case, out
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                row["error"] = repr(e)[:300]
            rows.append(row)
            save()
            ok = "gpu_us" in row and row["rel_err_vs_first"] < 5e-3 and chooses.get((module, attr)) == case_name
            if ok and ((module, attr) not in best or row["gpu_us"] < best[(module, attr)][1]):
                best[(module, attr)] = (variant, row["gpu_us"])
            print(f"  sweep {case_name:36s} {attr:20s} {str(variant):90s} "
                  f"{row.get('gpu_us', float('nan')):9.1f} us  err {row.get('rel_err_vs_first', float('nan')):.1e}"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
        setattr(module, attr, original)
        torch.cuda.empty_cache()
    return {key: v for key, (v, _) in best.items()}


def current_configs() -> dict:
    configs = {f"{m.__name__}.{a}": getattr(m, a) for m, a in dict.fromkeys((m, a) for _, m, a, _ in SWEEPS)}
    # conv1d: a table per GPU (mambaserve/ops/configs/, tuned by benchmarks/tune_conv1d.py)
    configs["mambaserve.ops.conv1d table"] = conv1d_mod.table_for(DEV)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--sweep", action="store_true",
                        help="first time alternative launch configs, then run the cases with the fastest")
    parser.add_argument("--sweep-budget-s", type=float, default=120.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    path = args.output_json or "kernels-" + re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json"
    import triton

    result = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
              "timing": {"gpu_us": "CUDA graph replay of one call between events, L2 flushed before each, median",
                         "kernel_us": "sum of the call's kernel durations (torch profiler), L2 flushed before each",
                         "host_us": "host time to issue one eager call, the step's plans already built",
                         "GBps, frac_copy_bw, TFLOPs": "from min(gpu_us, kernel_us)"},
              "cases": []}
    copy_gbs = copy_bandwidth_gbs()
    result["copy_bandwidth_GBps"] = copy_gbs
    mm_tflops = matmul_tflops()
    result["bf16_matmul_TFLOPs"] = mm_tflops
    print(f"{gpu}: device-to-device copy {copy_gbs:.0f} GB/s (read + write), bf16 8192^3 matmul "
          f"{mm_tflops:.0f} TFLOP/s", flush=True)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    if args.sweep:
        result["sweep"] = []
        chosen = sweep(copy_gbs, result["sweep"], save, args.sweep_budget_s)
        for (module, attr), variant in chosen.items():
            setattr(module, attr, variant)
    result["configs"] = current_configs()
    print("configs:", json.dumps(result["configs"]), flush=True)

    def fmt(v, f):
        return (f % v) if isinstance(v, (int, float)) and not math.isnan(v) else "-"

    def line(row, bw):
        def frac(us):
            return 100 * row["bytes"] / (us * 1e-6) / 1e9 / bw if isinstance(us, float) and us > 0 else None

        return (f"{row['name']:40s} {fmt(row.get('gpu_us'), '%8.1f'):>8s} {fmt(row.get('kernel_us'), '%8.1f'):>8s} "
                f"{fmt(row.get('host_us'), '%7.1f'):>7s} {row['bytes'] / 1e6:8.1f} "
                f"{fmt(frac(row.get('gpu_us')), '%4.0f'):>4s} {fmt(frac(row.get('kernel_us')), '%4.0f'):>4s} "
                f"{fmt(row.get('TFLOPs'), '%6.1f'):>6s} {fmt(row.get('frac_matmul'), '%5.3f'):>5s} "
                f"{fmt(row.get('target_us'), '%7.1f'):>7s} "
                f"{fmt(row.get('baseline_us'), '%7.1f'):>7s}"
                + (f"  ERROR {row['error'][:200]}" if "error" in row else ""))

    header = (f"{'case':40s} {'graph us':>8s} {'kern us':>8s} {'host us':>7s} {'MB':>8s} {'%bw':>4s} {'%bwk':>4s} "
              f"{'TFLOP/s':>6s} {'mm':>5s} {'target':>7s} {'vLLM':>7s}")
    print(header, flush=True)
    for builder in CASE_BUILDERS:
        for case in builder():
            if args.only and args.only not in case.name:
                continue
            row = {"name": case.name, "group": case.group, "bytes": case.bytes, "flops": case.flops,
                   "target_us": case.target_us, "baseline_us": case.baseline_us, "note": case.note}
            try:
                row["gpu_us"] = gpu_time_us(case.fn)
                row["kernel_us"], row["kernels_us"] = kernel_time_us(case.fn)
                row["host_us"] = host_time_us(case.fn)
                device_us = min(row["gpu_us"], row["kernel_us"] or row["gpu_us"])
                row["GBps"] = case.bytes / (device_us * 1e-6) / 1e9
                row["frac_copy_bw"] = row["GBps"] / copy_gbs
                row["TFLOPs"] = case.flops / (device_us * 1e-6) / 1e12
                row["frac_matmul"] = row["TFLOPs"] / mm_tflops
            except Exception as e:
                row["error"] = repr(e)[:500]
            result["cases"].append(row)
            print(line(row, copy_gbs), flush=True)
            if len(row.get("kernels_us", {})) > 1:
                for k, v in row["kernels_us"].items():
                    print(f"    {k[:60]:60s} {v:9.1f} us", flush=True)
            del case
            save()
        torch.cuda.empty_cache()
    copy_end = copy_bandwidth_gbs()
    result["copy_bandwidth_GBps_end"] = copy_end
    bw = max(copy_gbs, copy_end)
    result["copy_bandwidth_GBps_used"] = bw
    for row in result["cases"]:
        if "GBps" in row:
            row["frac_copy_bw"] = row["GBps"] / bw
    save()
    print()
    print(f"{gpu}: copy bandwidth {copy_gbs:.0f} GB/s at the start, {copy_end:.0f} at the end; %bw uses {bw:.0f}")
    print("graph us: CUDA-graph replay with L2 flushed (includes the graph launch); kern us: sum of kernel")
    print("durations from the profiler, L2 flushed; host us: host time to issue one eager call; %bw: bytes")
    print(f"moved over the copy bandwidth; mm: FLOP rate over the bf16 matmul rate ({mm_tflops:.0f} TFLOP/s)")
    print(header)
    for row in result["cases"]:
        print(line(row, bw))
    print(f"wrote {path}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
