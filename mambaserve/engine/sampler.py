"""From one row of logits per sequence to one sampled token per sequence (plus logprobs).

The pipeline, per row, in order (vLLM semantics):
1. min_tokens: EOS and the request's stop_token_ids get -inf while fewer than min_tokens
   tokens have been generated; then allowed_token_ids (-inf on every other token) and
   logit_bias (added).
2. Penalties: repetition (HF style, over prompt + output tokens), then frequency and presence
   (OpenAI style, over output tokens).
3. Greedy rows (temperature 0) take the argmax here; nothing below changes them.
4. Temperature, then min-p, top-k, top-p (on the distribution renormalised after the filters
   before it), as vLLM's V1 sampler orders them (min-p before top-p changes what top-p keeps).
5. Sampling by exponential race: argmax(probs / q), q ~ Exp(1) i.i.d. per vocabulary entry,
   which picks token i with probability probs[i] (the Gumbel-max trick in probability space).
   Unseeded rows draw q in one batched call from the global RNG; a seeded row draws its own
   q from `seq.generator` (one Exp(1) per vocabulary entry per sampled token), so its tokens
   do not depend on the rest of the batch, nor on preemption.

Logprobs, when requested, are log_softmax of the raw logits (before step 1), as vLLM returns
by default. The only host syncs are at the end: one transfer for all tokens and logprobs.

This module knows nothing about the model or the scheduler; it reads each sequence's tokens
and sampling params, and creates `seq.generator` on first use.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import Logprob


@dataclass
class SamplerOutput:
    """token_ids[i] is sequence i's new token; logprobs[i] is None unless it asked for logprobs,
    else {sampled token: Logprob, then the top-n tokens in rank order}."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class PendingSample:
    """Tokens sampled on the device and not yet read by the host (see `Sampler.launch`).

    token_ids: (batch,) int64 on the logits' device, valid in stream order: a later kernel may
    read them (the next decode step's input ids) before the host has them."""

    def __init__(self, token_ids: torch.Tensor | None, done: SamplerOutput | None = None):
        self.token_ids = token_ids
        self._done = done
        self._host = self._copied = None
        if done is None and token_ids.is_cuda:
            # Copy to pinned memory now, in stream order right after the sampling: `result`
            # then waits for this copy only, not for work enqueued later on the stream (the
            # next decode step), which a plain .tolist() would wait for.
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        """The tokens on the host (waits for them, the first time)."""
        if self._done is None:
            if self._copied is not None:
                self._copied.synchronize()
                ids = self._host.tolist()
            else:
                ids = self.token_ids.tolist()
            self._done = SamplerOutput(ids, [None] * len(ids))
        return self._done


class Sampler:
    """Samples one token per sequence from a (batch, vocab) float32 logits tensor.

    eos_token_id: the model's EOS id(s), masked while a request is below its min_tokens.
    """

    def __init__(self, eos_token_id: int | list[int] | None) -> None:
        if eos_token_id is None:
            self.eos_token_ids: list[int] = []
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = [eos_token_id]
        else:
            self.eos_token_ids = list(eos_token_id)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: (batch, vocab), one row per sequence of `seqs`, on any device. Not modified."""
        return self.launch(logits, seqs).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Enqueue the sampling of `logits` (same arguments as calling the sampler) and return
        before the host waits for the tokens, unless some sequence wants logprobs (those are
        read at once). Every kernel that reads `logits` is enqueued before this returns, so
        the logits buffer may be overwritten by work enqueued afterwards."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        if not seqs:
            return PendingSample(None, SamplerOutput([], []))
        params = [s.sampling_params for s in seqs]
        raw = logits
        logits = self.adjusted_logits(logits, seqs)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)  # (batch,)
        else:
            token_ids = self._sample(logits, seqs, greedy)

        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want_logprobs:
            return PendingSample(token_ids)

        rows = _to_device(want_logprobs, raw.device)
        num_top = max(params[i].logprobs for i in want_logprobs)
        logprobs = torch.log_softmax(raw[rows].float(), dim=-1)  # (rows, vocab)
        tokens_host, lp_dicts = _logprob_dicts(logprobs, token_ids[rows], num_top, extra=token_ids)
        out: list[dict[int, Logprob] | None] = [None] * len(seqs)
        for d, i in zip(lp_dicts, want_logprobs):
            out[i] = _truncate(d, params[i].logprobs)
        return PendingSample(token_ids, SamplerOutput(tokens_host, out))

    def adjusted_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Steps 1-2 of the pipeline (min_tokens, allowed_token_ids, logit_bias, penalties) on
        (batch, vocab) logits, in float32; `logits` itself is not modified."""
        params = [s.sampling_params for s in seqs]
        logits = self._mask_min_tokens(logits.float(), seqs)
        if any(p.logit_bias or p.allowed_token_ids is not None for p in params):
            logits = apply_token_constraints(logits, params)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, seqs)
        return logits

    def _mask_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """-inf on EOS and stop_token_ids for rows below min_tokens (a copy if any is masked)."""
        rows, cols = [], []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_output_tokens < p.min_tokens:
                banned = {t for t in self.eos_token_ids + p.stop_token_ids if t < vocab}
                rows += [i] * len(banned)
                cols += sorted(banned)
        if not rows:
            return logits
        logits = logits.clone()
        logits[_to_device(rows, logits.device), _to_device(cols, logits.device)] = float("-inf")
        return logits

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]
    ) -> torch.Tensor:
        """Token ids (batch,) by temperature/top-k/top-p/min-p and the exponential race;
        greedy rows get the argmax of `logits`."""
        device = logits.device
        greedy_mask = _to_device(greedy, device, torch.bool)
        argmax = logits.argmax(dim=-1)  # (batch,)
        probs = target_probs(logits, [s.sampling_params for s in seqs], greedy)
        q = torch.empty_like(probs).exponential_()  # global RNG for unseeded rows
        for i, (g, seq) in enumerate(zip(greedy, seqs)):
            if not g and seq.sampling_params.seed is not None:
                q[i].exponential_(generator=request_generator(seq, device))
        # q == 0 would turn a masked token (prob 0) into 0/0 = NaN, which argmax would pick.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        sampled = (probs / q).argmax(dim=-1)  # (batch,)
        return torch.where(greedy_mask, argmax, sampled)


def request_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """A seeded request's own RNG (created on first use, on `device`)."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        seq.generator.manual_seed(seq.sampling_params.seed)
    return seq.generator


def target_probs(logits: torch.Tensor, params: list, greedy: list[bool]) -> torch.Tensor:
    """Step 4 of the pipeline: the distribution a row samples from, (batch, vocab) float32, from
    `Sampler.adjusted_logits`' output: temperature, min-p, top-k, top-p (greedy rows: softmax
    at temperature 1, unused)."""
    device = logits.device
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    temperature = _to_device(temperature, device, torch.float32)
    logits = logits / temperature.unsqueeze(1)
    top_k = [0 if g or p.top_k <= 0 else p.top_k for g, p in zip(greedy, params)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    if any(m > 0.0 for m in min_p):
        logits = apply_min_p(logits, min_p)
    if any(k > 0 for k in top_k) or any(q < 1.0 for q in top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)  # (batch, vocab)


def apply_token_constraints(logits: torch.Tensor, params: list) -> torch.Tensor:
    """allowed_token_ids (every other token gets -inf), then logit_bias (added), per row of the
    (batch, vocab) logits; returns a new tensor. Token ids are in the vocabulary (the engine
    checked them when the request was added)."""
    vocab, device = logits.shape[1], logits.device
    logits = logits.clone()
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed_rows:
        banned = torch.ones(len(allowed_rows), vocab, dtype=torch.bool)
        for j, i in enumerate(allowed_rows):
            banned[j, params[i].allowed_token_ids] = False
        if device.type == "cuda":
            banned = banned.pin_memory()
        index = _to_device(allowed_rows, device)
        logits[index] = logits[index].masked_fill(banned.to(device, non_blocking=True), float("-inf"))
    rows, cols, bias = [], [], []
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            rows.append(i), cols.append(t), bias.append(b)
    if rows:
        logits.index_put_((_to_device(rows, device), _to_device(cols, device)),
                          _to_device(bias, device, torch.float32), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, frequency and presence penalties; returns a new (batch, vocab) tensor.

    repetition_penalty r (HF/vLLM): for every token in prompt or output, logit / r if the
    logit is > 0, else logit * r. Then, over output tokens with count c:
    logit -= frequency_penalty * c + presence_penalty * (c > 0).
    """
    vocab = logits.shape[1]
    device = logits.device
    params = [s.sampling_params for s in seqs]
    logits = logits.clone()

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        token_lists = [(seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in rep_rows]
        seen = _token_counts(token_lists, vocab, device) > 0
        r = [params[i].repetition_penalty for i in rep_rows]
        r = _to_device(r, device, torch.float32).unsqueeze(1)  # (rows, 1)
        index = _to_device(rep_rows, device)
        sub = logits[index]
        penalized = torch.where(sub > 0, sub / r, sub * r)
        logits[index] = torch.where(seen, penalized, sub)

    pen_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if pen_rows:
        counts = _token_counts([(seqs[i].output_token_ids,) for i in pen_rows], vocab, device)
        freq = _to_device([params[i].frequency_penalty for i in pen_rows], device, torch.float32)
        pres = _to_device([params[i].presence_penalty for i in pen_rows], device, torch.float32)
        index = _to_device(pen_rows, device)
        logits[index] -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (k <= 0: off) and then outside the
    smallest most-likely set whose renormalised probability reaches top_p (1.0: off).

    logits: (batch, vocab). Returns a new tensor. Ties at the k-th value are resolved by sort
    order (exactly k tokens stay).
    """
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (batch, vocab) each
    positions = torch.arange(vocab, device=device).unsqueeze(0)  # (1, vocab)
    k = _to_device([kk if 0 < kk < vocab else vocab for kk in top_k], device)
    sorted_logits = sorted_logits.masked_fill(positions >= k.unsqueeze(1), float("-inf"))
    if any(p < 1.0 for p in top_p):
        p = _to_device(top_p, device, torch.float32).unsqueeze(1)  # (batch, 1)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        # Keep a token while the mass before it is below top_p; the first is always kept.
        drop = (before >= p) & (p < 1.0) & (positions > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """-inf on the tokens whose probability is below min_p times the row's largest (0: off):
    p_i < m p_max is l_i < l_max + log m, so no softmax is needed. logits: (batch, vocab)
    float32 (after temperature); returns a new tensor."""
    m = _to_device(min_p, logits.device, torch.float32).unsqueeze(1)  # (batch, 1)
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(m)  # log 0 = -inf: nothing cut
    return logits.masked_fill(logits < threshold, float("-inf"))


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num_top: int
) -> list[dict[int, Logprob]]:
    """Logprobs of the prompt's actual next tokens, for the engine's prompt_logprobs.

    logits: (n, vocab) float32, row j predicting next_token_ids[j]. Returns n dicts, each
    {actual token: Logprob, then the num_top most likely tokens in rank order}, from the raw
    log_softmax. One host sync.
    """
    if len(next_token_ids) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {len(next_token_ids)} next tokens")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    if not next_token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n, vocab)
    tokens = _to_device(next_token_ids, logits.device)
    _, dicts = _logprob_dicts(logprobs, tokens, num_top)
    return dicts


def _to_device(values: list, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device (a blocking
    host-to-GPU copy would synchronize the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _token_counts(token_lists: list[tuple[list[int], ...]], vocab: int, device) -> torch.Tensor:
    """(len(token_lists), vocab) float32 occurrence counts of the tokens in each row's lists;
    ids >= vocab are ignored. The host work is one pass over the ids and one transfer."""
    rows = len(token_lists)
    counts = torch.zeros(rows * (vocab + 1), device=device)  # column `vocab` catches bad ids
    flat = array.array("q")
    lengths = []
    for parts in token_lists:
        for part in parts:
            flat.extend(part)
        lengths.append(sum(len(part) for part in parts))
    if len(flat):
        tokens = torch.frombuffer(flat, dtype=torch.int64).clamp(0, vocab)
        row_ids = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
        index = row_ids * (vocab + 1) + tokens  # (num_ids,) flat position in counts
        if device.type == "cuda":
            index = index.pin_memory()
        index = index.to(device, non_blocking=True)
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=counts.dtype))
    return counts.view(rows, vocab + 1)[:, :vocab]


def _logprob_dicts(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    extra: torch.Tensor | None = None,
) -> tuple[list[int] | None, list[dict[int, Logprob]]]:
    """Per row: {token_ids[row]: Logprob(lp, rank)} then the num_top most likely tokens with
    ranks 1..num_top (the chosen token keeps its own entry if it is among them).

    logprobs: (rows, vocab); token_ids: (rows,). `extra` (any 1-D integer tensor) rides along
    in the single host transfer and comes back as a list (None without it). A token's rank is
    1 + the number of tokens strictly more likely.
    """
    rows, vocab = logprobs.shape
    num_top = min(num_top, vocab)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1))  # (rows, 1)
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # (rows, 1)
    top_vals, top_ids = logprobs.topk(num_top, dim=-1)  # (rows, num_top) each
    parts = [token_ids.unsqueeze(1), chosen, rank, top_vals, top_ids]
    # One transfer: float64 holds token ids, ranks and float32 logprobs exactly.
    packed = torch.cat([t.to(torch.float64) for t in parts], dim=1)  # (rows, 3 + 2 * num_top)
    if extra is not None:
        packed = torch.cat([packed.flatten(), extra.to(torch.float64)])
    host = packed.tolist()
    extra_host = None
    if extra is not None:
        width = 3 + 2 * num_top
        extra_host = [int(t) for t in host[rows * width :]]
        host = [host[r * width : (r + 1) * width] for r in range(rows)]
    dicts = []
    for row in host:
        token, lp, rk = int(row[0]), row[1], int(row[2])
        d = {token: Logprob(lp, rk)}
        for j in range(num_top):
            t = int(row[3 + num_top + j])
            if t not in d:
                d[t] = Logprob(row[3 + j], j + 1)
        dicts.append(d)
    return extra_host, dicts


def _truncate(d: dict[int, Logprob], num_top: int) -> dict[int, Logprob]:
    """Keep the chosen token's entry (the first) and the entries ranked <= num_top."""
    items = list(d.items())
    return dict([items[0]] + [(t, lp) for t, lp in items[1:] if lp.rank <= num_top])
