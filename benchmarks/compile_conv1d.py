"""Compile every conv1d kernel and candidate launch config for an H200 (sm_90) on a machine
without a GPU, at real model shapes, through the public ops; report registers, spills and the
order of global loads and stores in the SASS.

Triton's active driver is replaced by one that reports a Hopper target, and each op runs on CPU
tensors that report is_cuda: the launcher takes its GPU path (programmatic dependent launch
included), Triton specializes and compiles (ptxas included) and the launch returns without
running. Nothing is computed. The SASS summary is what to look at when a config is slow: "L"
and "S" are global loads and stores in program order, so "LLLLSSSS" means the loads of a
group are all in flight before the first store, "LSLSLS" one memory latency per row.

Usage: TRITON_INTERPRET unset,  python3 benchmarks/compile_conv1d.py [--only roll|tile|update]
       [--sass] [--shapes granite|bamba|all]   (about 1-3 s per compile on one core)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("compile_conv1d.py compiles for real: unset TRITON_INTERPRET")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from mambaserve import ops  # noqa: E402
from mambaserve.ops import conv1d, varlen  # noqa: E402

SHAPES = {  # model: (conv dim, in_proj row width), bf16
    "granite": (3328, 6448),
    "bamba": (8448, 16768),
}


class _HopperDriver:
    """What JITFunction.run asks of the active driver, for an sm_90 target."""

    def __init__(self):
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


class _FakeCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


LAST: list = []


def _install() -> None:
    driver.set_active(_HopperDriver())
    orig_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        LAST.append(kernel)
        return kernel

    jit.JITFunction.run = run


def _fake(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_FakeCuda)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_summary(kernel) -> str:
    """registers, spills and the L/S order of global memory instructions of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    spill = re.findall(r"(\d+) bytes spill", res)
    order = "".join("L" if "LDG" in ln else "S" for ln in sass.splitlines() if re.search(r"\b(LDG|STG)\b", ln))
    vec = sorted(set(re.findall(r"LDG\.E(\.\w+)?", sass)))
    return f"regs {regs.group(1) if regs else '?'} spill {'/'.join(spill) or '0'} ldg {vec} order {order[:80]}"


def varlen_call(dim: int, row: int, width: int, cfg: dict) -> None:
    lens = [100, 1, 37]
    qsl_host = varlen.check_offsets([0, 100, 101, 138])
    T = 138
    x = _fake(torch.empty(T, row, dtype=torch.bfloat16))[:, row - dim - 64:row - 64]
    w = _fake(torch.empty(dim, width, dtype=torch.bfloat16))
    b = _fake(torch.empty(dim, dtype=torch.bfloat16))
    states = _fake(torch.empty(len(lens) + 4, width - 1, dim, dtype=torch.bfloat16))
    qsl = _fake(torch.tensor(qsl_host, dtype=torch.int32))
    idx = _fake(torch.tensor([3, -1, 1], dtype=torch.int32))
    has = _fake(torch.tensor([True, False, True]))
    with conv1d.config_override(varlen=cfg), ops.backend("triton"):
        blocks = varlen.conv_token_blocks(qsl_host, cfg["block_t"], "cpu")
        blocks = varlen.TokenBlocks(blocks.block_t, blocks.batch, blocks.num_blocks, blocks.num_tokens,
                                    _fake(blocks.block_seq), _fake(blocks.block_start))
        ops.causal_conv1d(x, w, b, states, qsl, idx, has, "silu", blocks=blocks)


def update_call(dim: int, row: int, width: int, cfg: dict) -> None:
    batch = 64
    x = _fake(torch.empty(batch, row, dtype=torch.bfloat16))[:, row - dim - 64:row - 64]
    w = _fake(torch.empty(dim, width, dtype=torch.bfloat16))
    b = _fake(torch.empty(dim, dtype=torch.bfloat16))
    states = _fake(torch.empty(batch + 8, width - 1, dim, dtype=torch.bfloat16))
    idx = _fake(torch.arange(batch, dtype=torch.int32))
    with conv1d.config_override(update=cfg), ops.backend("triton"):
        ops.causal_conv1d_update(x, states, w, b, idx, "silu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["roll", "tile", "update"], action="append")
    p.add_argument("--shapes", default="granite", choices=["granite", "bamba", "all"])
    p.add_argument("--widths", default="4", help="comma-separated conv widths (default 4)")
    p.add_argument("--sass", action="store_true", help="print the SASS summary of each kernel")
    args = p.parse_args()
    _install()
    shapes = SHAPES if args.shapes == "all" else {args.shapes: SHAPES[args.shapes]}
    widths = [int(w) for w in args.widths.split(",")]
    jobs = []
    for name, (dim, row) in shapes.items():
        for width in widths:
            for cfg in conv1d.VARLEN_CANDIDATES:
                if not args.only or cfg["kernel"] in args.only:
                    jobs.append((f"varlen {name} w{width} {cfg}", varlen_call, dim, row, width, cfg))
            if not args.only or "update" in args.only:
                for cfg in conv1d.UPDATE_CANDIDATES:
                    jobs.append((f"update {name} w{width} {cfg}", update_call, dim, row, width, cfg))
    print(f"triton {triton.__version__}, target sm_90, {len(jobs)} launches", flush=True)
    failed = 0
    t_all = time.time()
    for label, fn, dim, row, width, cfg in jobs:
        LAST.clear()
        t0 = time.time()
        try:
            fn(dim, row, width, cfg)
            info = sass_summary(LAST[-1]) if args.sass and LAST else ""
            print(f"ok   {time.time() - t0:5.1f} s  {label}  {info}", flush=True)
        except Exception as e:  # noqa: BLE001  (a config that does not compile is reported, the rest go on)
            failed += 1
            print(f"FAIL {time.time() - t0:5.1f} s  {label}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    print(f"== {len(jobs) - failed}/{len(jobs)} compiled in {time.time() - t_all:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
