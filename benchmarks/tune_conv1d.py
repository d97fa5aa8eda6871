"""Time every candidate launch config of the conv1d kernels on this GPU, check each against a
float64 reference, and write the config table the ops read (mambaserve/ops/configs/).

Shapes: the issue-20 cases (granite 1 x 31,500; bamba 8 x 1,024 with initial states; granite
4 x 2,000 prefills + 64 decodes in one launch; updates at batch 1 / 64 / 256 for granite and
bamba) and a spread of other model shapes (conv dims 1,024-16,384, widths 2-4, batches 1-512,
prompts 1-32k). Inputs are laid out as in the mixers: x a column slice of an in_proj-shaped
tensor, conv-state slots scattered over a pool with one padded (-1) entry per batch.

Timing as the peer benchmark's: a CUDA graph of 16 back-to-back calls, replayed 10 times
between CUDA events, median per call (L2 warm across the calls: the decode figures are
optimistic next to a model, where other layers run in between). Every config first runs once
on fresh copies of the state pool: output within 1e-2 (max |ours - ref| / max |ref|) of a float64
reference, updated slots equal to the reference's, every other slot bit-identical; a config
that fails is never chosen.

The table: token-block size per token class (the plan is shared by all layers of a step),
then the kernel config per (token class, dim class) for `causal_conv1d` and per (batch class,
dim class) for `causal_conv1d_update`; each the config of the least geometric-mean slowdown
against the per-shape best over the shapes of its class. Kernels are compiled first, in
parallel processes, into Triton's disk cache.

Usage (a GPU machine, from the checkout root, about 3-4 minutes on an H200):
  python3 benchmarks/tune_conv1d.py --out DIR [--only SUBSTRING] [--workers 16]
Writes DIR/conv1d_<gpu>.json (the table: copy it to mambaserve/ops/configs/ to commit it),
DIR/tune_conv1d.json (every timing) and DIR/tune_conv1d.md (the per-shape summary).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mambaserve import ops  # noqa: E402
from mambaserve.ops import conv1d, varlen  # noqa: E402
from mambaserve.ops import reference as ref  # noqa: E402

# model: (d_inner, n_groups * d_state, n_heads): conv dim d_inner + 2 G N, in_proj row 2 d_inner + 2 G N + H
MODELS = {
    "granite": (3072, 128, 48),  # granite-4.0-tiny-preview: conv 3328
    "bamba": (8192, 128, 128),  # bamba-9b: conv 8448
    "codestral": (8192, 1024, 128),  # mamba-codestral-7b (8 groups): conv 10240
    "m2-370m": (2048, 128, 32),  # mamba2-370m: conv 2304
    "m2-2.7b": (5120, 128, 80),  # mamba2-2.7b: conv 5376
    "d1024": (1024, 0, 0),  # Mamba-1 style (conv on x only), small
    "d16384": (16384, 0, 0),  # Mamba-1 style, wide
}
# vLLM 0.33 on the H200 (issue 20's table, the peer benchmark's warm figures), us
VLLM_US = {"varlen 1x31500 granite": 180.0, "varlen 8x1024 +init bamba": 117.0, "mixed 4x2000+64dec granite": 54.0,
           "update b1 granite": 1.7, "update b1 bamba": 1.7, "update b64 granite": 2.8, "update b64 bamba": 4.3,
           "update b256 granite": 6.0, "update b256 bamba": 12.2}
# class bounds of the table (None: unbounded)
TOKEN_CLASSES = [256, 4096, 8192, 16384, None]
DIM_CLASSES = [4096, None]
BATCH_CLASSES = [1, 16, 64, 256, None]


@dataclass
class Shape:
    name: str
    kind: str  # "varlen" or "update"
    model: str
    width: int
    lens: list  # varlen: sequence lengths (decodes first); update: [1] * batch
    has: list  # initial state per sequence

    @property
    def dims(self):
        d_inner, gn, h = MODELS[self.model]
        return d_inner + 2 * gn, 2 * d_inner + 2 * gn + h, d_inner  # conv dim, in_proj row, column offset

    @property
    def num_tokens(self):
        return sum(self.lens)

    @property
    def padded(self) -> bool:
        return len(self.lens) >= 8

    def compile_key(self, ci: int) -> tuple:
        """What Triton specializes a launch of candidate ci on (all dims and row strides here
        are multiples of 16): one compile per key is enough for the warm-up."""
        batch = len(self.lens)
        return (self.kind, self.width, ci) + ((batch == 1, batch % 16 == 0) if self.kind == "update" else ())

    def bytes(self) -> int:
        """The minimum bytes a call moves: x read, out written, state rows read where
        initial and written for every real sequence, weights and bias (bf16)."""
        dim = self.dims[0]
        n_init = sum(self.has)
        real = len(self.lens) - self.padded
        rows = 2 * self.num_tokens + (self.width - 1) * (n_init + real)
        return 2 * dim * (rows + self.width + 1)


def shapes() -> list[Shape]:
    def alt(n):
        return [i % 2 == 0 for i in range(n)]

    s = [
        Shape("varlen 1x31500 granite", "varlen", "granite", 4, [31500], [False]),
        Shape("varlen 8x1024 +init bamba", "varlen", "bamba", 4, [1024] * 8, [True] * 8),
        Shape("mixed 4x2000+64dec granite", "varlen", "granite", 4, [1] * 64 + [2000] * 4, [True] * 64 + alt(4)),
        Shape("varlen 1x32768 d1024", "varlen", "d1024", 4, [32768], [False]),
        Shape("varlen 1x8192 m2-370m", "varlen", "m2-370m", 4, [8192], [False]),
        Shape("varlen 16x512 +init m2-2.7b", "varlen", "m2-2.7b", 4, [512] * 16, [True] * 16),
        Shape("varlen 1x16384 codestral", "varlen", "codestral", 4, [16384], [False]),
        Shape("varlen 2x2048 d16384", "varlen", "d16384", 4, [2048] * 2, [False, True]),
        Shape("varlen 1x4096 granite w2", "varlen", "granite", 2, [4096], [False]),
        Shape("varlen 1x4096 granite w3", "varlen", "granite", 3, [4096], [False]),
        Shape("varlen 1x17 bamba", "varlen", "bamba", 4, [17], [True]),
        Shape("varlen 64x100 granite", "varlen", "granite", 4, [100] * 64, alt(64)),
        Shape("mixed 8x300+256dec bamba", "varlen", "bamba", 4, [1] * 256 + [300] * 8, [True] * 256 + alt(8)),
        Shape("varlen 128 decodes granite", "varlen", "granite", 4, [1] * 128, [True] * 128),
    ]
    for batch in (1, 64, 256):
        for model in ("granite", "bamba"):
            s.append(Shape(f"update b{batch} {model}", "update", model, 4, [1] * batch, [True] * batch))
    for batch, model, width in ((1, "d1024", 4), (8, "m2-2.7b", 4), (32, "codestral", 4), (128, "d16384", 4),
                                (512, "granite", 4), (512, "d1024", 4), (16, "granite", 2), (256, "granite", 3),
                                (4, "bamba", 4)):
        s.append(Shape(f"update b{batch} {model}" + (f" w{width}" if width != 4 else ""), "update", model, width,
                       [1] * batch, [True] * batch))
    return s


class Inputs:
    """The tensors of one shape on the GPU; `scale` < 1 shrinks the prompts (compile warm-up)."""

    def __init__(self, shape: Shape, scale: float = 1.0, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dim, row, col = shape.dims
        lens = [max(1, int(n * scale)) if n > 1 else n for n in shape.lens]
        self.T = T = sum(lens)
        batch = len(lens)
        self.qsl_host = varlen.check_offsets([0] + [sum(lens[:i + 1]) for i in range(batch)])
        self.qsl = torch.tensor(self.qsl_host, dtype=torch.int32, device="cuda")
        num_slots = batch + 8
        perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:batch].to(torch.int32)
        if shape.padded:
            perm[batch // 2] = -1  # one padded entry (CUDA-graph padding)
        self.idx = perm.cuda()
        self.has = torch.tensor(shape.has, device="cuda")
        zx = torch.randn(T, row, device="cuda", generator=g).to(torch.bfloat16)
        self.x = zx[:, col:col + dim]
        self.w = (torch.randn(dim, shape.width, device="cuda", generator=g) / math.sqrt(shape.width)).to(torch.bfloat16)
        self.b = (0.1 * torch.randn(dim, device="cuda", generator=g)).to(torch.bfloat16)
        self.states = torch.randn(num_slots, shape.width - 1, dim, device="cuda", generator=g).to(torch.bfloat16)
        self.kind = shape.kind

    def call(self, cfg: dict, states: torch.Tensor, blocks=None):
        if self.kind == "update":
            with conv1d.config_override(update=cfg):
                return ops.causal_conv1d_update(self.x, states, self.w, self.b, self.idx, "silu")
        with conv1d.config_override(varlen=cfg):
            return ops.causal_conv1d(self.x, self.w, self.b, states, self.qsl, self.idx, self.has, "silu",
                                     blocks=blocks)

    def blocks(self, cfg: dict):
        if self.kind == "update":
            return None
        return varlen.conv_token_blocks(self.qsl_host, cfg["block_t"], "cuda")

    def reference(self):
        """(output, states) of the float64 reference on a copy of the pool."""
        states = self.states.double()
        if self.kind == "update":
            out = ref.causal_conv1d_update(self.x.double(), states, self.w.double(), self.b.double(), self.idx, "silu")
        else:
            out = ref.causal_conv1d(self.x.double(), self.w.double(), self.b.double(), states, self.qsl, self.idx,
                                    self.has, "silu")
        return out, states


def candidates(shape: Shape) -> list[dict]:
    return conv1d.UPDATE_CANDIDATES if shape.kind == "update" else conv1d.VARLEN_CANDIDATES


def _warm(jobs) -> int:
    """Compile (shape index, config index) jobs on shrunken inputs of the same layout."""
    all_shapes = shapes()
    n = 0
    for si, ci in jobs:
        shape = all_shapes[si]
        cfg = candidates(shape)[ci]
        inp = Inputs(shape, scale=0.01)
        try:
            inp.call(cfg, inp.states.clone(), inp.blocks(cfg))
            n += 1
        except Exception as e:  # noqa: BLE001  (reported again, with the traceback, by the timing pass)
            print(f"warm-up {shape.name} {cfg}: {type(e).__name__}: {e}", flush=True)
    torch.cuda.synchronize()
    return n


def graph_us(fn, calls: int = 16, replays: int = 10) -> float:
    """Median device time of one call: a CUDA graph of `calls` calls, replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written, after the clocks come up."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):
        dst.copy_(src)
    us = graph_us(lambda: dst.copy_(src), calls=4, replays=10)
    return 2 * 2**30 / (us * 1e-6) / 1e9


def check(inp: Inputs, cfg: dict, expected) -> float:
    """rel err of one call on a fresh pool; raises AssertionError on a state mismatch."""
    out_ref, states_ref = expected
    states = inp.states.clone()
    out = inp.call(cfg, states, inp.blocks(cfg))
    torch.cuda.synchronize()
    T = inp.T
    err = float((out[:T].double() - out_ref[:T]).abs().max() / out_ref[:T].abs().max())
    written = {int(i) for i in inp.idx.tolist() if i >= 0}
    for slot in range(states.shape[0]):
        want = states_ref[slot].to(torch.bfloat16) if slot in written else inp.states[slot]
        what = "differs from the reference" if slot in written else "changed"
        assert torch.equal(states[slot], want), f"slot {slot} {what}"
    return err


def _class_index(bounds, v):
    return next(i for i, b in enumerate(bounds) if b is None or v <= b)


def _geo_slowdown(rows, cfg_key, best):
    ratios = [r["us"][cfg_key] / best[r["name"]] for r in rows if cfg_key in r["us"]]
    if len(ratios) < len(rows):
        return math.inf  # failed (or was not timed) somewhere in the class
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios))


def build_table(results: list[dict], gpu: str) -> dict:
    """The config table from per-shape timings (see the module docstring)."""
    best = {r["name"]: min(r["us"].values()) for r in results if r["us"]}
    var = [r for r in results if r["kind"] == "varlen" and r["us"]]
    upd = [r for r in results if r["kind"] == "update" and r["us"]]
    key = json.dumps
    table = {"gpu": gpu, "measured": True, "source": "benchmarks/tune_conv1d.py", "triton": _triton_version(),
             "varlen_block_t": [], "varlen": [], "update": []}
    for ti, tb in enumerate(TOKEN_CLASSES):
        rows = [r for r in var if _class_index(TOKEN_CLASSES, r["num_tokens"]) == ti]
        if not rows:
            continue
        block_ts = sorted({c["block_t"] for c in conv1d.VARLEN_CANDIDATES})

        def bt_score(bt, rows=rows):
            per = []
            for r in rows:
                ok = [v for k, v in r["us"].items() if json.loads(k)["block_t"] == bt]
                per.append(min(ok) / best[r["name"]] if ok else math.inf)
            return math.exp(sum(math.log(x) for x in per) / len(per))

        bt = min(block_ts, key=bt_score)
        table["varlen_block_t"].append({"max_tokens": tb, "block_t": bt})
        for di, db in enumerate(DIM_CLASSES):
            drows = [r for r in rows if _class_index(DIM_CLASSES, r["dim"]) == di] or rows
            cfgs = [c for c in conv1d.VARLEN_CANDIDATES if c["block_t"] == bt]
            choice = min(cfgs, key=lambda c, drows=drows: _geo_slowdown(drows, key(c), best))
            table["varlen"].append({"max_tokens": tb, "max_dim": db,
                                    "config": {k: v for k, v in choice.items() if k != "block_t"}})
    for bi, bb in enumerate(BATCH_CLASSES):
        rows = [r for r in upd if _class_index(BATCH_CLASSES, r["num_tokens"]) == bi]
        if not rows:
            continue
        for di, db in enumerate(DIM_CLASSES):
            drows = [r for r in rows if _class_index(DIM_CLASSES, r["dim"]) == di] or rows
            choice = min(conv1d.UPDATE_CANDIDATES, key=lambda c, drows=drows: _geo_slowdown(drows, key(c), best))
            table["update"].append({"max_batch": bb, "max_dim": db, "config": dict(choice)})
    # the last entry of each list must be unbounded: widen it if its class had no shape
    for name, bound in (("varlen_block_t", "max_tokens"), ("varlen", "max_tokens"), ("update", "max_batch")):
        last = table[name][-1][bound]
        for e in table[name]:
            if e[bound] == last:
                e[bound] = None
    conv1d.check_table(table)
    return table


def _triton_version() -> str:
    import triton

    return triton.__version__


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--only", action="append", help="shapes whose name contains this (repeatable)")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--budget-s", type=float, default=230.0, help="stop timing new shapes after this")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_conv1d.py needs a CUDA GPU")
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    all_shapes = shapes()
    chosen = [i for i, s in enumerate(all_shapes) if not args.only or any(o in s.name for o in args.only)]

    # 1. compile everything, in parallel processes sharing Triton's disk cache
    jobs = {}
    for si in chosen:
        for ci in range(len(candidates(all_shapes[si]))):
            jobs.setdefault(all_shapes[si].compile_key(ci), (si, ci))
    jobs = list(jobs.values())
    if args.workers > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.workers) as pool:
            done = sum(pool.map(_warm, [jobs[i::args.workers] for i in range(args.workers)]))
    else:
        done = _warm(jobs)
    print(f"compiled {done}/{len(jobs)} kernel variants in {time.time() - t_start:.0f} s", flush=True)

    bw = copy_bandwidth_gbs()
    print(f"{gpu}: device-to-device copy {bw:.0f} GB/s (read + write)", flush=True)

    # 2. check and time every config of every shape
    results = []
    for si in chosen:
        shape = all_shapes[si]
        if time.time() - t_start > args.budget_s:
            print(f"budget spent: {shape.name} and later shapes not timed", flush=True)
            break
        inp = Inputs(shape)
        expected = inp.reference()
        row = {"name": shape.name, "kind": shape.kind, "model": shape.model, "width": shape.width,
               "dim": shape.dims[0], "num_tokens": shape.num_tokens, "batch": len(shape.lens),
               "bytes": shape.bytes(), "us": {}, "err": {}, "failed": {}}
        for cfg in candidates(shape):
            k = json.dumps(cfg)
            try:
                err = check(inp, cfg, expected)
                row["err"][k] = err
                if not err < 1e-2:
                    raise AssertionError(f"rel err {err:.2e} vs the float64 reference")
                states = inp.states.clone()
                blocks = inp.blocks(cfg)
                row["us"][k] = graph_us(lambda i=inp, c=cfg, st=states, bl=blocks: i.call(c, st, bl))
            except Exception as e:  # noqa: BLE001
                row["failed"][k] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  FAILED {shape.name} {cfg}: {row['failed'][k]}", flush=True)
        if row["us"]:
            k_best = min(row["us"], key=row["us"].get)
            us = row["us"][k_best]
            row["best"] = json.loads(k_best)
            row["best_us"] = us
            row["best_frac_copy_bw"] = shape.bytes() / (us * 1e-6) / 1e9 / bw
            print(f"{shape.name:34s} best {us:8.2f} us {100 * row['best_frac_copy_bw']:5.1f}% bw  {k_best}", flush=True)
        results.append(row)
        del inp, expected
        torch.cuda.empty_cache()

    # 3. the table, and each shape's time under it (the raw timings are saved first)
    record = {"gpu": gpu, "copy_bandwidth_GBps": bw, "timing": "CUDA graph of 16 calls, median of 10 replays",
              "shapes": [asdict(s) for s in all_shapes], "results": results}
    with open(os.path.join(args.out, "tune_conv1d.json"), "w") as f:
        json.dump(record, f, indent=1)
    table = build_table(results, gpu)
    lines = [f"# conv1d launch configs on {gpu} (copy bandwidth {bw:.0f} GB/s)", "",
             "| shape | best us | table us | %BW | vLLM us | vLLM/table | best config |",
             "|---|---|---|---|---|---|---|"]
    for row in results:
        if not row["us"]:
            continue
        shape = next(s for s in all_shapes if s.name == row["name"])
        if shape.kind == "update":
            cfg = conv1d.update_config(table, len(shape.lens), row["dim"], shape.width)
        else:
            cfg = conv1d.varlen_config(table, shape.num_tokens, row["dim"], shape.width)
        # the timings are keyed by each candidate's JSON, whose key order the table's configs need not share
        t_us = next((us for k, us in row["us"].items() if json.loads(k) == cfg), None)
        row["table_config"], row["table_us"] = cfg, t_us
        v = VLLM_US.get(row["name"])
        frac = 100 * row["bytes"] / (t_us * 1e-6) / 1e9 / bw if t_us else float("nan")
        lines.append(f"| {row['name']} | {row['best_us']:.2f} | {t_us if t_us is None else round(t_us, 2)} | "
                     f"{frac:.0f} | {v or '-'} | {(v / t_us) if v and t_us else float('nan'):.2f} | {row['best']} |")
    gpu_file = conv1d.gpu_table_name(gpu)
    with open(os.path.join(args.out, gpu_file), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(args.out, "tune_conv1d.json"), "w") as f:
        json.dump({**record, "table": table}, f, indent=1)
    with open(os.path.join(args.out, "tune_conv1d.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}/{gpu_file}, tune_conv1d.json, tune_conv1d.md in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
