"""Speculative decoding's "draft_model" method: a second, small model of any supported family
proposes the drafts, greedily, run by a `ModelRunner` of its own (its own state slots and KV
blocks, sized from the same kind of budget).

Per target sequence the drafter keeps a shadow `Sequence` over the same tokens with its own
slot S, a scratch slot W and KV blocks. S only ever absorbs real tokens: to propose, the
drafter first runs the sequence's tokens it has not seen yet (the prompt, later the accepted
drafts and the token after them) into S as one chunk, whose last logits give draft 1; drafts
2..k come from one-token decode steps on W, a copy of S taken before the first of them (the
copy runs before that forward: `ModelRunner.execute`'s state_loads). W's state and the KV those
steps write at positions past the real tokens are dropped: the next proposal overwrites them.
So there is nothing to roll back: S is always exact. Drafts are argmax tokens, a point mass q
for the rejection sampler.

A sequence that left the running batch (finished, aborted or preempted) gives back its drafter
slots and blocks when the next proposal runs; after a preemption the drafter starts over.
A sequence the drafter has no slots or blocks for gets no drafts. Under tensor parallelism the
drafter runs whole on rank 0's device. This module knows nothing of verification.
"""

from __future__ import annotations

import dataclasses
import logging

from mambaserve.cache.pools import make_cache_pools
from mambaserve.config import EngineConfig, SpeculativeConfig
from mambaserve.engine.scheduler import ScheduledSequence
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve")

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclasses.dataclass
class _Shadow:
    """The drafter's bookkeeping of one target sequence: its shadow over the tokens (slot S), the
    scratch slot W and the preemption count it was made at."""

    seq: Sequence
    scratch: int
    preemptions: int
    first: int | None = None  # draft 1 of the last proposal: S has not changed while no token came


class DraftModelProposer:
    """Greedy drafts from a small model (module docstring). config: the target's engine config;
    max_model_len: the target's. Raises ValueError when the draft model's vocabulary is not the
    target's (`vocab_size`) or its caches do not fit."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, vocab_size: int, max_model_len: int):
        from mambaserve.engine.model_runner import ModelRunner

        draft = dataclasses.replace(
            config, model=spec.model, tokenizer=None, skip_tokenizer_init=True, speculative_config=None,
            tensor_parallel_size=1, max_model_len=max_model_len, enable_prefix_caching=False,
            num_state_slots=None, num_kv_blocks=None, num_state_checkpoints=None, mamba_block_size=None,
            cuda_graph_sizes=None, gpu_memory_utilization=1.0)  # the GPU memory the target left over
        self.runner = ModelRunner(draft)
        if self.runner.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({self.runner.vocab_size}) is not the "
                             f"target's ({vocab_size})")
        r = self.runner
        pools = make_cache_pools(num_slots=r.num_slots, num_blocks=r.num_blocks if r.has_attention else None,
                                 block_size=draft.block_size, num_checkpoints=0, enable_prefix_caching=False,
                                 mamba_block_size=draft.block_size, has_state=bool(r.spec.mamba))
        self.slots, self.blocks = pools.slots, pools.blocks
        self.budget = r.max_num_batched_tokens
        self._shadows: dict[int, _Shadow] = {}  # id(target sequence) -> its shadow

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Drafts for each (sequence, k) of `wanted` (running decodes; k >= 1), by id(sequence);
        a sequence left out gets none. `wanted` lists every sequence that may still draft: the
        others' shadows are released."""
        keep = {id(seq) for seq, _ in wanted}
        for key in [key for key in self._shadows if key not in keep]:
            self._release(key)
        ready = [(seq, k, sh) for seq, k in wanted if (sh := self._shadow(seq, k)) is not None]
        drafts: dict[int, list[int]] = {}
        # the unseen real tokens into S, in chunks within the drafter's step budget
        batch, used = [], 0
        for seq, _, sh in ready:
            sh.seq.prompt_token_ids = seq.all_token_ids
            n = sh.seq.num_uncomputed_tokens
            if n == 0:  # the sequence did not run since (a step short of budget): S and its logits are as they were
                drafts[id(seq)] = [sh.first]
                continue
            if batch and used + n > self.budget:
                self._catch_up(batch, drafts)
                batch, used = [], 0
            batch.append((seq, sh, n))
            used += n
        if batch:
            self._catch_up(batch, drafts)
        # drafts 2..k: decode steps on W (a copy of S), one step for all
        loads = [(sh.seq.state_slot, sh.scratch) for seq, k, sh in ready if k > 1]
        for j in range(1, max((k for _, k, _ in ready), default=1)):
            active = [(seq, sh) for seq, k, sh in ready if k > j]
            work = []
            for seq, sh in active:
                w = Sequence(sh.seq.request_id, prompt_token_ids=seq.all_token_ids + drafts[id(seq)],
                             sampling_params=_GREEDY)
                w.state_slot, w.block_table = sh.scratch, sh.seq.block_table
                w.num_computed_tokens = w.num_tokens - 1
                work.append(ScheduledSequence(w, 1))
            logits = self.runner.execute(work, loads if j == 1 else ()).sample_logits
            for (seq, _), t in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[id(seq)].append(t)
        return drafts

    def _catch_up(self, batch, drafts) -> None:
        """Run the shadows' unseen tokens into S; each one's last logits give its first draft."""
        result = self.runner.execute([ScheduledSequence(sh.seq, n) for _, sh, n in batch])
        for (seq, sh, n), t in zip(batch, result.sample_logits.argmax(dim=-1).tolist()):
            sh.seq.num_computed_tokens += n
            sh.first = t
            drafts[id(seq)] = [t]

    def _shadow(self, seq: Sequence, k: int) -> _Shadow | None:
        """The sequence's shadow with KV blocks for its tokens and k - 1 drafts, made on first use
        (or anew after a preemption); None when the drafter's slots or blocks are short."""
        sh = self._shadows.get(id(seq))
        if sh is not None and sh.preemptions != seq.num_preemptions:
            self._release(id(seq))
            sh = None
        if sh is None:
            if self.slots.num_free < 2:
                return None
            shadow = Sequence(seq.request_id, prompt_token_ids=seq.all_token_ids, sampling_params=_GREEDY)
            shadow.state_slot = self.slots.allocate()
            sh = self._shadows[id(seq)] = _Shadow(shadow, self.slots.allocate(), seq.num_preemptions)
        if self.blocks is not None:
            missing = self.blocks.blocks_needed(seq.num_tokens + k - 1) - len(sh.seq.block_table)
            if missing > 0:
                if not self.blocks.can_allocate(missing):
                    return None
                sh.seq.block_table.extend(self.blocks.allocate(missing))
        return sh

    def _release(self, key: int) -> None:
        sh = self._shadows.pop(key)
        self.slots.free(sh.seq.state_slot)
        self.slots.free(sh.scratch)
        if sh.seq.block_table:
            self.blocks.free(sh.seq.block_table)
