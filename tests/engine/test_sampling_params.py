"""SamplingParams: defaults, normalisation, and a clear ValueError for every nonsensical value."""

import pytest

from mambaserve.sampling_params import Logprob, SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.prompt_logprobs is None and p.skip_special_tokens and not p.ignore_eos
    assert not p.include_stop_str_in_output and not p.is_greedy and not p.has_penalties


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.is_greedy and p.has_penalties
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(logprobs=0, prompt_logprobs=5).logprobs == 0
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(seed=1.0), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1, 2]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={"7": 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: 100.5}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids="12"), "allowed_token_ids"),
        (dict(ignore_eos="false"), "ignore_eos"),  # a truthy string would have ignored EOS
        (dict(ignore_eos=0), "ignore_eos"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(stop=5), "stop"),
        (dict(stop=b"###"), "stop"),
        (dict(stop_token_ids=7), "stop_token_ids"),
    ],
)
def test_nonsense_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
