"""Timings of paged attention and fused MoE at granite-4.0-tiny-preview shapes, with floors.

Shapes (bf16): attention with 12 query heads, 4 kv heads, head_dim 128, block_size 16, scale
1/128 (attention_multiplier); MoE with hidden 1536, 62 experts, top-6, intermediate 512.
Cases: a 31,500-token prefill, decode batches 1 and 256 at context 4,096; MoE at 31,500, 256
and 1 tokens. Each case reports its floor: the larger of (FLOPs / measured bf16 matmul rate)
and (minimum bytes / measured device copy bandwidth), both ceilings measured at the start, and
the fraction floor / time.

Timing: `triton.testing.do_bench` (median, L2 flushed before every call: launch gaps and host
work included) and, for small cases, CUDA-graph replays that rotate over enough distinct
inputs to defeat the 60 MB L2 (device time only). Per-step host work (the attention plan) is
done once before timing, as the engine does it once per step for all layers.

Usage: python benchmarks/kernels_attention_moe.py [--out results.json] [--only-decode-moe].
Needs a CUDA GPU. The last case sweeps the decode MoE's direct-kernel tiles and times the fused
router + top-k against cuBLAS + top-k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mambaserve.ops import attention as attention_mod  # noqa: E402
from mambaserve.ops import (  # noqa: E402
    fused_moe,
    paged_attention,
    plan_paged_attention,
    reshape_and_cache,
    router_topk,
    topk_softmax,
)
from mambaserve.ops import moe as moe_mod  # noqa: E402
from mambaserve.ops.moe import _HAS_GROUPED_MM  # noqa: E402
from mambaserve.ops.varlen import check_offsets  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 128, 16
SCALE = 0.0078125
HIDDEN, EXPERTS, TOP_K, INTER = 1536, 62, 6, 512
DT = torch.bfloat16
DEV = "cuda"


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 matmul rate, on random data."""
    n = 1 << 30  # 1 GiB each way
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn(8192, 8192, device=DEV, dtype=DT)
    t_mm = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=300, return_mode="median")
    return {"copy_GBps": 2 * n / t_copy / 1e6, "bf16_mm_TFLOPs": 2 * 8192**3 / t_mm / 1e9}


def time_graph(calls, replays: int = 20) -> float:
    """ms per call: one CUDA graph runs every call once; median over replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm up (compile) outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / len(calls))
    times.sort()
    return times[len(times) // 2]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def floor_ms(flops: float, nbytes: float, ceil: dict) -> tuple[float, str]:
    t_c = flops / (ceil["bf16_mm_TFLOPs"] * 1e9)
    t_b = nbytes / (ceil["copy_GBps"] * 1e6)
    return (t_c, "compute") if t_c >= t_b else (t_b, "bandwidth")


# ---- attention ----------------------------------------------------------------------------


def attention_batch(specs, copies: int = 1):
    """`copies` independent caches (rotation against L2) for a batch of (new, prefix) specs."""
    q_lens = [n for n, _ in specs]
    seq_lens = [n + p for n, p in specs]
    per_seq = [-(-s // BLOCK) for s in seq_lens]
    width = max(per_seq)
    num_blocks = sum(per_seq) + 8
    perm = torch.randperm(num_blocks, device=DEV)
    table = torch.zeros(len(specs), width, dtype=torch.int32, device=DEV)
    used = 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    sets = []
    for _ in range(copies):
        kc = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
        vc = torch.randn_like(kc)
        q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=DEV, dtype=DT)
        sets.append((q, kc, vc))
    return sets, table, sl, qsl


def attention_plan(table, sl, qsl, num_splits=None):
    """The step's work list, built once from host copies as the forward context builds it."""
    return plan_paged_attention(check_offsets(qsl.tolist()), sl.cpu().numpy(), group_size=HEADS // KV_HEADS,
                                num_kv_heads=KV_HEADS, block_size=BLOCK, table_width=table.shape[1], device=DEV,
                                num_splits=num_splits)


def attention_cost(specs):
    flops = sum(4 * HEADS * HEAD_DIM * (n * p + n * (n + 1) / 2) for n, p in specs)
    kv_bytes = sum((n + p) for n, p in specs) * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, read once
    qo_bytes = sum(n for n, _ in specs) * HEADS * HEAD_DIM * 2 * 2
    return flops, kv_bytes + qo_bytes


def bench_attention_configs(name, specs, ceil, configs):
    """Other (BLOCK_N, num_warps, num_stages) for the main kernel, each checked against the default."""
    sets, table, sl, qsl = attention_batch(specs, 1)
    q, kc, vc = sets[0]
    flops, nbytes = attention_cost(specs)
    floor, bound = floor_ms(flops, nbytes, ceil)
    plan = attention_plan(table, sl, qsl)
    base = paged_attention(q, kc, vc, table, sl, qsl, SCALE, plan)
    default = attention_mod._launch_config
    rows = []
    for cfg in configs:
        attention_mod._launch_config = lambda block_r, block_d, on_gpu, cfg=cfg: cfg
        try:
            out = paged_attention(q, kc, vc, table, sl, qsl, SCALE, plan)
            err = float((out.float() - base.float()).norm() / base.float().norm())
            t = bench(lambda out=out: paged_attention(q, kc, vc, table, sl, qsl, SCALE, plan, out=out))
            rows.append({"case": name, "variant": f"BLOCK_N,warps,stages={cfg}", "flops": flops, "bytes": nbytes,
                         "floor_ms": floor, "bound": bound, "eager_ms": t, "eager_fraction_of_floor": floor / t,
                         "TFLOPs": flops / t / 1e9, "rel_diff_vs_default": err})
        finally:
            attention_mod._launch_config = default
    return rows


def bench_attention(name, specs, ceil, copies, graph: bool, extra_splits=()):
    sets, table, sl, qsl = attention_batch(specs, copies)
    flops, nbytes = attention_cost(specs)
    floor, bound = floor_ms(flops, nbytes, ceil)
    rows = []
    for forced in (None, *extra_splits):
        plan = attention_plan(table, sl, qsl, num_splits=forced)
        outs = [torch.empty_like(s[0]) for s in sets]
        calls = [
            (lambda s=s, o=o, plan=plan: paged_attention(s[0], s[1], s[2], table, sl, qsl, SCALE, plan, out=o))
            for s, o in zip(sets, outs)
        ]
        t_eager = bench(calls[0])
        row = {
            "case": name, "variant": f"num_splits={plan.num_splits}" + (" (forced)" if forced else " (auto)"),
            "tokens": int(qsl[-1]), "flops": flops, "bytes": nbytes, "floor_ms": floor, "bound": bound,
            "eager_ms": t_eager, "eager_fraction_of_floor": floor / t_eager,
            "TFLOPs": flops / t_eager / 1e9, "GBps": nbytes / t_eager / 1e6,
            "block_r": plan.block_r, "items": int(plan.work.shape[0]),
        }
        if graph:
            t_graph = time_graph(calls)
            row.update(graph_ms=t_graph, graph_fraction_of_floor=floor / t_graph,
                       graph_GBps=nbytes / t_graph / 1e6, graph_copies=len(calls))
        rows.append(row)
    return rows


def bench_reshape_and_cache(ceil):
    n = 31500
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    nb = -(-n // BLOCK) + 8
    kc = torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    slots = torch.randperm(nb * BLOCK, device=DEV)[:n]
    nbytes = 2 * 2 * k.numel() * 2 + slots.numel() * 8
    t = bench(lambda: reshape_and_cache(k, v, kc, vc, slots))
    floor, bound = floor_ms(0, nbytes, ceil)
    return [{"case": "reshape_and_cache 31500 tokens", "bytes": nbytes, "floor_ms": floor, "bound": bound,
             "eager_ms": t, "eager_fraction_of_floor": floor / t, "GBps": nbytes / t / 1e6}]


# ---- MoE -----------------------------------------------------------------------------------


def moe_inputs(num_tokens, copies):
    sets = []
    for _ in range(copies):
        x = torch.randn(num_tokens, HIDDEN, device=DEV, dtype=DT)
        w1 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, dtype=DT) / HIDDEN**0.5)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, dtype=DT) / INTER**0.5)
        logits = torch.randn(num_tokens, EXPERTS, device=DEV)
        top, ids = logits.topk(TOP_K, dim=-1)
        sets.append((x, w1, w2, torch.softmax(top, -1).to(DT), ids))
    return sets


def bench_moe(num_tokens, ceil, copies, graph: bool):
    sets = moe_inputs(num_tokens, copies)
    rows_m = num_tokens * TOP_K
    flops = 2 * rows_m * (2 * INTER * HIDDEN + INTER * HIDDEN)
    experts_hit = int(torch.unique(sets[0][4]).numel())
    nbytes = experts_hit * 3 * INTER * HIDDEN * 2 + 2 * num_tokens * HIDDEN * 2
    floor, bound = floor_ms(flops, nbytes, ceil)
    impls = ["triton"] + (["grouped_mm"] if _HAS_GROUPED_MM else [])
    if num_tokens * TOP_K <= moe_mod.DIRECT_MAX_PAIRS:
        impls.append("direct")
    rows = []
    for impl in impls:
        outs = [torch.empty_like(s[0]) for s in sets]
        calls = [(lambda s=s, o=o, impl=impl: fused_moe(*s, impl=impl, out=o)) for s, o in zip(sets, outs)]
        t_eager = bench(calls[0])
        row = {"case": f"fused_moe {num_tokens} tokens", "variant": impl, "tokens": num_tokens,
               "experts_hit": experts_hit, "flops": flops, "bytes": nbytes, "floor_ms": floor, "bound": bound,
               "eager_ms": t_eager, "eager_fraction_of_floor": floor / t_eager, "TFLOPs": flops / t_eager / 1e9}
        if graph:
            try:
                t_graph = time_graph(calls)
                row.update(graph_ms=t_graph, graph_fraction_of_floor=floor / t_graph, graph_copies=len(calls))
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                row["graph_error"] = repr(e)[:300]
        rows.append(row)
    return rows


def sweep_moe_direct(ceil, configs=((16, 256, 16, 256), (8, 512, 16, 512), (32, 128, 32, 128),
                                      (16, 512, 8, 512), (8, 256, 8, 256), (16, 128, 16, 128))):
    """The decode MoE's direct kernels at one token (6 routed + 2 shared-expert pairs, as
    granite-4.0-tiny-preview runs them) for several (gate/up BLOCK_I, BLOCK_H, down BLOCK_N,
    BLOCK_I) tiles; and the fused router + top-k against cuBLAS + top-k."""
    rows = []
    sets = []
    for _ in range(8):
        x = torch.randn(1, HIDDEN, device=DEV, dtype=DT)
        w1 = torch.randn(EXPERTS + 2, 2 * INTER, HIDDEN, device=DEV, dtype=DT) / HIDDEN**0.5
        w2 = torch.randn(EXPERTS + 2, HIDDEN, INTER, device=DEV, dtype=DT) / INTER**0.5
        ids = torch.cat([torch.randperm(EXPERTS, device=DEV)[:TOP_K], torch.tensor([EXPERTS, EXPERTS + 1], device=DEV)])
        tw = torch.rand(1, TOP_K + 2, device=DEV, dtype=DT)
        sets.append((x, w1, w2, tw, ids[None].to(torch.int32)))
    nbytes = (TOP_K + 2) * 3 * INTER * HIDDEN * 2
    floor, _ = floor_ms(0, nbytes, ceil)
    original = moe_mod._direct_config
    try:
        for cfg in configs:
            moe_mod._direct_config = lambda on_gpu, cfg=cfg: cfg
            outs = [torch.empty_like(s_[0]) for s_ in sets]
            calls = [(lambda s_=s_, o=o: fused_moe(*s_, impl="direct", out=o)) for s_, o in zip(sets, outs)]
            t = time_graph(calls)
            rows.append({"case": "moe direct 1 token (6 + 2 shared pairs)", "variant": f"tiles {cfg}", "bytes": nbytes,
                         "floor_ms": floor, "bound": "bandwidth", "eager_ms": bench(calls[0]),
                         "eager_fraction_of_floor": floor / bench(calls[0]), "graph_ms": t,
                         "graph_fraction_of_floor": floor / t})
    finally:
        moe_mod._direct_config = original
    xs = [torch.randn(1, HIDDEN, device=DEV, dtype=DT) for _ in range(8)]
    rws = [torch.randn(EXPERTS, HIDDEN, device=DEV, dtype=DT) for _ in range(8)]
    fused = [(lambda x=x, w=w: router_topk(x, w, TOP_K, DT, 2)) for x, w in zip(xs, rws)]
    unfused = [(lambda x=x, w=w: topk_softmax(torch.nn.functional.linear(x, w), TOP_K, DT, 2)) for x, w in zip(xs, rws)]
    rb = EXPERTS * HIDDEN * 2
    for name, calls in (("router_topk fused", fused), ("linear + topk_softmax", unfused)):
        t = time_graph(calls)
        rows.append({"case": "router 1 token", "variant": name, "bytes": rb, "floor_ms": rb / (ceil["copy_GBps"] * 1e6),
                     "bound": "bandwidth", "eager_ms": bench(calls[0]), "eager_fraction_of_floor": 0.0,
                     "graph_ms": t, "graph_fraction_of_floor": rb / (ceil["copy_GBps"] * 1e6) / t})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--only-decode-moe", action="store_true",
                    help="only the decode MoE tile sweep and the router (a quick run)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    result["ceilings"] = ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)
    cases = [
        lambda: bench_attention("attention prefill 31500", [(31500, 0)], ceil, 1, graph=False),
        lambda: bench_attention_configs("attention prefill 31500", [(31500, 0)], ceil, [(128, 8, 2), (64, 8, 4)]),
        lambda: bench_attention("attention decode b=1 ctx=4096", [(1, 4095)], ceil, 16, graph=True, extra_splits=(1,)),
        lambda: bench_attention("attention decode b=256 ctx=4096", [(1, 4095)] * 256, ceil, 1, graph=True),
        lambda: bench_reshape_and_cache(ceil),
        lambda: bench_moe(31500, ceil, 1, graph=False),
        lambda: bench_moe(256, ceil, 4, graph=True),
        lambda: bench_moe(1, ceil, 4, graph=True),
        lambda: sweep_moe_direct(ceil),
    ]
    if args.only_decode_moe:
        cases = cases[-1:]
    for case in cases:
        try:
            rows = case()
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            rows = [{"case": "error", "error": repr(e)[:500]}]
        result["rows"].extend(rows)
        for r in rows:
            print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\n{'case':34s} {'variant':24s} {'floor ms':>9s} {'eager ms':>9s} {'frac':>5s} {'graph ms':>9s} "
          f"{'frac':>5s}")
    for r in result["rows"]:
        if "floor_ms" not in r:
            print(r)
            continue
        g = r.get("graph_ms")
        print(f"{r['case']:34s} {r.get('variant', ''):24s} {r['floor_ms']:9.4f} {r['eager_ms']:9.4f} "
              f"{r['eager_fraction_of_floor']:5.2f} "
              + (f"{g:9.4f} {r['graph_fraction_of_floor']:5.2f}" if g else "") + f" ({r['bound']})")


if __name__ == "__main__":
    main()
