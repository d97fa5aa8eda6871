"""The model runner: owns the model and its caches, turns a scheduled batch into logits.

Per step it builds the `ForwardContext` once (decodes first, then prefill chunks), runs one
forward over the packed tokens and computes logits only for the rows that need them: the last
token of every sequence that reaches its end in this step (to sample from), and every prompt
row of sequences that asked for prompt logprobs, and says how it ran the step (decode graphs,
piecewise graphs or eagerly). It measures the memory budget of the caches (`cache/budget.py`
sizes the pools from it). It knows nothing of sampling or stopping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from mambaserve.cache.budget import resolve_max_num_batched_tokens, size_pools
from mambaserve.cache.tensors import allocate_caches
from mambaserve.config import EngineConfig
from mambaserve.distributed import SINGLE, TensorParallelGroup, host_barrier, min_over_ranks
from mambaserve.engine.cuda_graph import DecodeGraphRunner, capture_full_graphs
from mambaserve.engine.runner_setup import check_max_model_len, set_cpu_threads
from mambaserve.engine.scheduler import ScheduledSequence
from mambaserve.engine.sequence import Sequence
from mambaserve.engine.stats import MemoryUsage
from mambaserve.engine.step_input import StepInput, share_step
from mambaserve.engine.warm_up import warm_up_attention
from mambaserve.forward_context import ForwardContext
from mambaserve.loader import DTYPES, load_config, load_model
from mambaserve.ops import copy_state_rows
from mambaserve.ops.common import pack_to_device, to_device

logger = logging.getLogger("mambaserve")

# most sequences verifying drafts in one step (each holds k + 1 scratch state rows)
MAX_VERIFY_SEQS = 32


@dataclass
class StepLogits:
    """What one forward produced, and how it ran.

    sample_logits: (num_sampled, vocab) float32 for `sample_seqs` (same order).
    prompt_logits: per sequence id, (n, vocab) float32 logits of its prompt rows in this step,
    with the absolute position of the first row. path: how the forward ran: "decode_graph"
    (the full decode CUDA graphs), "verify_graph" (the full graphs of uniform verify steps),
    "piecewise" (piecewise graphs, padded) or "eager".
    verify: the ScheduledSequences that verify drafts (speculative decoding), verify_logits
    their (sum of 1 + k, vocab) float32 rows in order, verify_state_rows the state rows that
    hold the state after each of their positions.
    """

    sample_seqs: list
    sample_logits: torch.Tensor
    prompt_logits: dict[str, tuple[int, torch.Tensor]]
    path: str
    verify: list = field(default_factory=list)
    verify_logits: torch.Tensor | None = None
    verify_state_rows: list[list[int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and its caches on one device and runs one forward per step.

    From an EngineConfig: loads the model, sizes state slots and KV blocks to the budget (GPU:
    gpu_memory_utilization minus weights and a profiled forward; CPU: cpu_cache_bytes), captures
    CUDA graphs per the compilation mode and compiles the attention variants (`warm_up`).
    `execute(scheduled)` runs a step (decode graphs, piecewise graphs or eagerly) and returns
    the logits the sampler needs. Raises ValueError when not even one max_model_len request fits.

    Under tensor parallelism (`group` of several ranks) every rank has a runner over its shard
    of the model and of the caches (cuda:local_rank on GPUs), sized alike: the pools take the
    smallest budget of the ranks. Rank 0's `execute` sends each step to the others (their
    `run` executes it: `engine.executor`), so that every rank runs the same forwards and graph
    captures, collectives included, in the same order.
    """

    def __init__(self, config: EngineConfig, group: TensorParallelGroup = SINGLE):
        self.config = config
        self.group = group
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and group.world_size > 1:
            self.device = torch.device("cuda", group.local_rank)
        if self.device.type == "cpu":
            self.cpu_threads = set_cpu_threads(config.cpu_num_threads)
        check_max_model_len(config.max_model_len, load_config(config.model))
        t0 = time.perf_counter()
        self._allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        kv_fp8 = config.kv_cache_dtype in ("fp8", "fp8_e4m3")
        self.model = load_model(config.model, dtype=config.dtype, device=self.device,
                                load_format=config.load_format, seed=config.seed, group=group,
                                quantization=config.quantization, kv_scales=kv_fp8)
        host_barrier(group)  # every rank holds its shard (a rank that died loading fails the others here)
        self.dtype = self.model.lm_head.weight.dtype
        ssm_name = config.mamba_ssm_cache_dtype  # "auto": the family's default (Nemotron-H: float32) or the model's
        dtypes = self.model.cache_dtypes(None if ssm_name == "auto" else DTYPES[ssm_name])
        if kv_fp8:  # keys and values in float8_e4m3fn, per-tensor scales: one byte per element
            dtypes = replace(dtypes, kv=torch.float8_e4m3fn)
        self.ssm_dtype = dtypes.ssm
        self.spec = self.model.cache_spec(dtypes)
        self.has_attention = self.spec.has_attention
        config.cache_config.check_model(self.has_attention)
        self.block_size = config.block_size
        self.vocab_size = self.model.config.vocab_size
        self.load_seconds = time.perf_counter() - t0
        logger.debug("loaded %s in %.1f s", type(self.model).__name__, self.load_seconds)
        # speculative decoding: k + 1 scratch state rows per sequence that may verify in a step
        spec = config.speculative_config
        self.verify_stride = spec.num_speculative_tokens + 1 if spec is not None else 0
        self.max_num_verify_seqs = min(MAX_VERIFY_SEQS, config.resolved_max_num_seqs()) if spec is not None else 0
        self._size_caches()
        self.max_num_verify_seqs = min(self.max_num_verify_seqs, self.max_num_seqs)
        self.verify_base = self.num_slots + self.num_checkpoints
        # state rows: the slots, then prefix caching's checkpoints, then speculation's verify rows
        self.caches = allocate_caches(self.spec, num_slots=self.verify_base + self.num_verify_rows, device=self.device,
                                      num_blocks=max(self.num_blocks, 1), block_size=self.block_size)
        self.compilation_mode = config.resolved_compilation_mode()
        self.decode_graphs, self.piecewise_graphs, self.verify_graphs = None, None, {}  # verify: by tokens a row
        t0 = time.perf_counter()
        if self.compilation_mode in ("piecewise", "full_and_piecewise"):
            self._capture_piecewise_graphs()
        if self.compilation_mode == "full_and_piecewise":
            self._capture_decode_graphs()
        self.graph_capture_seconds = time.perf_counter() - t0 if self.compilation_mode != "eager" else None
        if self.device.type == "cuda":
            warm_up_attention(self)

    @property
    def num_verify_rows(self) -> int:
        """Scratch state rows of speculative decoding (0 without it)."""
        return self.max_num_verify_seqs * self.verify_stride

    def _piecewise_sizes(self) -> list[int]:
        """Token counts of the piecewise graphs: up to the step budget, or to the model's own
        cap (`max_piecewise_tokens`: a layer whose capture path costs more than its eager one)."""
        from mambaserve.engine.piecewise import default_piecewise_sizes

        cap = getattr(self.model, "max_piecewise_tokens", None) or self.max_num_batched_tokens
        return default_piecewise_sizes(min(self.max_num_batched_tokens, cap))

    def _capture_piecewise_graphs(self) -> None:
        from mambaserve.engine.piecewise import PiecewiseGraphRunner

        self.piecewise_graphs = PiecewiseGraphRunner(
            self.model, self.caches, sizes=self._piecewise_sizes(),
            block_size=self.block_size, has_attention=self.has_attention, device=self.device)
        self.piecewise_graphs.capture()

    def _capture_decode_graphs(self) -> None:
        verify = (self.verify_stride, self.verify_base, self.max_num_verify_seqs, self.scratch_slot) \
            if self.verify_stride > 1 else None
        self.decode_graphs, self.verify_graphs = capture_full_graphs(
            self.model, self.caches, sizes=self.config.cuda_graph_sizes, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.block_size, has_attention=self.has_attention,
            device=self.device, verify=verify)

    # ---------------------------------------------------------------- sizing
    def _cache_budget(self) -> int:
        """Bytes the caches may take on this rank's device; under tensor parallelism the
        smallest of every rank's, so that all size their pools alike."""
        return min_over_ranks(self._device_cache_budget(), self.group)

    def _device_cache_budget(self) -> int:
        if self.device.type != "cuda":
            return self.config.cpu_cache_bytes
        activations = self._profile_activation_bytes()
        if self.config.resolved_compilation_mode() in ("piecewise", "full_and_piecewise"):
            # the piecewise graphs' private pool keeps the activations of their largest captured
            # step for good and their split points' buffers (one set per captured size) take
            # about as much again, beside what eager steps (and the capture's warm-up) need
            largest = max(self._piecewise_sizes())
            activations += int(2 * activations * min(1.0, largest / self.max_num_batched_tokens)) + (1 << 30)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device) - self._allocated_before
        # gpu_memory_utilization is this engine's share of the GPU (as in vLLM): weights, one
        # full-budget forward and the caches must fit in it, and in what is actually free
        share = int(total * self.config.gpu_memory_utilization) - weights - activations
        return min(share, free - activations - (512 << 20))

    def _profile_activation_bytes(self) -> int:
        """Peak memory of one forward at the full token budget (one prefill sequence) over the weights."""
        n = self.max_num_batched_tokens
        tiny = allocate_caches(self.spec, num_slots=1, num_blocks=-(-n // self.block_size) if self.has_attention else 1,
                               block_size=self.block_size, device=self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ctx = ForwardContext.build(query_lens=[n], seq_lens=[n], state_indices=[0], has_initial_state=[False],
                                   block_tables=[list(range(-(-n // self.block_size)))] if self.has_attention else None,
                                   block_size=self.block_size, device=self.device,
                                   mamba_caches=tiny.mamba, kv_caches=tiny.kv,
                                   state_saves=[(0, n // 2, 0)] if n >= 8 and self.spec.min_inner_save_offset else None)
        with torch.inference_mode():  # (a state save too: its kernels compile here, not in a request's step)
            ids = torch.randint(0, self.vocab_size, (n,), device=self.device)
            hidden = self.model(ids, torch.arange(n, device=self.device), ctx)
            self.model.compute_logits(hidden[-min(n, self.config.resolved_max_num_seqs()):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del tiny, ctx, hidden
        torch.cuda.empty_cache()
        return int(peak * 1.2) + (256 << 20)

    def _size_caches(self) -> None:
        """Measure the budget and the bytes of a slot and a block; `size_pools` decides the rest."""
        cfg = self.config
        on_gpu = self.device.type == "cuda"
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(cfg.max_num_batched_tokens, on_gpu)
        slot_bytes = self.spec.bytes_per_slot
        block_bytes = self.spec.bytes_per_block(self.block_size)  # 0: no attention
        sizes = size_pools(
            budget_bytes=self._cache_budget() - self.num_verify_rows * slot_bytes, slot_bytes=slot_bytes,
            block_bytes=block_bytes,
            block_size=self.block_size, model_max_len=getattr(self.model.config, "max_position_embeddings", None),
            max_num_batched_tokens=self.max_num_batched_tokens, default_max_num_seqs=cfg.resolved_max_num_seqs(),
            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, num_state_slots=cfg.num_state_slots,
            num_kv_blocks=cfg.num_kv_blocks, enable_chunked_prefill=cfg.enable_chunked_prefill, on_gpu=on_gpu,
            enable_prefix_caching=cfg.enable_prefix_caching, num_state_checkpoints=cfg.num_state_checkpoints,
            mamba_block_size=cfg.cache_config.resolved_mamba_block_size)
        for level, message in sizes.notes:
            logger.log(level, message)
        self.sizes = sizes
        self.num_slots, self.num_blocks, self.num_checkpoints = sizes.num_slots, sizes.num_blocks, sizes.num_checkpoints
        self.max_num_seqs, self.max_model_len = sizes.max_num_seqs, sizes.max_model_len
        self.scratch_slot = sizes.scratch_slot  # reserved: padding rows of CUDA graphs
        # bytes of what the engine holds for good (reported by `generate` and the benchmarks)
        self.memory = MemoryUsage(
            weights_bytes=sum(t.numel() * t.element_size() for t in
                              {id(p): p for p in self.model.parameters()}.values()),
            state_cache_bytes=(self.num_slots + self.num_verify_rows) * slot_bytes,
            kv_cache_bytes=self.num_blocks * block_bytes, state_checkpoint_bytes=self.num_checkpoints * slot_bytes)
        logger.debug("caches: %d state slots (%.1f MiB each), %d state checkpoints, %d KV blocks of %d tokens",
                     self.num_slots, slot_bytes / 2**20, self.num_checkpoints, self.num_blocks, self.block_size)

    # ---------------------------------------------------------------- step
    @staticmethod
    def prepare(scheduled: list[ScheduledSequence], verify_rows: tuple[int, int] = (0, 0)
                ) -> tuple[StepInput, list[Sequence], list[tuple[str, int]], list[ScheduledSequence]]:
        """The step's input from the scheduler's batch (host only), the sequences that sample
        (in the order of step.sample_rows), per prompt slice of step.prompt_rows its sequence's
        request id and the absolute position of its first row, and the sequences that verify
        drafts (speculative decoding). These go last in the packed batch, their k + 1 rows last
        in sample_rows, and the i-th of them keeps the state after its position j in state row
        base + i * stride + j, where (base, stride) = verify_rows."""
        ids, positions, query_lens, slots, tables = [], [], [], [], []
        sample_rows, sample_seqs, prompt_rows, prompt_owners = [], [], [], []
        loads, saves, inner_saves = [], [], []
        offset = 0
        verify = [s for s in scheduled if s.spec_token_ids]
        for i, s in enumerate([s for s in scheduled if not s.spec_token_ids] + verify):
            seq, n = s.seq, s.num_new_tokens
            if s.load_checkpoint is not None:
                loads.append((s.load_checkpoint, seq.state_slot))
            if s.save_checkpoint is not None:
                saves.append((seq.state_slot, s.save_checkpoint))
            inner_saves.extend((i, o, row) for o, row in s.inner_saves)
            start = seq.num_computed_tokens
            if s.spec_token_ids:  # its last token, then the drafts
                assert n == 1 + len(s.spec_token_ids) and start + 1 == seq.num_tokens, s
                ids.extend(seq.get_token_ids(start, start + 1) + s.spec_token_ids)
                sample_rows.extend(range(offset, offset + n))
            else:
                ids.extend(seq.get_token_ids(start, start + n))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            slots.append(seq.state_slot)
            tables.append(seq.block_table)
            if not s.spec_token_ids and start + n == seq.num_tokens:  # reaches its end: samples its next token
                sample_seqs.append(seq)
                sample_rows.append(offset + n - 1)
            # logits of prompt positions start..start+m-1 that predict a prompt token
            m = min(n, seq.num_prompt_tokens - 1 - start)
            if seq.sampling_params.prompt_logprobs is not None and m > 0:
                prompt_rows.append((offset, m))
                prompt_owners.append((seq.request_id, start))
            offset += n
        base, stride = verify_rows
        state_rows = [[base + i * stride + j for j in range(s.num_new_tokens)] for i, s in enumerate(verify)]
        step = StepInput(ids, positions, query_lens, slots, tables, sample_rows, prompt_rows,
                         checkpoint_loads=loads, checkpoint_saves=saves, state_saves=inner_saves,
                         verify_state_rows=state_rows)
        return step, sample_seqs, prompt_owners, verify

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], state_loads: list[tuple[int, int]] = ()) -> StepLogits:
        """Run one forward over the scheduled batch and return the logits that are needed
        (rank 0; under tensor parallelism the other ranks are sent the step first).
        state_loads: (state row, slot) copies to run before the forward (speculative decoding's
        accepted states of the previous step)."""
        step, sample_seqs, owners, verify = self.prepare(scheduled, (self.verify_base, self.verify_stride))
        step.checkpoint_loads = list(state_loads) + step.checkpoint_loads
        share_step(step, None, self.group)
        logits, prompt_logits, path = self.run(step)
        n = len(sample_seqs)
        return StepLogits(sample_seqs, None if logits is None or not n else logits[:n],
                          {rid: (start, lg) for (rid, start), lg in zip(owners, prompt_logits)}, path,
                          verify, None if not verify else logits[n:], step.verify_state_rows)

    @torch.inference_mode()
    def execute_chained_decode(self, seqs: list[Sequence], tokens: torch.Tensor, rows: list[int] | None) -> StepLogits:
        """The decode step that follows one still in flight: each sequence's input is the token
        the previous step sampled for it, row rows[i] (None: i) of the device tensor `tokens`,
        which the host has not read yet. The host bookkeeping of that previous step is not done
        either: each sequence's new token sits at position num_computed_tokens + 1. Block
        tables must already cover it. Every sequence samples; logits (len(seqs), vocab)."""
        step = StepInput([], [s.num_computed_tokens + 1 for s in seqs], [1] * len(seqs), [s.state_slot for s in seqs],
                         [s.block_table for s in seqs], list(range(len(seqs))), [],
                         device_tokens=tokens.shape[0], token_rows=rows)
        share_step(step, tokens, self.group)
        logits, _, path = self.run(step, tokens)
        return StepLogits(list(seqs), logits, {}, path)

    @torch.inference_mode()
    def run(self, step: StepInput, tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor | None, list[torch.Tensor], str]:
        """The forward of one step, as every rank runs it: (logits of step.sample_rows (None
        when none), logits of each of step.prompt_rows, how it ran: StepLogits.path). tokens:
        a chained decode's device tokens (step.device_tokens of them). The step's checkpoint
        copies run eagerly around the forward (never inside a captured graph)."""
        self._copy_states(step.checkpoint_loads)
        result = self._forward(step, tokens)
        self._copy_states(step.checkpoint_saves)
        return result

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state rows src -> dst of every Mamba layer's conv and SSM state, for (src, dst)
        in pairs (speculative decoding's accepted states, prefix caching's checkpoints): one
        launch per state stack (`ops.copy_state_rows`)."""
        copy_state_rows(self.caches.state_stacks, pairs)

    def _forward(self, step: StepInput, tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, list[torch.Tensor], str]:
        graphs = self.decode_graphs
        if step.one_token_each and graphs is not None and len(step.query_lens) <= graphs.max_size:
            if step.device_tokens is None:
                all_logits = graphs.run(step.token_ids, step.positions, step.state_slots, self._tables(step))
            else:
                all_logits = graphs.run(None, step.positions, step.state_slots, self._tables(step),
                                        device_ids=(tokens, step.token_rows))
            return self._needed_logits(step, lambda rows: all_logits[rows], "decode_graph")  # (batch, vocab)
        if (verify := self._uniform_verify(step)) is not None:
            all_logits = verify.run(step.token_ids, step.positions, step.state_slots, self._tables(step))
            return self._needed_logits(step, lambda rows: all_logits[rows], "verify_graph")  # (batch (k + 1), vocab)
        padded = None
        if not step.one_token_each and self.piecewise_graphs is not None:
            padded = self.piecewise_graphs.padded_size(len(step.positions))
        ctx = self._context(step, pad_to=padded)
        if step.device_tokens is None:  # positions and ids in one copy
            pos, input_ids = pack_to_device([step.positions, step.token_ids], self.device, torch.int64)
        else:
            pos = to_device(torch.tensor(step.positions, dtype=torch.int64), self.device)
            input_ids = tokens[: len(step.query_lens)] if step.token_rows is None else \
                tokens[to_device(torch.tensor(step.token_rows, dtype=torch.int64), tokens.device)]
        if padded is not None:
            hidden = self.piecewise_graphs.run(input_ids, pos, ctx)
        else:
            hidden = self.model(input_ids, pos, ctx)
        return self._needed_logits(step, lambda rows: self.model.compute_logits(hidden[rows]),
                                   "eager" if padded is None else "piecewise")

    def _uniform_verify(self, step: StepInput) -> DecodeGraphRunner | None:
        """The verify graphs of this step if every sequence verifies as many drafts (state rows
        as `prepare` assigns them) and no prompt logits, state saves or device tokens are asked for."""
        graphs = self.verify_graphs.get(step.query_lens[0]) if step.query_lens else None
        ok = (graphs is not None and len(step.verify_state_rows) == len(step.query_lens) <= graphs.max_size
              and all(n == graphs.query_len for n in step.query_lens) and not step.prompt_rows
              and not step.state_saves and step.device_tokens is None)
        return graphs if ok else None

    def _tables(self, step: StepInput) -> list[list[int]] | None:
        return step.block_tables if self.has_attention else None

    def _context(self, step: StepInput, pad_to: int | None = None) -> ForwardContext:
        """The step's forward context, over this runner's caches."""
        starts = step.starts
        return ForwardContext.build(
            query_lens=step.query_lens, seq_lens=[p + n for p, n in zip(starts, step.query_lens)],
            state_indices=step.state_slots, has_initial_state=[p > 0 for p in starts],
            block_tables=self._tables(step), block_size=self.block_size, device=self.device,
            mamba_caches=self.caches.mamba, kv_caches=self.caches.kv, pad_to=pad_to, state_saves=step.state_saves,
            verify_state_rows=step.verify_state_rows or None,
        )

    def _needed_logits(self, step: StepInput, logits_of, path: str
                       ) -> tuple[torch.Tensor | None, list[torch.Tensor], str]:
        """The logits of the sampled rows and of the prompt slices; logits_of(rows) gives them
        (the same calls on every rank: under tensor parallelism they gather the vocabulary)."""
        rows = step.sample_rows
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            index = slice(rows[0], rows[0] + len(rows))  # every row (decodes): a view, no copy
        else:
            index = torch.tensor(rows, device=self.device) if rows else None
        sample_logits = logits_of(index) if rows else None
        return sample_logits, [logits_of(slice(off, off + m)) for off, m in step.prompt_rows], path
