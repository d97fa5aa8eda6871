"""NCCL collectives inside CUDA graphs, as the tensor-parallel decode and piecewise graphs hold
them (GPU only). One GPU is enough: a world of one NCCL rank, in a fresh process (the test
process must stay outside any torch.distributed world), captures an all-reduce and an
all-gather issued as the engine's collectives issue them (synchronous, on the capturing side
stream) and replays them on new inputs."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from mambaserve.distributed import init_tensor_parallel, destroy_tensor_parallel
    from mambaserve.distributed.communication import _all_gather_single

    group = init_tensor_parallel(0, 1, local_rank=0, device_type="cuda", init_method=sys.argv[1])
    x = torch.zeros(4, 8, device="cuda")
    gathered = torch.empty(4, 8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x * 2  # warm-up outside the capture, as the graph runners do
        dist.all_reduce(y, group=group.device_group)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = x * 2
            dist.all_reduce(y, group=group.device_group)  # a rank's row-parallel sum
            _all_gather_single(gathered, y + 1, group=group.device_group)  # the vocabulary-parallel logits
    torch.cuda.current_stream().wait_stream(stream)
    for value in (1.0, 3.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(y, 2 * value)), y
        assert torch.equal(gathered, torch.full_like(y, 2 * value + 1)), gathered
    destroy_tensor_parallel()
    print("CAPTURED")
""")


def test_gpu_nccl_collectives_replay_in_a_cuda_graph():
    from mambaserve.distributed.launch import free_local_port

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, f"tcp://127.0.0.1:{free_local_port()}"], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "CAPTURED" in out.stdout, out.stderr[-4000:]
