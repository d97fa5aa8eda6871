"""Launch plans of the kernels over variable-length packed batches, built on the host.

A packed batch holds sequence i in rows `query_start_loc[i]:query_start_loc[i+1]`. Kernels that
split sequences into fixed-size pieces (token blocks of the conv, chunks of the SSD scan) take
the list of pieces as a plan: the same for every layer of a step, so the step's forward
context builds each plan once from its host copy of the offsets and every layer passes it to
the launcher. The builders here are pure functions of host arrays (and the device the plan's
tensors go to); they trust their offsets to be checked (`check_offsets`). A launcher called
without a plan builds one itself from `read_offsets`, a device read: one host sync.

This module knows nothing about models or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mambaserve.ops.common import pack_to_device


def check_offsets(offsets) -> np.ndarray:
    """offsets (batch + 1,) (a list or an int array) as a checked int64 numpy array. Raises
    ValueError unless they start at 0 or later and never decrease: kernels index rows by them,
    and a bad one reads and writes out of bounds (each launcher also checks that the last
    offset is within its input's rows)."""
    qsl = np.asarray(offsets, dtype=np.int64)
    if qsl.ndim != 1 or qsl.size == 0:
        raise ValueError(f"query_start_loc must be (batch + 1,), got shape {qsl.shape}")
    if qsl[0] < 0 or (np.diff(qsl) < 0).any():
        raise ValueError(f"query_start_loc must be non-negative and non-decreasing, got {qsl.tolist()}")
    return qsl


def read_offsets(query_start_loc: torch.Tensor) -> np.ndarray:
    """The device tensor query_start_loc (batch + 1,) read to the host (a host sync) and
    checked by `check_offsets`: the plan source of a launcher called without a plan."""
    return check_offsets(query_start_loc.tolist())


@dataclass(frozen=True)
class StateSaves:
    """State checkpoints a prefill writes at positions inside its sequences (prefix caching):
    entry k asks for the conv and SSM state of sequence seq[k] after its first offset[k] rows
    of this step to be written into state row row[k] (a checkpoint row of the same state
    tensors), as if the step had ended there; start[k] is that sequence's first token row in
    the batch (query_start_loc[seq[k]]). Host tuples, sorted by (seq, offset), offsets
    strictly inside their sequence (0 < offset < its length): a save at a sequence's end is
    the final state, which the slot already gets."""

    seq: tuple[int, ...] = ()
    offset: tuple[int, ...] = ()
    row: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    # (smallest offset, smallest row, largest row), for the launchers' per-call checks
    bounds: tuple[int, int, int] = field(default=(0, 0, -1), init=False, repr=False, compare=False)

    def __post_init__(self):
        if not len(self.seq) == len(self.offset) == len(self.row) == len(self.start):
            raise ValueError("StateSaves needs one offset, row and start per entry")
        if list(zip(self.seq, self.offset)) != sorted(set(zip(self.seq, self.offset))):
            raise ValueError("StateSaves entries must be sorted by (seq, offset), without repeats")
        if self.seq:
            object.__setattr__(self, "bounds", (min(self.offset), min(self.row), max(self.row)))

    def rows_within(self, num_rows: int) -> bool:
        """Whether every save row is in [0, num_rows) (O(1): `bounds`)."""
        return not self.seq or (self.bounds[1] >= 0 and self.bounds[2] < num_rows)

    def __len__(self) -> int:
        return len(self.seq)

    def shifted(self, first: int, first_row: int) -> StateSaves:
        """The saves of sequences first, first + 1, ... renumbered from 0, their rows from
        first_row (a context's prefill part)."""
        keep = [k for k, i in enumerate(self.seq) if i >= first]
        return StateSaves(tuple(self.seq[k] - first for k in keep), tuple(self.offset[k] for k in keep),
                          tuple(self.row[k] for k in keep), tuple(self.start[k] - first_row for k in keep))

    def check(self, query_start_loc_host: np.ndarray, min_offset: int = 1) -> None:
        """Raise ValueError unless every save is inside its sequence, at least min_offset rows in
        (the Triton conv takes a save's width - 1 inputs from this step's rows)."""
        lens = np.diff(query_start_loc_host)
        for i, o, s in zip(self.seq, self.offset, self.start):
            if not (0 <= i < lens.size and min_offset <= o < lens[i]):
                raise ValueError(f"state save at offset {o} of sequence {i}: must be in [{min_offset}, its "
                                 f"{lens[i] if 0 <= i < lens.size else 'missing'} rows)")
            if s != query_start_loc_host[i]:
                raise ValueError(f"state save of sequence {i} says it starts at row {s}, the batch at "
                                 f"{query_start_loc_host[i]}")


NO_SAVES = StateSaves()


@dataclass(frozen=True)
class TokenBlocks:
    """The token blocks of a packed batch of `batch` sequences: block j covers positions
    block_start[j] : block_start[j] + block_t of sequence block_seq[j]. Every sequence has at
    least one block (an empty sequence too: its block writes its conv state). With state
    `saves` (`StateSaves`), entry num_blocks + k of block_seq / block_start is save k's
    sequence and offset, and save_row[k] its state row: the conv kernel writes the saves in
    the same launch (one program per save and feature block)."""

    block_t: int
    batch: int
    num_blocks: int
    num_tokens: int  # query_start_loc[-1]: the input must have at least this many rows
    block_seq: torch.Tensor  # (num_blocks + len(saves),) int32
    block_start: torch.Tensor  # (num_blocks + len(saves),) int32, position inside the sequence
    saves: StateSaves = NO_SAVES
    save_row: torch.Tensor | None = None  # (len(saves),) int32, or None without saves
    # the launcher's config by (dim, width, config override version), shared by the step's layers
    launch: dict = field(default_factory=dict, repr=False, compare=False)


def conv_token_blocks(query_start_loc_host: np.ndarray, block_t: int, device,
                      saves: StateSaves | None = None) -> TokenBlocks:
    """Token blocks of `block_t` positions for the varlen causal conv1d. query_start_loc_host:
    checked offsets (batch + 1,) int64; saves: the step's state saves (`StateSaves`, checked
    here), written by the conv kernel. The block tensors go to `device` in one copy."""
    qsl = query_start_loc_host
    lens = np.diff(qsl)
    nblocks = np.maximum(1, -(-lens // block_t))
    seq = np.repeat(np.arange(lens.size), nblocks)
    first = np.cumsum(nblocks) - nblocks
    start = (np.arange(seq.size) - np.repeat(first, nblocks)) * block_t
    if saves is None or not len(saves):
        block_seq, block_start = pack_to_device([seq, start], device)
        return TokenBlocks(block_t, int(lens.size), int(seq.size), int(qsl[-1]), block_seq, block_start)
    saves.check(qsl)
    nb = seq.size
    block_seq, block_start, save_row = pack_to_device(
        [np.concatenate([seq, saves.seq]), np.concatenate([start, saves.offset]), np.asarray(saves.row)], device)
    return TokenBlocks(block_t, int(lens.size), int(nb), int(qsl[-1]), block_seq, block_start, saves, save_row)


@dataclass(frozen=True)
class SsdChunks:
    """The SSD chunks of a packed batch of `batch` sequences. Chunks never straddle two
    sequences: sequence i owns chunks seq_chunk[i] : seq_chunk[i+1], and chunk c covers token
    rows chunk_start[c] : chunk_end[c] (at most chunk_size rows; a sequence's chunks restart
    at each of its state saves, so the chunk before a save and its last chunk may be
    shorter). An empty sequence owns no chunk. save_row (num_chunks,) int32: the state row
    the state at the chunk's start is written into, -1 for none; None when saves is empty."""

    chunk_size: int
    batch: int
    num_chunks: int
    num_tokens: int  # query_start_loc[-1]: the input must have at least this many rows
    chunk_start: torch.Tensor  # (num_chunks,) int32, token row
    chunk_end: torch.Tensor  # (num_chunks,) int32, token row (exclusive)
    seq_chunk: torch.Tensor  # (batch + 1,) int32
    saves: StateSaves = NO_SAVES
    save_row: torch.Tensor | None = None
    # the scan's intermediates by shape, shared by the layers of the step (`ops.ssd_chunk_scan`)
    workspace: dict = field(default_factory=dict, repr=False, compare=False)


def ssd_chunks(query_start_loc_host: np.ndarray, chunk_size: int, device, saves: StateSaves = NO_SAVES) -> SsdChunks:
    """SSD chunks of `chunk_size` rows for a packed batch. query_start_loc_host: checked offsets
    (batch + 1,) int64; saves: the step's state saves (`StateSaves`, checked here), at each of
    which the sequence's chunks restart. The chunk tensors go to `device` in one copy."""
    qsl = query_start_loc_host
    starts, ends = qsl[:-1], qsl[1:]
    if not len(saves):
        nchunks = -(-(ends - starts) // chunk_size)
        first = np.concatenate([[0], np.cumsum(nchunks)])
        seq = np.repeat(np.arange(starts.size), nchunks)
        k = np.arange(seq.size) - first[:-1][seq]  # chunk index inside its sequence
        c_start = starts[seq] + k * chunk_size
        c_end = np.minimum(c_start + chunk_size, ends[seq])
        c_start_t, c_end_t, seq_chunk = pack_to_device([c_start, c_end, first], device)
        return SsdChunks(chunk_size, int(starts.size), int(seq.size), int(qsl[-1]), c_start_t, c_end_t, seq_chunk)
    saves.check(qsl)
    cuts: dict[int, list[tuple[int, int]]] = {}
    for i, o, r in zip(saves.seq, saves.offset, saves.row):
        cuts.setdefault(i, []).append((o, r))
    c_start, c_end, rows, first = [], [], [], [0]
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        pieces = [(0, -1), *cuts.get(i, [])]  # (offset where a run of chunks starts, its save row)
        for j, (o, r) in enumerate(pieces):
            stop = s + pieces[j + 1][0] if j + 1 < len(pieces) else e
            for c in range(s + o, stop, chunk_size):
                c_start.append(c)
                c_end.append(min(c + chunk_size, stop))
                rows.append(r if c == s + o else -1)
        first.append(len(c_start))
    arrays = [np.asarray(a, dtype=np.int64) for a in (c_start, c_end, first, rows)]
    c_start_t, c_end_t, seq_chunk, save_row = pack_to_device(arrays, device)
    return SsdChunks(chunk_size, int(starts.size), len(c_start), int(qsl[-1]), c_start_t, c_end_t, seq_chunk,
                     saves, save_row)
