"""Bring the mambaserve side of the peer kernel harness (`../shared/peer/`, assembled into
`.peer/` by its `assemble.sh`) up to today's op interface.

The harness calls our kernels through `ours_*` functions in its `peer_adapters.py`, written
against an earlier interface (`mamba_chunk_scan`, `selective_state_update`, a `metadata=`
dict, `fused_moe_triton`). This script replaces that section of the assembled copy with
adapters over the current ops; the vLLM side is left as assembled. Per-step plans (the conv
token blocks, the SSD chunks) are built on the first call and kept in the harness's metadata
dict, as the engine builds them once per step (`ForwardContext`) and not once per layer, so the
timed calls see what a layer sees.

    bash ../shared/peer/assemble.sh && python benchmarks/peer_patch.py .peer/peer/peer_adapters.py

Raises SystemExit if the file has no mambaserve section to replace (a harness of another
layout: read it before patching).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

BEGIN = "# --- mambaserve ---"
END = "# --- vLLM: modules"

OURS = '''# --- mambaserve ----------------------------------------------------------------------------
# (replaced by mambaserve's benchmarks/peer_patch.py: adapters over today's op interface)

def ms_ops():
    import mambaserve.ops as ops

    return ops


def _planned(metadata, key, build):
    """A per-step plan kept in the harness's metadata dict (built on the first call)."""
    if key not in metadata:
        metadata[key] = build()
    return metadata[key]


def ours_conv1d(x, w, b, conv_states, qsl, idx, has_init, metadata):
    ops = ms_ops()
    from mambaserve.ops import conv1d
    from mambaserve.ops.varlen import check_offsets, conv_token_blocks

    def build():
        offsets = check_offsets(list(metadata["query_start_loc_host"]))
        block_t = conv1d.varlen_block_t(conv1d.table_for(x.device), int(offsets[-1]))
        return conv_token_blocks(offsets, block_t, x.device)

    blocks = _planned(metadata, "conv_blocks", build)
    with ops.backend("triton"):
        return ops.causal_conv1d(x, w, b, conv_states, qsl, idx, has_init, "silu", blocks=blocks)


def ours_conv1d_update(x, conv_states, w, b, idx):
    ops = ms_ops()
    with ops.backend("triton"):
        return ops.causal_conv1d_update(x, conv_states, w, b, idx, "silu")


def ours_ssd(x, dt, A, B, C, chunk, D, dt_bias, ssm_states, qsl, idx, has_init, metadata):
    ops = ms_ops()
    from mambaserve.ops.varlen import check_offsets, ssd_chunks

    chunks = _planned(metadata, ("ssd_chunks", chunk), lambda: ssd_chunks(
        check_offsets(list(metadata["query_start_loc_host"])), chunk, x.device))
    with ops.backend("triton"):
        return ops.ssd_chunk_scan(x, dt, A, B, C, chunk, D, None, dt_bias, ssm_states, qsl, idx, has_init,
                                  dt_softplus=True, chunks=chunks)


def ours_ssu(ssm_states, x, dt, A, B, C, D, dt_bias, idx):
    ops = ms_ops()
    with ops.backend("triton"):
        return ops.ssd_state_update(ssm_states, x, dt, A, B, C, D, None, dt_bias, idx, dt_softplus=True)


def ours_rms_norm_gated(x, w, z, eps, group_size):
    ops = ms_ops()
    with ops.backend("triton"):
        return ops.rms_norm_gated(x, w, z, eps, group_size, norm_before_gate=False)


def ours_fused_moe(h, w1, w2, topk_weights, topk_ids, impl=None):
    """The public op (impl=None: what the engine runs, the op's own choice); impl forces one of
    mambaserve.ops.moe's paths ("direct", "grouped_mm", "triton")."""
    ops = ms_ops()
    with ops.backend("triton"):
        return ops.fused_moe(h, w1, w2, topk_weights, topk_ids, impl=impl)


def ours_moe_impl(num_tokens: int, top_k: int, h, w1, w2) -> str:
    """Which path mambaserve's fused_moe takes for this call (for the report): its own rule."""
    from mambaserve.ops import moe

    num_experts = w1.shape[0]
    if num_tokens * top_k <= moe.DIRECT_MAX_PAIRS:
        return "direct"
    if num_tokens * top_k > moe.GROUPED_MM_MIN_ROWS_PER_EXPERT * num_experts and moe._grouped_mm_usable(h, w1, w2):
        return "grouped_mm"
    return "triton"


'''


def patch(text: str) -> str:
    """`text` (a peer_adapters.py) with its mambaserve section replaced by OURS."""
    m = re.search(re.escape(BEGIN) + r".*?(?=^" + re.escape(END) + ")", text, flags=re.S | re.M)
    if m is None:
        raise SystemExit(f"no section from {BEGIN!r} to {END!r}: not the harness layout this script knows")
    return text[:m.start()] + OURS + text[m.end():]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("adapters", type=Path, help="the assembled harness's peer_adapters.py")
    args = ap.parse_args()
    args.adapters.write_text(patch(args.adapters.read_text()))
    print(f"patched the mambaserve adapters of {args.adapters}")


if __name__ == "__main__":
    main()
