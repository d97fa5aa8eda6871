"""Just enough of an engine to run a model's packed steps, for the model tests.

`Harness` gives each sequence one state slot and a contiguous block range and builds the step's
ForwardContext as the engine would; `assert_bf16_steps_near_transformers` is the bfloat16 bar
shared by the Mamba-1 and Jamba parity tests. Plain helpers: no fixtures, no tests.
"""

import copy

import torch

from mambaserve.cache.tensors import allocate_caches
from mambaserve.forward_context import ForwardContext
from tests.conftest import rel_err

BLOCK = 4


class Harness:
    """Just enough of an engine to run packed steps: one slot and a contiguous block range per prompt."""

    def __init__(self, model, n_seqs, max_len, device="cpu"):
        self.model = model
        self.device = device
        self.blocks_per_seq = -(-max_len // BLOCK)
        spec = model.cache_spec(model.cache_dtypes(ssm_dtype=torch.float32))
        self.caches = allocate_caches(spec, num_slots=n_seqs + 2, num_blocks=n_seqs * self.blocks_per_seq + 1,
                                      block_size=BLOCK, device=device)
        # poison the states: a sequence without an initial state must never read them
        for conv, ssm in self.caches.mamba:
            conv.fill_(float("nan")), ssm.fill_(float("nan"))
        self.has_attn = bool(spec.attention)
        self.slot = {i: n_seqs + 1 - i for i in range(n_seqs)}  # slots in reverse order
        self.done = {i: 0 for i in range(n_seqs)}

    def step(self, chunks: dict[int, list[int]]):
        """chunks: seq id -> new token ids. Returns logits of every new token, per seq."""
        order = sorted(chunks, key=lambda i: (len(chunks[i]) != 1 or self.done[i] == 0, i))
        ids, pos, tables = [], [], []
        for i in order:
            ids += chunks[i]
            pos += list(range(self.done[i], self.done[i] + len(chunks[i])))
            tables.append([i * self.blocks_per_seq + b for b in range(self.blocks_per_seq)])
        ctx = ForwardContext.build(
            query_lens=[len(chunks[i]) for i in order],
            seq_lens=[self.done[i] + len(chunks[i]) for i in order],
            state_indices=[self.slot[i] for i in order],
            has_initial_state=[self.done[i] > 0 for i in order],
            block_tables=tables if self.has_attn else None, block_size=BLOCK, device=self.device,
            mamba_caches=self.caches.mamba, kv_caches=self.caches.kv,
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), ctx)
            logits = self.model.compute_logits(hidden).cpu()
        out, row = {}, 0
        for i in order:
            n = len(chunks[i])
            out[i] = logits[row:row + n]
            row += n
            self.done[i] += n
        return out



def assert_bf16_steps_near_transformers(hf, ours, seqs, lens, n_decode):
    """One packed prefill of seqs[i][:lens[i]], then n_decode decode steps of every sequence, each
    step's logits at most three times as far from transformers' float32 logits as transformers'
    own bfloat16 model is (3e-2 at least). hf: the float32 transformers model."""
    hf_low = copy.deepcopy(hf).to(torch.bfloat16)
    h = Harness(ours, len(lens), max(lens) + n_decode)

    def check(got, ids, rows, what):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, rows]
            low = hf_low(torch.tensor([ids])).logits[0, rows].float()
        assert rel_err(got, ref) < max(3e-2, 3 * rel_err(low, ref)), what

    got = h.step({i: s[:n] for i, (s, n) in enumerate(zip(seqs, lens))})
    for i, (s, n) in enumerate(zip(seqs, lens)):
        check(got[i], s[:n], slice(0, n), f"prefill of prompt {i}")
    for t in range(n_decode):
        got = h.step({i: [s[n + t]] for i, (s, n) in enumerate(zip(seqs, lens))})
        for i, (s, n) in enumerate(zip(seqs, lens)):
            check(got[i][0], s[:n + t + 1], -1, f"decode step {t} of prompt {i}")
