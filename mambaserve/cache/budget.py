"""Cache sizing: from a memory budget in bytes to the sizes of the state slot and KV block pools.

Pure arithmetic over byte counts and config values: no torch, no device. The model runner
measures the budget (GPU: its share of the device minus weights and a profiled forward; CPU:
cpu_cache_bytes) and the bytes one slot and one block hold, and calls `size_pools`.

The rules, in order:
- max_num_seqs is clamped to max_num_batched_tokens (more running decodes than tokens per step
  would starve the newest); it is clamped before sizing, so that slots no request could hold do
  not take the KV blocks' bytes.
- One extra state slot, the scratch slot (the last one), takes CUDA graphs' padding rows and is
  never handed to a request: two slots must fit at least.
- With attention and neither max_model_len nor num_kv_blocks given, a model's nominal limit
  (often 128k+ tokens) is clamped so that one longest sequence takes at most half of what is
  left beside two state slots.
- KV blocks take what the wanted slots leave, but never more than the running sequences
  (usable slots times one longest sequence) could fill; they must hold one longest sequence.
- State slots then take what the blocks leave, up to the wanted number, and max_num_seqs is
  clamped to the usable slots.
- With prefix caching, the state checkpoints (rows of a slot's size, `cache.checkpoint_pool`)
  come last: slots and KV blocks are sized as above in the budget less a tenth (so slots shrink
  only where memory, not max_num_seqs, bounds them), and the checkpoints take what they leave, at most
  max(max_num_seqs, MIN_CHECKPOINT_CAP) rows (a few running requests may still serve many cached
  prefixes; the cap keeps a model whose blocks leave much unused from taking all of it).
  num_state_checkpoints sets their number instead, its bytes taken from the blocks'. When the
  blocks so cut would not hold one max_model_len sequence, the checkpoints yield: the blocks
  are sized as without caching and the checkpoints take what is left (a forced number: the
  blocks' ValueError).
- No checkpoint is kept when mamba_block_size is at least max_model_len: no prompt reaches a
  checkpoint position and still has a token left to compute, so their rows would never be used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

MIN_CHECKPOINT_CAP = 256  # state checkpoints a budget may hold even with few running slots

# a model config without max_position_embeddings: no limit of its own
_UNLIMITED_MODEL_LEN = 1 << 20


@dataclass(frozen=True)
class PoolSizes:
    """What `size_pools` decided.

    num_slots: state slots, the scratch slot (the last one) included. num_blocks: KV blocks
    (0 for a model without attention layers). num_checkpoints: state checkpoint rows of prefix
    caching, beside the slots (rows num_slots .. num_slots + num_checkpoints - 1). max_num_seqs: most running requests
    (<= num_slots - 1). max_num_batched_tokens: tokens per step. max_model_len: longest prompt
    plus output, in tokens. notes: (logging level, message) pairs for what was clamped, in the
    order decided; the caller logs them.
    """

    num_slots: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    notes: tuple[tuple[int, str], ...] = ()
    num_checkpoints: int = 0

    @property
    def scratch_slot(self) -> int:
        """The slot reserved for padding rows of CUDA graphs."""
        return self.num_slots - 1


def resolve_max_num_batched_tokens(max_num_batched_tokens: int | None, on_gpu: bool) -> int:
    """The step's token budget: the configured value, or 8192 on a GPU and 2048 on the CPU.
    Resolved before the rest: the runner profiles one forward of this many tokens to measure
    the memory budget."""
    return max_num_batched_tokens or (8192 if on_gpu else 2048)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def size_pools(
    *,
    enable_prefix_caching: bool = False,
    num_state_checkpoints: int | None = None,
    mamba_block_size: int | None = None,
    **kw,
) -> PoolSizes:
    """Size the state slots, KV blocks and (enable_prefix_caching) state checkpoints to a
    memory budget (rules: module docstring). kw: `_size_running_pools`'s arguments, which say
    what they mean and the ValueErrors raised. num_state_checkpoints: the checkpoint rows (None:
    the budget's share). mamba_block_size: tokens between checkpoint positions (None: not
    checked against max_model_len)."""
    sizes = _size_running_pools(**kw)
    slot_bytes = kw["slot_bytes"]
    if not enable_prefix_caching or slot_bytes <= 0 or num_state_checkpoints == 0:
        return sizes
    if mamba_block_size is not None and mamba_block_size >= sizes.max_model_len:
        note = (logging.WARNING, f"prefix caching: mamba_block_size ({mamba_block_size}) is not below max_model_len "
                                 f"({sizes.max_model_len}), so no prompt reaches a state checkpoint: none is kept "
                                 "and no prefix can be resumed; lower mamba_block_size")
        return PoolSizes(**{**sizes.__dict__, "notes": (*sizes.notes, note)})
    budget, block_bytes = kw["budget_bytes"], kw["block_bytes"]
    reserve = budget // 10 if num_state_checkpoints is None else num_state_checkpoints * slot_bytes
    if kw.get("num_kv_blocks") is None and (block_bytes > 0 or num_state_checkpoints is None):
        # the same max_model_len, the running pools in the budget less the checkpoints' share: the
        # blocks shrink, and so do the slots where memory (not max_num_seqs) bounds them; otherwise
        # a model whose slots fill the budget (large states) would keep no checkpoint at all
        cut = dict(kw, budget_bytes=budget - reserve, max_model_len=sizes.max_model_len)
        if num_state_checkpoints is not None:  # a forced number takes its bytes from the blocks only
            cut["num_state_slots"] = sizes.num_slots
        try:
            cut_sizes = _size_running_pools(**cut)
        except ValueError:
            if num_state_checkpoints is not None:
                raise
            cut_sizes = sizes  # one longest sequence's blocks come first
        sizes = PoolSizes(**{**cut_sizes.__dict__, "notes": sizes.notes})
    if num_state_checkpoints is not None:
        n = num_state_checkpoints
    else:
        left = budget - sizes.num_slots * slot_bytes - sizes.num_blocks * block_bytes
        n = max(0, min(left // slot_bytes, max(sizes.max_num_seqs, MIN_CHECKPOINT_CAP)))
    note = (logging.DEBUG, f"prefix caching: {n} state checkpoints of {slot_bytes} bytes beside the slots")
    if n == 0:
        note = (logging.WARNING, "prefix caching: no room for state checkpoints beside the slots, so no prefix "
                                 "can be resumed; lower max_num_seqs or set num_state_checkpoints")
    return PoolSizes(**{**sizes.__dict__, "num_checkpoints": int(n), "notes": (*sizes.notes, note)})


def _size_running_pools(
    *,
    budget_bytes: int,
    slot_bytes: int,
    block_bytes: int,
    block_size: int,
    model_max_len: int | None,
    max_num_batched_tokens: int,
    default_max_num_seqs: int,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    num_state_slots: int | None = None,
    num_kv_blocks: int | None = None,
    enable_chunked_prefill: bool = True,
    on_gpu: bool = False,
) -> PoolSizes:
    """Size the state slot and KV block pools to a memory budget (rules: module docstring,
    those before prefix caching's).

    budget_bytes: bytes the caches may take (may be negative: nothing fits). slot_bytes: conv +
    SSM state of one request over all Mamba layers. block_bytes: K and V of one block of
    block_size tokens over all attention layers; 0 for a model without attention (no KV
    pool). model_max_len: the model's position limit (max_position_embeddings), None for none.
    max_num_batched_tokens: resolved (`resolve_max_num_batched_tokens`). default_max_num_seqs:
    what max_num_seqs means when not given. max_num_seqs, max_model_len, num_state_slots,
    num_kv_blocks, enable_chunked_prefill: the EngineConfig fields of those names (None: not
    given; num_state_slots and num_kv_blocks force the pool sizes). on_gpu: only names the
    budget's knob in the error messages (gpu_memory_utilization or cpu_cache_bytes).

    Raises ValueError when fewer than two state slots fit (one request's and the scratch
    slot), when the KV blocks do not hold one max_model_len sequence, when without chunked
    prefill max_num_batched_tokens is below max_model_len, or when no usable slot is left.
    """
    knob = "gpu_memory_utilization" if on_gpu else "cpu_cache_bytes"
    notes: list[tuple[int, str]] = []
    has_attention = block_bytes > 0
    resolved_len = max_model_len or model_max_len or _UNLIMITED_MODEL_LEN
    wanted_seqs = max_num_seqs if max_num_seqs is not None else default_max_num_seqs
    if max_num_batched_tokens < wanted_seqs:
        notes.append((logging.WARNING, f"max_num_seqs clamped from {wanted_seqs} to "
                                       f"max_num_batched_tokens={max_num_batched_tokens}"))
        wanted_seqs = max_num_batched_tokens
    wanted_slots = num_state_slots or (wanted_seqs + 1)
    if num_state_slots is None and budget_bytes < 2 * slot_bytes:
        raise ValueError(
            f"the cache budget of {max(budget_bytes, 0)} bytes holds fewer than two state slots of {slot_bytes} "
            f"bytes (one request's and the scratch slot); raise {knob}")

    def slots_beside(blocks_bytes: int) -> int:
        # state slots that fit beside `blocks_bytes` of KV blocks, at least two, at most the wanted
        return num_state_slots or max(2, min(wanted_slots, (budget_bytes - blocks_bytes) // max(slot_bytes, 1)))

    num_blocks = 0
    if has_attention:
        if num_kv_blocks is None and max_model_len is None:
            room = max(0, budget_bytes - 2 * slot_bytes) // 2
            if _ceil_div(resolved_len, block_size) * block_bytes > room:
                resolved_len = max(block_size, room // block_bytes * block_size)
                notes.append((logging.WARNING,
                              f"max_model_len clamped to {resolved_len} tokens to fit the cache budget"))
        min_blocks = _ceil_div(resolved_len, block_size)
        if num_kv_blocks is not None:
            num_blocks = num_kv_blocks
        else:
            slots = slots_beside(min_blocks * block_bytes)
            num_blocks = max(0, (budget_bytes - slots * slot_bytes) // block_bytes)
            num_blocks = min(num_blocks, max(1, slots - 1) * min_blocks)  # no more than the sequences can fill
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than one "
                f"max_model_len={resolved_len} sequence needs ({min_blocks}); lower max_model_len or "
                f"max_num_seqs, or raise {knob}")
    num_slots = slots_beside(num_blocks * block_bytes)
    seqs = min(wanted_seqs, num_slots - 1)
    if seqs < wanted_seqs:
        # a default the device could not meet is no surprise; a value the user asked for is
        notes.append((logging.WARNING if max_num_seqs is not None else logging.INFO,
                      f"max_num_seqs clamped from {wanted_seqs} to {seqs}: only {num_slots} state slots fit "
                      "in the budget"))
    if not enable_chunked_prefill and max_num_batched_tokens < resolved_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) "
                         f"must be at least max_model_len ({resolved_len})")
    if seqs < 1:
        raise ValueError("not even one request's state fits in the cache budget")
    return PoolSizes(num_slots=int(num_slots), num_blocks=int(num_blocks), max_num_seqs=int(seqs),
                     max_num_batched_tokens=int(max_num_batched_tokens), max_model_len=int(resolved_len),
                     notes=tuple(notes))
