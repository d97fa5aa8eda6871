"""The sampler against hand computations, torch.log_softmax, and sampling frequencies."""

import math

import pytest
import torch

from mambaserve.engine.sampler import (
    Sampler,
    apply_penalties,
    apply_token_constraints,
    apply_top_k_top_p,
    prompt_logprobs,
)
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import SamplingParams
from tests.conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def make_seq(prompt=(1, 2, 3), outputs=(), rid="r", **params):
    seq = Sequence(rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params))
    seq.output_token_ids = list(outputs)
    return seq


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of the observed token counts against `probs` (zero-prob tokens must
    never appear)."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double().cpu() * n
    assert counts[expected == 0].sum() == 0, "a token with probability 0 was sampled"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Well under 1e-3 tail for up to ~8 degrees of freedom: loose, but catches a wrong distribution.
CHI2_LIMIT = 35.0


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_exact_argmax_and_input_untouched(device):
    logits = torch.randn(7, 37, device=device)
    before = logits.clone()
    seqs = [make_seq(temperature=0.0, rid=str(i)) for i in range(7)]
    out = Sampler(eos_token_id=None)(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 7
    # Mixed with sampled rows, greedy rows are still the plain argmax.
    for i in (1, 4, 5):
        seqs[i] = make_seq(temperature=1.3, top_k=5, rid=str(i))
    out = Sampler(eos_token_id=None)(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 3, 6)] == [argmax[i] for i in (0, 2, 3, 6)]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=3, top_p=1e-6)]
)
def test_degenerate_filters_equal_greedy(device, params):
    logits = torch.randn(64, 50, device=device) * 3
    seqs = [make_seq(temperature=1.5, rid=str(i), **params) for i in range(64)]
    seqs[3] = make_seq(temperature=0.7, seed=5, rid="3", **params)
    assert Sampler(None)(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.05, 0.5, 0.15, 0.3]]))
    out = apply_top_k_top_p(logits, top_k=[2, 0], top_p=[1.0, 0.79])
    assert torch.isinf(out).tolist() == [[True, False, True, False], [True, False, True, False]]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    out = apply_top_k_top_p(logits, top_k=[0, 3], top_p=[0.81, 0.9])
    assert out[0, 0] == float("-inf") and torch.isfinite(out[0, 1:]).all()
    assert out[1, 0] == float("-inf") and torch.isfinite(out[1, 1:]).all()
    # top-p applies to the top-k renormalised distribution: within top-2, 0.5/0.8 = 0.625.
    out = apply_top_k_top_p(logits[:1], top_k=[2], top_p=[0.6])
    assert torch.isfinite(out[0]).tolist() == [False, True, False, False]
    assert torch.equal(apply_top_k_top_p(logits, [0, -1], [1.0, 1.0]), logits)


PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize(
    "params, kept",
    [
        (dict(), [0, 1, 2, 3, 4]),
        (dict(temperature=0.5), [0, 1, 2, 3, 4]),
        (dict(top_k=2), [1, 3]),
        (dict(top_p=0.75), [1, 3, 4]),  # mass before token 4 is 0.7 < 0.75; before 2: 0.85
        (dict(min_p=0.3), [1, 3, 4]),  # threshold 0.12
        (dict(top_k=4, min_p=0.3), [1, 3, 4]),
        # min-p first (vLLM V1): {1, 3} renormalised to (.57, .43), then top-p 0.5 keeps token 1
        # alone; top-p first would keep 1 and 3 (mass before 3 is 0.4 < 0.5)
        (dict(top_p=0.5, min_p=0.5), [1]),
    ],
)
def test_sampling_frequencies_match_the_filtered_softmax(device, seeded, params, kept):
    n = 3000
    logits = PROBS.log().expand(n, -1).contiguous().to(device)
    seqs = [make_seq(rid=str(i), seed=i if seeded else None, **params) for i in range(n)]
    tokens = Sampler(None)(logits, seqs).token_ids
    target = PROBS ** (1.0 / params.get("temperature", 1.0))
    mask = torch.zeros_like(target, dtype=torch.bool)
    mask[kept] = True
    target = torch.where(mask, target, 0.0)
    target = target / target.sum()
    assert chi_square(tokens, target) < CHI2_LIMIT


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device):
    vocab = 101  # odd: the seeded row's draws land at differently aligned addresses

    def logits_for(seq):
        # The "model": logits that depend on the sequence's tokens so far.
        g = torch.Generator().manual_seed(len(seq.all_token_ids) * 7919 + seq.all_token_ids[-1])
        return torch.randn(vocab, generator=g)

    def run(batch_builder, steps=12):
        target = make_seq(prompt=[5, 6], rid="t", seed=1234, temperature=0.9, top_p=0.95)
        for step in range(steps):
            seqs = batch_builder(step, target)
            logits = torch.stack([logits_for(s) for s in seqs]).to(device)
            out = Sampler(None)(logits, seqs)
            for s, t in zip(seqs, out.token_ids):
                s.output_token_ids.append(t)
        return target.output_token_ids

    alone = run(lambda step, t: [t])
    others = [make_seq(prompt=[i + 1], rid=f"o{i}", seed=(i if i % 2 else None)) for i in range(6)]
    crowded = run(lambda step, t: others[: step % 5] + [t] + others[step % 5 :])
    assert alone == crowded
    # A different seed (almost surely) gives a different completion; no seed is not pinned.
    other_seed = make_seq(prompt=[5, 6], rid="x", seed=4321, temperature=0.9, top_p=0.95)
    outs = []
    for _ in range(12):
        logits = logits_for(other_seed).unsqueeze(0).to(device)
        t = Sampler(None)(logits, [other_seed]).token_ids[0]
        other_seed.output_token_ids.append(t)
        outs.append(t)
    assert outs != alone


def test_penalties_against_hand_computation():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
        ]
    )
    seqs = [
        make_seq(prompt=[0, 1], outputs=[3, 3, 1],
                 repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        make_seq(prompt=[0, 1], outputs=[3, 3, 1]),  # no penalties: untouched
        make_seq(prompt=[0, 4], outputs=[2, 2], presence_penalty=-1.0),  # prompt not counted
        make_seq(prompt=[4], outputs=[], repetition_penalty=0.5, frequency_penalty=2.0),
    ]
    expected = torch.tensor(
        [
            # rep 2 on {0,1,3}: 1.0, -2.0, 1.5; then token 3: -0.5*2 -0.25, token 1: -0.5 -0.25
            [1.0, -2.75, 0.5, 0.25, -2.0],
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [2.0, -1.0, 1.5, 3.0, -2.0],
            [2.0, -1.0, 0.5, 3.0, -1.0],  # rep 0.5 on the negative logit of prompt token 4
        ]
    )
    out = apply_penalties(logits, seqs)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert logits[0, 0] == 2.0  # input untouched
    # Greedy decoding sees the penalised logits.
    for s in seqs:
        s.sampling_params.temperature = 0.0
    assert Sampler(None)(logits, seqs).token_ids == expected.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eos", [3, [3, 7]])
def test_min_tokens_masks_eos_and_stop_token_ids(device, eos):
    vocab = 10
    logits = torch.zeros(4, vocab, device=device)
    logits[:, 3] = 50.0  # EOS
    logits[:, 7] = 40.0
    logits[:, 5] = 30.0  # a stop token id
    seqs = [
        make_seq(outputs=[], min_tokens=2, stop_token_ids=[5], temperature=0.0, rid="a"),
        make_seq(outputs=[1], min_tokens=2, stop_token_ids=[5], temperature=1.0, rid="b"),
        make_seq(outputs=[1, 1], min_tokens=2, stop_token_ids=[5], temperature=0.0, rid="c"),
        make_seq(outputs=[], min_tokens=0, temperature=0.0, rid="d"),
    ]
    tokens = Sampler(eos_token_id=eos)(logits, seqs).token_ids
    banned = {3, 5} | ({7} if isinstance(eos, list) else set())
    assert tokens[0] not in banned and tokens[1] not in banned
    assert tokens[0] == (7 if eos == 3 else 0)  # the best allowed token (all zeros: the first)
    assert tokens[2] == 3 and tokens[3] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_values_and_ranks(device):
    vocab = 40
    raw = torch.randn(4, vocab, device=device) * 2
    seqs = [
        make_seq(logprobs=3, temperature=0.0, rid="a"),
        make_seq(logprobs=None, temperature=1.0, rid="b"),
        make_seq(logprobs=0, temperature=0.8, rid="c", repetition_penalty=1.5),
        make_seq(logprobs=5, temperature=2.0, top_k=10, seed=3, rid="d"),
    ]
    out = Sampler(None)(raw, seqs)
    ref = torch.log_softmax(raw.double(), -1).cpu()
    order = ref.argsort(-1, descending=True)
    assert out.logprobs[1] is None
    for i, n in ((0, 3), (2, 0), (3, 5)):
        d = out.logprobs[i]
        token = out.token_ids[i]
        items = list(d.items())
        assert items[0][0] == token, "the sampled token comes first"
        assert math.isclose(items[0][1].logprob, float(ref[i, token]), abs_tol=1e-5)
        assert items[0][1].rank == int((ref[i] > ref[i, token]).sum()) + 1
        top = [t for t, _ in items[1:]]
        expected_top = [t for t in order[i, :n].tolist() if t != token]
        assert top == expected_top
        for t, lp in items[1:]:
            assert lp.rank == order[i].tolist().index(t) + 1
            assert math.isclose(lp.logprob, float(ref[i, t]), abs_tol=1e-5)
            assert lp.decoded_token is None
        assert len(d) == n + (token not in order[i, :n].tolist())
    assert out.logprobs[0][out.token_ids[0]].rank == 1  # greedy: the top token


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs(device):
    logits = torch.randn(6, 30, device=device)
    nxt = [3, 0, 29, 7, 7, 12]
    out = prompt_logprobs(logits, nxt, num_top=2)
    ref = torch.log_softmax(logits.double(), -1).cpu()
    for j, d in enumerate(out):
        items = list(d.items())
        assert items[0][0] == nxt[j]
        assert math.isclose(items[0][1].logprob, float(ref[j, nxt[j]]), abs_tol=1e-5)
        assert items[0][1].rank == int((ref[j] > ref[j, nxt[j]]).sum()) + 1
        top2 = ref[j].argsort(descending=True)[:2].tolist()
        assert {t: lp.rank for t, lp in items[1:]} == {
            t: r + 1 for r, t in enumerate(top2) if t != nxt[j]
        }
    assert [list(d) for d in prompt_logprobs(logits, nxt, num_top=0)] == [[t] for t in nxt]
    assert prompt_logprobs(logits[:0], [], 3) == []
    with pytest.raises(ValueError):
        prompt_logprobs(logits, nxt[:-1], 2)


def test_empty_batch_and_half_precision_logits():
    assert Sampler(None)(torch.zeros(0, 10), []).token_ids == []
    logits = torch.randn(3, 17).to(torch.bfloat16)
    seqs = [make_seq(temperature=0.0, logprobs=1, rid=str(i)) for i in range(3)]
    out = Sampler(None)(logits, seqs)
    assert out.token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_and_allowed_token_ids(device):
    logits = torch.randn(4, 37, device=device)
    params = [SamplingParams(logit_bias={3: 2.5, 30: -100.0}), SamplingParams(),
              SamplingParams(allowed_token_ids=[5, 9, 36], logit_bias={9: -1.5}), SamplingParams(allowed_token_ids=[0])]
    got = apply_token_constraints(logits, params).cpu().double()
    want = logits.cpu().double().clone()
    want[0, 3] += 2.5
    want[0, 30] -= 100.0
    keep = torch.zeros(37, dtype=torch.bool)
    keep[[5, 9, 36]] = True
    want[2] = torch.where(keep, want[2], float("-inf"))
    want[2, 9] -= 1.5
    want[3, 1:] = float("-inf")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # in the sampler: +100 forces a token even when greedy, -100 bans the argmax; logprobs stay raw
    argmax = logits.argmax(-1).tolist()
    seqs = [make_seq(rid="a", temperature=0.0, logit_bias={(argmax[0] + 1) % 37: 100.0}, logprobs=0),
            make_seq(rid="b", temperature=0.0, logit_bias={argmax[1]: -100.0}),
            make_seq(rid="c", temperature=1.0, seed=4, allowed_token_ids=[5, 9, 36])]
    out = Sampler(None)(logits[:3], seqs)
    assert out.token_ids[0] == (argmax[0] + 1) % 37
    assert out.token_ids[1] == logits[1].clone().index_fill_(0, torch.tensor(argmax[1], device=device), -1e9).argmax()
    assert out.token_ids[2] in (5, 9, 36)
    raw = torch.log_softmax(logits[0].double(), -1)[out.token_ids[0]].item()
    assert out.logprobs[0][out.token_ids[0]].logprob == pytest.approx(raw, abs=1e-5)


def test_allowed_token_ids_sample_the_renormalised_softmax():
    n = 3000
    logits = PROBS.log().expand(n, -1).contiguous()
    allowed = [0, 2, 4]
    seqs = [make_seq(rid=str(i), allowed_token_ids=allowed, logit_bias={2: math.log(2.0)}) for i in range(n)]
    tokens = Sampler(None)(logits, seqs).token_ids
    target = torch.zeros_like(PROBS)
    target[allowed] = PROBS[allowed]
    target[2] *= 2.0
    assert chi_square(tokens, target / target.sum()) < CHI2_LIMIT
