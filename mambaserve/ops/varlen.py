"""Host-side metadata for kernels over variable-length packed batches.

A packed batch holds sequence i in rows `query_start_loc[i]:query_start_loc[i+1]`. Kernels that
split sequences into fixed-size pieces (token blocks of the conv, chunks of the SSD scan) need
the list of pieces; it is the same for every layer of a step, so it is built once on the host
and cached in the per-step `metadata` dict that the forward context passes to every layer.

Cache entries are keyed by what they depend on (e.g. ``("ssd_chunks", 256)``) and remember the
`query_start_loc` tensor they were built from: a dict reused with another tensor recomputes.
Reading `query_start_loc` on the host costs one device sync per step; a caller that already
has the offsets as a Python list stores them under ``"query_start_loc_host"`` (the key the
attention op reads too) to avoid it.

This module knows nothing about models or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QSL_HOST_KEY = ("query_start_loc", "host")  # our cache of the offsets on the host, checked
QSL_HOST_LIST = "query_start_loc_host"  # offsets the caller already has on the host (a list)


def _cached(metadata: dict | None, key, query_start_loc: torch.Tensor, build):
    if metadata is None:
        return build()
    entry = metadata.get(key)
    if entry is not None and entry[0] is query_start_loc:
        return entry[1]
    value = build()
    metadata[key] = (query_start_loc, value)
    return value


def _check_offsets(qsl) -> None:
    """Raise ValueError unless the offsets qsl (batch + 1,) start at 0 or later and never
    decrease. Kernels index rows by these offsets; a bad one reads and writes out of bounds
    (each launcher also checks that the last offset is within its input's rows)."""
    qsl = np.asarray(qsl, dtype=np.int64)
    if qsl.size and (qsl[0] < 0 or (np.diff(qsl) < 0).any()):
        raise ValueError(f"query_start_loc must be non-negative and non-decreasing, got {qsl.tolist()}")


def query_start_loc_host(query_start_loc: torch.Tensor, metadata: dict | None) -> np.ndarray:
    """query_start_loc as an int64 numpy array (batch + 1,): the caller's host copy when the
    metadata holds one, else read from the device; converted and checked once per step (cached
    in the metadata). Raises ValueError when the host copy does not match the batch size or the
    offsets decrease or start below 0."""
    def build():
        if metadata is not None and QSL_HOST_LIST in metadata:
            host = np.asarray(metadata[QSL_HOST_LIST], dtype=np.int64)
            if host.shape != (query_start_loc.numel(),):
                raise ValueError(f"metadata[{QSL_HOST_LIST!r}] has {host.size} offsets, the batch has "
                                 f"{query_start_loc.numel()}")
        else:
            host = np.asarray(query_start_loc.tolist(), dtype=np.int64)
        _check_offsets(host)
        return host

    return _cached(metadata, QSL_HOST_KEY, query_start_loc, build)


def _to_device(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """One host-to-device copy for several int32 arrays; returns views into it."""
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    packed = torch.from_numpy(flat).to(device)
    out, pos = [], 0
    for a in arrays:
        out.append(packed[pos:pos + a.size])
        pos += a.size
    return out


@dataclass(frozen=True)
class TokenBlocks:
    """The token blocks of a packed batch: block j covers positions
    block_start[j] : block_start[j] + block_t of sequence block_seq[j]. Every sequence has at
    least one block (an empty sequence too: its block writes its conv state)."""

    block_t: int
    num_blocks: int
    num_tokens: int  # query_start_loc[-1]: the input must have at least this many rows
    block_seq: torch.Tensor  # (num_blocks,) int32
    block_start: torch.Tensor  # (num_blocks,) int32, position inside the sequence


def conv_token_blocks(query_start_loc: torch.Tensor, block_t: int, metadata: dict | None) -> TokenBlocks:
    """Token blocks of `block_t` positions for the varlen causal conv1d (cached per step)."""

    def build():
        qsl = query_start_loc_host(query_start_loc, metadata)
        lens = np.diff(qsl)
        nblocks = np.maximum(1, -(-lens // block_t))
        seq = np.repeat(np.arange(lens.size), nblocks)
        first = np.cumsum(nblocks) - nblocks
        start = (np.arange(seq.size) - np.repeat(first, nblocks)) * block_t
        block_seq, block_start = _to_device([seq, start], query_start_loc.device)
        return TokenBlocks(block_t, int(seq.size), int(qsl[-1]), block_seq, block_start)

    return _cached(metadata, ("conv1d_token_blocks", block_t), query_start_loc, build)


@dataclass(frozen=True)
class SsdChunks:
    """The SSD chunks of a packed batch. Chunks never straddle two sequences: sequence i owns
    chunks seq_chunk[i] : seq_chunk[i+1], and chunk c covers token rows
    chunk_start[c] : chunk_end[c] (at most chunk_size rows; only a sequence's last chunk may be
    shorter). An empty sequence owns no chunk."""

    chunk_size: int
    num_chunks: int
    num_tokens: int  # query_start_loc[-1]: the input must have at least this many rows
    chunk_start: torch.Tensor  # (num_chunks,) int32, token row
    chunk_end: torch.Tensor  # (num_chunks,) int32, token row (exclusive)
    seq_chunk: torch.Tensor  # (batch + 1,) int32


def ssd_chunks(query_start_loc: torch.Tensor, chunk_size: int, metadata: dict | None) -> SsdChunks:
    """Chunk boundaries per sequence for the SSD scan (cached per step)."""

    def build():
        qsl = query_start_loc_host(query_start_loc, metadata)
        starts, ends = qsl[:-1], qsl[1:]
        nchunks = -(-(ends - starts) // chunk_size)
        first = np.concatenate([[0], np.cumsum(nchunks)])
        seq = np.repeat(np.arange(starts.size), nchunks)
        k = np.arange(seq.size) - first[:-1][seq]  # chunk index inside its sequence
        c_start = starts[seq] + k * chunk_size
        c_end = np.minimum(c_start + chunk_size, ends[seq])
        c_start_t, c_end_t, seq_chunk = _to_device([c_start, c_end, first], query_start_loc.device)
        return SsdChunks(chunk_size, int(seq.size), int(qsl[-1]), c_start_t, c_end_t, seq_chunk)

    return _cached(metadata, ("ssd_chunks", chunk_size), query_start_loc, build)
