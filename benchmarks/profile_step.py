"""Where a step's GPU time goes: the CUDA kernels of one prefill and of one decode step, by name.

    PYTHONUNBUFFERED=1 python3 benchmarks/profile_step.py --model granite-4.0-tiny-preview \
        --output-json "$OUT/profile-granite.json"

For one model of benchmarks/configs/ (random weights, bfloat16; `--quantization fp8`: the
engine's online FP8, its selected linear layers and experts with FP8 weights and per-row
scales) it builds the engine in each of the modes given (`--modes eager,graphed`) and, with
`torch.profiler` (CUDA activity), records
- prefill: one batch of `--batch-size` prompts of `--input-len` tokens generating 1 token;
- decode: the same batch generating `--decode-steps` + 1 tokens, minus the prefill run: what is
  left is `--decode-steps` decode steps.
- mixed (with `--mixed-decodes N`): N requests decoding (prompts of 64 tokens) while new
  requests of `--input-len` tokens arrive one per step: `--decode-steps` steps that each carry
  the N decodes and one prompt (the steps of a throughput run once its batch is full). For these
  it also reports the host side: wall time with and without the profiler, the CUDA API calls
  that wait for the device (synchronizations, blocking copies), and the host functions with the
  most self time.
- verify (with `--speculative-k K`): the engine built with n-gram speculation of K drafts and
  the benchmark knob that forces 70% of them accepted (`engine.spec_decode.ForcedAcceptance`;
  dummy weights accept none), `--decode-steps` steps after every request of the batch has its
  first token: each a verify step of K + 1 tokens per sequence. Host side as for mixed steps.
It prints, per mode and phase, the number of kernels per step (launches), their summed device
time per step, the wall time per step, and the 25 kernels with the most device time. In graphed
mode the kernels inside CUDA graph replays are listed where the profiler sees them (CUPTI does on
CUDA 12).

The floor (`benchmarks/floor.py`; `--no-floor` skips it): before any engine is built the script
measures the GPU's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus written) and
bf16 matrix rate (an 8192^3 matmul), best of 10 each; then for every phase it prints the bytes
and FLOPs the phase's steps must move and run (the engine's own model, its chunking of the
prompts), the floor time they imply, and the measured kernel time by group (norm, gemv/gemm,
moe, conv, scan, state update, attention, other) with each group's excess over its own floor
and its share of the phase's gap (kernel time minus floor). The JSON holds all of it, with the
GPU, the hardware figures and the commit ($MAMBASERVE_COMMIT, else git's HEAD). The floor's
bytes are the engine's own parameters (FP8: 1 byte a weight element plus its float32 scales);
its FLOPs floor uses the bf16 matrix rate also for an FP8 engine (lm_head, attention and the
scan stay bf16), so a prefill floor there is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import floor  # noqa: E402

from mambaserve.benchmarks.common import git_commit as _git_commit  # noqa: E402


def _kernels(prof) -> dict[str, list[float]]:
    """Device kernels of a profile: name -> [count, total microseconds]."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name
        if name.startswith(("Memcpy", "Memset")):
            name = name.split(" ")[0]
        out[name][0] += 1
        out[name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return out


def _profile_run(llm, prompts, params):
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t0
    return _kernels(prof), wall


def _diff(a, b):
    out = {}
    for k in set(a) | set(b):
        c = a.get(k, [0, 0.0])[0] - b.get(k, [0, 0.0])[0]
        t = a.get(k, [0, 0.0])[1] - b.get(k, [0, 0.0])[1]
        if c or abs(t) > 1e-9:
            out[k] = [c, t]
    return out


def _summary(kern: dict, steps: int, wall: float) -> dict:
    rows = sorted(kern.items(), key=lambda kv: -kv[1][1])
    groups = floor.grouped_us({k: t / steps for k, (_, t) in kern.items()})
    launches = defaultdict(float)
    for k, (c, _) in kern.items():
        launches[floor.kernel_group(k)] += c / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall * 1e3 / steps,
        "kernels_per_step": sum(c for c, _ in kern.values()) / steps,
        "kernel_ms_per_step": sum(t for _, t in kern.values()) / 1e3 / steps,
        "group_us_per_step": groups,
        "group_launches_per_step": dict(launches),
        "top": [{"name": k[:160], "group": floor.kernel_group(k), "count_per_step": c / steps, "us_per_step": t / steps}
                for k, (c, t) in rows[:25]],
    }


def git_commit() -> str | None:
    return _git_commit(REPO)


def measure_hardware(copy_bytes: int = 1 << 30, n: int = 8192, repeats: int = 10) -> dict:
    """The GPU's copy bandwidth (bytes/s: a copy of copy_bytes, read plus written) and bf16
    matrix rate (FLOP/s: an n x n x n matmul), the best of `repeats` timed with CUDA events."""
    import torch

    def best_s(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return min(times)

    def copy_s() -> float:
        src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        return best_s(lambda: dst.copy_(src))

    def matmul_s() -> float:
        x, y = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        return best_s(lambda: x @ y)

    bw, rate = 2 * copy_bytes / copy_s(), 2 * n**3 / matmul_s()
    torch.cuda.empty_cache()  # the buffers are gone with the functions' frames
    return {"copy_bandwidth_bytes_per_s": bw, "bf16_matmul_flops_per_s": rate, "copy_bytes": copy_bytes,
            "matmul_n": n}


def phase_steps(phase: str, args, budget: int) -> list:
    """The steps (floor.Step) one profiled step of `phase` stands for: the whole prefill of the
    batch as the scheduler chunks it; each decode step (averaged over the decode steps); a
    mixed step (the decodes at the middle of their contexts plus one prompt)."""
    if phase == "prefill":
        return floor.packed_prefill_steps(args.batch_size, args.input_len, budget)
    if phase == "decode":
        return [floor.Step.decode(args.batch_size, args.input_len + j) for j in range(args.decode_steps)]
    return [floor.Step.mixed(args.mixed_decodes, 64 + 2 * args.decode_steps, args.input_len)]


def add_floor(res: dict, shape, args, budget: int, hw: dict) -> None:
    """Each phase's floor table (floor.table_rows) against its measured kernel groups, in res."""
    bw, rate = hw["copy_bandwidth_bytes_per_s"], hw["bf16_matmul_flops_per_s"]
    for phase in [p for p in ("prefill", "decode", "mixed") if p in res]:
        steps = phase_steps(phase, args, budget)
        cost = floor.steps_cost(shape, steps)
        per = 1 if phase == "prefill" else len(steps)  # decode: the average step
        cost = floor.StepCost({g: v / per for g, v in cost.bytes.items()}, {g: v / per for g, v in cost.flops.items()})
        res[phase]["floor"] = {"engine_steps": len(steps) if phase == "prefill" else 1,
                               "rows": floor.table_rows(cost, bw, rate, res[phase]["group_us_per_step"])}


def _host_summary(prof, steps: int) -> dict:
    """The host side of a profile: waits on the device and the busiest host functions."""
    waits, api, ops = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if ev.device_type.name != "CPU":
            continue
        name = ev.key
        target = api if name.startswith("cuda") else ops
        if "Synchronize" in name or name in ("cudaMemcpy", "cudaStreamWaitEvent", "cudaEventSynchronize"):
            target = waits
        target[name][0] += ev.count
        target[name][1] += ev.self_cpu_time_total
    def rows(d, n):
        return [{"name": k[:120], "count_per_step": c / steps, "self_us_per_step": t / steps}
                for k, (c, t) in sorted(d.items(), key=lambda kv: -kv[1][1])[:n]]

    return {"waits": rows(waits, 8), "cuda_api": rows(api, 8), "host_ops": rows(ops, 25)}


def _python_cumulative(run, steps: int) -> list[dict]:
    """run() under cProfile: the 30 Python functions with the most cumulative time, per step."""
    import cProfile
    import pstats

    cprof = cProfile.Profile()
    cprof.enable()
    run()
    cprof.disable()
    st = pstats.Stats(cprof)
    py = sorted(((v[3], v[2], v[1], k) for k, v in st.stats.items()), reverse=True)[:30]  # by cumulative time
    return [{"function": f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", "cum_us_per_step": c * 1e6 / steps,
             "self_us_per_step": t * 1e6 / steps, "calls_per_step": n / steps} for c, t, n, k in py]


def _mixed_phase(llm, args, rng) -> dict:
    """N decoding requests plus one new prompt a step; profiles `decode_steps` such steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mambaserve import SamplingParams
    from mambaserve.benchmarks.datasets import random_token_ids

    eng, vocab = llm.llm_engine, llm.llm_engine.vocab_size
    n, steps = args.mixed_decodes, args.decode_steps
    long = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    added = [f"d{i}" for i in range(n)]
    for rid in added:
        eng.add_request(rid, {"prompt_token_ids": random_token_ids(rng, 64, vocab)}, long)
    started: set[str] = set()
    while len(started) < n:  # until every prompt is prefilled (its first token sampled)
        started.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
    eng.step()  # every request decoding

    def mixed_steps(tag: str):
        t0 = time.perf_counter()
        for j in range(steps):
            added.append(f"{tag}{j}")
            eng.add_request(added[-1], {"prompt_token_ids": random_token_ids(rng, args.input_len, vocab)}, short)
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    mixed_steps("w")  # warm-up: the piecewise sizes of these steps compile and capture
    wall_plain = mixed_steps("p")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_prof = mixed_steps("m")
    python_cum = _python_cumulative(lambda: mixed_steps("c"), steps)
    kinds = eng.usage().step_breakdown
    for rid in added:
        eng.abort_request(rid)  # False for those already finished
    res = _summary(_kernels(prof), steps, wall_prof)
    res.update({"decodes": n, "prompt_len": args.input_len, "wall_ms_per_step_unprofiled": wall_plain * 1e3 / steps,
                "step_kinds": {k: v.steps for k, v in kinds.items()}, **_host_summary(prof, steps),
                "python_cumulative": python_cum})
    return res


def _verify_phase(llm, args, rng) -> dict:
    """`decode_steps` steps of the batch once every request has its first token: verify steps
    (the engine speculates); profiled, then timed without the profiler, then under cProfile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mambaserve import SamplingParams
    from mambaserve.benchmarks.datasets import random_token_ids

    eng, vocab, steps = llm.llm_engine, llm.llm_engine.vocab_size, args.decode_steps
    params = SamplingParams(temperature=0.0, max_tokens=4 * (args.speculative_k + 1) * steps + 8, ignore_eos=True)
    ids = [f"v{i}" for i in range(args.batch_size)]
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": random_token_ids(rng, args.input_len, vocab)}, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def run() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        return time.perf_counter() - t0

    run()  # warm-up
    before = eng.usage().spec_decode
    wall_plain = run()
    after = eng.usage().spec_decode
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_prof = run()
    python_cum = _python_cumulative(run, steps)
    for rid in ids:
        eng.abort_request(rid)
    res = _summary(_kernels(prof), steps, wall_prof)
    drafts = after.num_drafts - before.num_drafts
    res.update({"k": args.speculative_k, "wall_ms_per_step_unprofiled": wall_plain * 1e3 / steps,
                "verifying_seqs_per_step": drafts / steps,
                "tokens_per_verify": 1 + (after.num_accepted_tokens - before.num_accepted_tokens) / max(drafts, 1),
                **_host_summary(prof, steps), "python_cumulative": python_cum})
    return res


def profile_mode(model: str, mode: str, args, hw: dict | None = None) -> dict:
    """One engine in `mode` ("eager" or "graphed", either with "-unfused": the engine built and run
    inside `ops.unfused()`, the decode-step fusions off: the launches before them)."""
    from mambaserve import ops

    if mode.endswith("-unfused"):
        with ops.unfused():
            return _profile_mode(model, mode.removesuffix("-unfused"), args, hw, mode)
    with ops.fused():  # the fusions are opt-in in the engine (ops.dispatch.DECODE_FUSIONS)
        return _profile_mode(model, mode, args, hw, mode)


def _profile_mode(model: str, mode: str, args, hw: dict | None, label: str) -> dict:
    import numpy as np
    import torch

    from mambaserve import LLM, SamplingParams
    from mambaserve.benchmarks.datasets import random_token_ids

    kw = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=max(args.input_len, 64 + 3 * args.decode_steps) + args.decode_steps + 16,
              gpu_memory_utilization=args.share,
              max_num_seqs=max(args.batch_size, args.mixed_decodes + args.decode_steps + 2, 8))
    if mode not in ("eager", "graphed"):
        raise ValueError(f"unknown mode {mode!r}: eager or graphed, each optionally with -unfused")
    if mode == "eager":
        kw["enforce_eager"] = True
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.speculative_k:
        from mambaserve.engine.spec_decode import FORCE_ACCEPT_ENV

        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.speculative_k,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        kw["max_model_len"] += 8 * (args.speculative_k + 1) * args.decode_steps
        os.environ[FORCE_ACCEPT_ENV] = "0.7"  # read when the engine is built
    t0 = time.perf_counter()
    try:
        llm = LLM(model, **kw)
    finally:
        if args.speculative_k:
            del os.environ[FORCE_ACCEPT_ENV]
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompts = [random_token_ids(rng, args.input_len, llm.llm_engine.vocab_size) for _ in range(args.batch_size)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], many, use_tqdm=False)  # warm-up (compiles)
    pre, pre_wall = _profile_run(llm, prompts, one)
    full, full_wall = _profile_run(llm, prompts, many)
    res = {"build_s": build_s, "prefill": _summary(pre, 1, pre_wall),
           "decode": _summary(_diff(full, pre), args.decode_steps, full_wall - pre_wall)}
    if args.mixed_decodes:
        res["mixed"] = _mixed_phase(llm, args, rng)
    if args.speculative_k:
        res["verify"] = _verify_phase(llm, args, rng)
    runner = llm.llm_engine.runner
    if hw is not None:
        try:
            shape = floor.model_shape(runner.model, ssm_itemsize=runner.ssm_dtype.itemsize)
        except ValueError as e:  # a family the floor does not model: the profile alone
            print(f"[{Path(model).stem}] no floor: {e}")
        else:
            add_floor(res, shape, args, runner.max_num_batched_tokens, hw)
    name = Path(model).stem + (f" {args.quantization}" if args.quantization else "")
    for phase in [p for p in ("prefill", "decode", "mixed", "verify") if p in res]:
        s = res[phase]
        extra = f", unprofiled wall {s['wall_ms_per_step_unprofiled']:.3f} ms/step" if phase in ("mixed", "verify") \
            else ""
        if phase == "verify":
            extra += f", {s['verifying_seqs_per_step']:.1f} verifying, {s['tokens_per_verify']:.2f} tokens/verify"
        print(f"[{name} {label} {phase}] wall {s['wall_ms_per_step']:.3f} ms/step, {s['kernels_per_step']:.1f} "
              f"kernels/step, kernel time {s['kernel_ms_per_step']:.3f} ms/step{extra}")
        for row in s["top"][:25 if phase == "decode" else 15]:
            print(f"    {row['us_per_step']:9.1f} us  x{row['count_per_step']:6.1f}  {row['group']:12s} "
                  f"{row['name'][:100]}")
        if phase in ("mixed", "verify"):
            if phase == "mixed":
                print(f"    step kinds: {s['step_kinds']}")
            for key in ("waits", "cuda_api", "host_ops"):
                for row in s[key][:12]:
                    print(f"    host {key:8s} {row['self_us_per_step']:9.1f} us  x{row['count_per_step']:7.1f}  "
                          f"{row['name'][:100]}")
            for row in s["python_cumulative"]:
                print(f"    python cum {row['cum_us_per_step']:9.1f} us self {row['self_us_per_step']:8.1f} us "
                      f"x{row['calls_per_step']:7.1f}  {row['function'][:90]}")
        if "floor" in s:
            launches = " ".join(f"{g} {n:.0f}" for g, n in sorted(s["group_launches_per_step"].items()))
            title = (f"[{name} {label} {phase} floor] {s['floor']['engine_steps']} engine step(s); "
                     f"{s['kernels_per_step']:.0f} launches per step ({launches})")
            print(floor.format_table(title, s["floor"]["rows"]))
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="granite-4.0-tiny-preview")
    ap.add_argument("--modes", default="eager,graphed")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--mixed-decodes", type=int, default=0,
                    help="also profile steps of this many decodes plus one new prompt of --input-len tokens")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="the engine's quantization (fp8: online, weights per output row; default: none)")
    ap.add_argument("--speculative-k", type=int, default=0,
                    help="also profile verify steps of this many n-gram drafts (70%% forced acceptance)")
    ap.add_argument("--share", type=float, default=0.4, help="gpu_memory_utilization of each engine")
    ap.add_argument("--no-floor", action="store_true", help="skip the hardware measurement and floor tables")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import torch

    model = args.model if os.path.exists(args.model) else str(REPO / "benchmarks" / "configs" / f"{args.model}.json")
    hw = None if args.no_floor or not torch.cuda.is_available() else measure_hardware()
    if hw:
        print(f"[hardware] copy {hw['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
              f"{hw['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model,
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "hardware": hw,
              "input_len": args.input_len, "quantization": args.quantization,
              "batch_size": args.batch_size, "decode_steps": args.decode_steps,
              "speculative_k": args.speculative_k, "modes": {}}
    for mode in args.modes.split(","):
        result["modes"][mode] = profile_mode(model, mode, args, hw)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=1))
    for line in summary_lines(result):
        print(line)
    return 0


def summary_lines(result: dict) -> list[str]:
    """One line per mode and phase: launches, kernel and wall time per step, the floor beside them."""
    lines = []
    for mode, res in result["modes"].items():
        for phase in [p for p in ("prefill", "decode", "mixed", "verify") if p in res]:
            s = res[phase]
            quant = f" {result['quantization']}" if result.get("quantization") else ""
            line = (f"[summary {result['model']}{quant} in{result['input_len']} bs{result['batch_size']} {mode} "
                    f"{phase}] "
                    f"{s['kernels_per_step']:.0f} launches/step, kernels {s['kernel_ms_per_step']:.3f} ms, "
                    f"wall {s['wall_ms_per_step']:.3f} ms")
            if "floor" in s:
                floor_ms = s["floor"]["rows"][-1]["floor_us"] / 1e3
                line += f", floor {floor_ms:.3f} ms (wall / floor {s['wall_ms_per_step'] / floor_ms:.2f})"
            lines.append(line)
    return lines


if __name__ == "__main__":
    sys.exit(main())
