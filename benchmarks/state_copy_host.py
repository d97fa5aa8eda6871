"""Host time of a state-row copy on the GPU: ops.copy_state_rows (one launch per state stack)
against the per-layer multi-tensor copy it replaced, for 1 and 32 (src, dst) pairs over the
state shapes of granite-4.0-tiny-preview (36 layers, bf16); also its two parts (the index copy,
the launches) and the device time of 20 back-to-back calls. Writes $OUT/state-copy-host.json.

    PYTHONPATH=. python3 benchmarks/state_copy_host.py   # on a GPU machine, from the checkout root
"""

import json
import os
import time

import torch

from mambaserve.cache.spec import CacheSpec, MambaSpec
from mambaserve.cache.tensors import allocate_caches
from mambaserve.ops import copy_state_rows
from mambaserve.ops import state_copy as sc
from mambaserve.ops.common import pack_to_device


def host_us(fn, n: int = 300) -> float:
    """Host microseconds a call of fn, over n calls without a sync between them."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def measure(caches, num_pairs: int) -> dict:
    stacks = caches.state_stacks
    pairs = [(200 + i, i) for i in range(num_pairs)]
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    src_t, dst_t = pack_to_device([src, dst], "cuda")
    views = {r: [t[r] for layer in caches.mamba for t in layer] for r in src + dst}

    def launches():
        for s in stacks:
            n = s[0, 0].numel()
            sc._copy_state_rows_kernel[(num_pairs, s.shape[0], -(-n // sc.BLOCK))](
                s, src_t, dst_t, s.stride(0), s.stride(1), n, BLOCK=sc.BLOCK, num_warps=8)

    def per_layer():
        torch._foreach_copy_([v for d in dst for v in views[d]], [v for s in src for v in views[s]])

    res = {"copy_state_rows": host_us(lambda: copy_state_rows(stacks, pairs)),
           "pack_to_device": host_us(lambda: pack_to_device([src, dst], "cuda")),
           "two_launches_prebuilt_indices": host_us(launches),
           "foreach_per_layer_views": host_us(per_layer)}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        copy_state_rows(stacks, pairs)
    b.record()
    b.synchronize()
    res["device_us_copy_state_rows"] = a.elapsed_time(b) / 20 * 1e3
    return res


def main() -> None:
    layer = MambaSpec((3, 3328), (48, 64, 128), torch.bfloat16, torch.bfloat16)
    caches = allocate_caches(CacheSpec(mamba=[layer] * 36, attention=[]), num_slots=300, num_blocks=1,
                             block_size=16, device="cuda")
    res = {n: measure(caches, n) for n in (1, 32)}
    print(json.dumps(res, indent=1))
    rec = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MAMBASERVE_COMMIT"),
           "case": "granite-4.0-tiny-preview state shapes, 36 layers, bf16", "host_us_per_call": res}
    with open(os.path.join(os.environ.get("OUT", "."), "state-copy-host.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
