"""Where a small step's host time goes: granite-4.0-tiny-preview (dummy weights, bf16, prefix
caching on), timed by wrapping the engine's, runner's, ops' and Triton's launch functions with
host timers (no device sync inside), for three runs after a warm-up: a resumed prefill of 384
tokens after 7,936 cached ones (resume384), a fresh 16-token prefill (fresh16), and 32 decode
steps (decode). Prints, per run, calls and milliseconds of each wrapped function (nested: the
figures overlap) and writes $OUT/diag-timeline.json.

    python3 benchmarks/host_time.py      # on a GPU machine, from the checkout root
"""

import collections
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch
import triton

from mambaserve import LLM, ops
from mambaserve.forward_context import ForwardContext
from mambaserve.sampling_params import SamplingParams

ACC = collections.defaultdict(lambda: [0, 0.0])
ON = [False]


def timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        if not ON[0]:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[name][0] += 1
            ACC[name][1] += time.perf_counter() - t

    return w


llm = LLM(
    model="benchmarks/configs/granite-4.0-tiny-preview.json",
    dtype="bfloat16",
    load_format="dummy",
    max_model_len=8960,
    skip_tokenizer_init=True,
    seed=0,
    gpu_memory_utilization=0.42,
)
eng = llm.llm_engine
r = eng.runner
for obj, names in (
    (eng.scheduler, ["schedule"]),
    (r, ["prepare", "_context", "_forward", "_copy_states", "_needed_logits", "execute"]),
    (eng, ["_update", "_sample", "_launch_next", "add_request"]),
    (eng.sampler, ["launch"]),
    (r.model, ["compute_logits"]),
    (r.piecewise_graphs, ["run"]),
):
    for n in names:
        if hasattr(obj, n):
            setattr(obj, n, timed(f"{type(obj).__name__}.{n}", getattr(obj, n)))
        else:
            print("missing", type(obj).__name__, n)
for n in ["conv_blocks", "ssd_chunks", "attention_plan", "build"]:
    f = getattr(ForwardContext, n)
    setattr(ForwardContext, n, classmethod(timed("ctx." + n, f.__func__)) if n == "build" else timed("ctx." + n, f))
for n in ["ssd_chunk_scan", "causal_conv1d", "paged_attention", "reshape_and_cache", "rms_norm_gated"]:
    if hasattr(ops, n):
        setattr(ops, n, timed("ops." + n, getattr(ops, n)))
torch.cuda.CUDAGraph.replay = timed("CUDAGraph.replay", torch.cuda.CUDAGraph.replay)
triton.runtime.jit.JITFunction.run = timed("triton.run", triton.runtime.jit.JITFunction.run)
for piece in r.piecewise_graphs.pieces.values():
    piece.holes = [(timed("hole." + getattr(fn, "__qualname__", "?"), fn), a, o) for fn, a, o in piece.holes]
torch.empty = timed("torch.empty", torch.empty)

g = torch.Generator().manual_seed(0)
V = eng.vocab_size


def rand(n):
    return torch.randint(1, V, (n,), generator=g).tolist()


def run(prompt, tag, mt=1):
    eng.add_request(
        tag,
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True),
        final_only=True,
    )
    time.perf_counter()
    steps = []
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        eng.step()
        steps.append(round((time.perf_counter() - ts) * 1e3, 2))
    return steps


res = {}
for i in range(3):  # warm
    a = rand(8064)
    run(a, f"w{i}")
    run(a + rand(256), f"w{i}b")
for kind in ("resume384", "fresh16", "decode"):
    a = rand(8064)
    run(a, f"{kind}-base")
    ACC.clear()
    torch.cuda.synchronize()
    ON[0] = True
    t = time.perf_counter()
    if kind == "resume384":
        steps = run(a + rand(256), kind)
    elif kind == "fresh16":
        steps = run(rand(16), kind)
    else:
        steps = run(rand(16), kind, mt=33)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    ON[0] = False
    res[kind] = {
        "wall_ms": wall,
        "steps_ms": steps[:6],
        "acc": sorted(((k, v[0], round(v[1] * 1e3, 3)) for k, v in ACC.items()), key=lambda x: -x[2]),
    }
    print(kind, "wall", round(wall, 2), "steps", steps[:6], flush=True)
    for k, n, ms in res[kind]["acc"][:32]:
        print(f"   {k:45s} {n:6d} {ms:9.3f} ms", flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/diag-timeline.json", "w"), indent=1)
