"""Verification of speculative decoding's drafts: which of a sequence's k drafts the target
model accepts, and the token that follows them, from the target's k + 1 rows of logits.

For row j (the logits after the sequence's last token and drafts d_1..d_j) the target
distribution p_j is what the sampler would sample from there (`Sampler.adjusted_logits`, then
`target_probs`: temperature, min-p, top-k, top-p). Greedy rows: d_{j+1} is accepted when it is
p_j's argmax, and the first rejected position emits the argmax, as plain decoding would.
Sampled rows: the rejection sampling of Leviathan et al. 2023 ("Fast inference from
transformers via speculative decoding", section 2.3) and Chen et al. 2023: d_{j+1}, drawn from
the draft distribution q_j, is accepted with probability min(1, p_j(d) / q_j(d)); at the first
rejection a token is drawn from the normalised max(p_j - q_j, 0), which makes every emitted
token distributed exactly as p_j; when all k are accepted a bonus token is drawn from p_k.
N-gram drafts are a point mass (q_j(d) = 1): accept with probability p_j(d), resample from p_j
with d removed. Draws come from the request's own generator when it has a seed (the tokens
then depend on the seed and the drafts, not on the batch), else from the global RNG; draws are
exponential races as in the sampler. Logprobs of the emitted tokens are the raw logits'
log_softmax, as the sampler's.

The sequences verifying here carry no penalties, no min_tokens still to reach and no grammar
(`engine.spec_decode` proposes no drafts for those): their rows' distributions then do not
depend on the drafts before them. This module knows nothing of proposers or the model.
"""

from __future__ import annotations

import torch

from mambaserve.engine.sampler import Sampler, _logprob_dicts, _to_device, _truncate, request_generator, target_probs
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import Logprob


def verify_drafts(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None] | None = None
                  ) -> list[tuple[list[int], list[dict[int, Logprob] | None]]]:
    """Per sequence: the tokens it emits (its accepted drafts, then one more: 1..k+1 tokens)
    and their logprob records (None entries unless it asked for logprobs).

    logits: (sum of len(drafts[i]) + 1, vocab), the rows of each sequence in order, row j of
    sequence i after its last token and drafts[i][:j]. draft_probs[i]: (len(drafts[i]), vocab)
    float32 draft distributions q, or None for point masses (n-gram, greedy drafter).
    Two host syncs: the acceptance, then (only when logprobs are asked for) the records.
    """
    device = logits.device
    rows_seqs = [seq for seq, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
    params = [seq.sampling_params for seq in rows_seqs]
    x = sampler.adjusted_logits(logits, rows_seqs)  # (R, vocab)
    checked = _to_device([t for d in drafts for t in d + [-1]], device)  # (R,) the draft row j checks; -1: bonus row
    argmax = x.argmax(dim=-1)
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        accept, emit = argmax == checked, argmax
    else:
        accept, emit = _rejection_sample(x, params, greedy, checked, seqs, drafts, draft_probs, argmax)
    accept_host, emit_host = torch.stack([accept.long(), emit]).tolist()
    out, row, lp_rows = [], 0, []
    for seq, d in zip(seqs, drafts):
        j = 0
        while j < len(d) and accept_host[row + j]:
            j += 1
        tokens = list(d[:j]) + [emit_host[row + j]]
        out.append((tokens, [None] * len(tokens)))
        if seq.sampling_params.logprobs is not None:
            lp_rows.append((len(out) - 1, [row + i for i in range(len(tokens))], tokens))
        row += len(d) + 1
    if lp_rows:
        _fill_logprobs(logits, out, lp_rows, seqs)
    return out


def _rejection_sample(x, params, greedy, checked, seqs, drafts, draft_probs, argmax):
    """(accept (R,) bool, token emitted at a rejection or the bonus row (R,) int64) of the sampled
    rows; greedy rows keep the argmax rules."""
    device, (R, vocab) = x.device, x.shape
    probs = target_probs(x, params, greedy)  # (R, vocab), each row sums to 1
    index = checked.clamp_min(0).unsqueeze(1)  # (R, 1)
    p_d = probs.gather(1, index).squeeze(1)
    is_draft = checked >= 0
    if draft_probs is None or all(q is None for q in draft_probs):
        q_d = torch.ones_like(p_d)
        residual = probs.scatter(1, index, torch.zeros_like(p_d).unsqueeze(1))  # p without the point mass
    else:
        q = torch.cat([_with_bonus(qi, d, vocab, device) for qi, d in zip(draft_probs, drafts)])  # (R, vocab)
        q_d = q.gather(1, index).squeeze(1)
        residual = (probs - q).clamp_min(0.0)
    residual = torch.where(is_draft.unsqueeze(1), residual, probs)  # the bonus row samples from p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    u = torch.rand(R, device=device)
    race = torch.empty_like(probs).exponential_()
    row = 0
    for seq, d in zip(seqs, drafts):
        n = len(d) + 1
        if seq.sampling_params.seed is not None and not seq.sampling_params.is_greedy:
            gen = request_generator(seq, device)
            u[row:row + n] = torch.rand(n, device=device, generator=gen)
            race[row:row + n].exponential_(generator=gen)
        row += n
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    accept = u * q_d < p_d  # probability min(1, p / q)
    emit = (residual / race).argmax(dim=-1)
    g = _to_device(greedy, device, torch.bool)
    return torch.where(g, argmax == checked, accept), torch.where(g, argmax, emit)


def _with_bonus(q: torch.Tensor | None, drafts: list[int], vocab: int, device) -> torch.Tensor:
    """A sequence's (k + 1, vocab) draft distributions: q (a point mass on each draft when
    None), then a zero row for the bonus position."""
    if q is None:
        q = torch.zeros(len(drafts), vocab, device=device).scatter_(1, _to_device(drafts, device).unsqueeze(1), 1.0)
    return torch.cat([q.float().to(device), torch.zeros(1, vocab, device=device)])


def _fill_logprobs(logits, out, lp_rows, seqs) -> None:
    """The logprob records of the emitted tokens of the sequences that asked (one host sync)."""
    rows = [r for _, rs, _ in lp_rows for r in rs]
    tokens = [t for _, _, ts in lp_rows for t in ts]
    num_top = max(seqs[i].sampling_params.logprobs for i, _, _ in lp_rows)
    logprobs = torch.log_softmax(logits[_to_device(rows, logits.device)].float(), dim=-1)
    _, dicts = _logprob_dicts(logprobs, _to_device(tokens, logits.device), num_top)
    k = 0
    for i, rs, _ in lp_rows:
        for j in range(len(rs)):
            out[i][1][j] = _truncate(dicts[k], seqs[i].sampling_params.logprobs)
            k += 1
