"""Text and logprob labels through the server, for each tokenizer kind of `tests/tokenized.py`
(byte-level BPE, SentencePiece-style Unigram, SentencePiece-style BPE with byte fallback).

A completion's text is what its tokens add to the prompt's text (decode(prompt + output) minus
decode(prompt)): the first word keeps its leading space; streamed deltas add up to it; echo
puts it right after the prompt; a stop string that starts with a space stops where it starts.
top_logprobs hold one entry per token, also for prompt tokens under echo.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from mambaserve import LLM, SamplingParams  # noqa: E402
from tests.entrypoints.servers import KEY, MODEL, NUM_KV_BLOCKS, running_server, stream_text  # noqa: E402
from tests.tokenized import KINDS, tokenized_checkpoint  # noqa: E402

PROMPTS = ["Simple is", "The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module", params=KINDS)
def setup(request):
    """(openai client, offline LLM over the same checkpoint, tokenizer) per tokenizer kind."""
    path = tokenized_checkpoint("mamba2", request.param)
    llm = LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    with running_server("--api-key", KEY, model=path) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
            yield client, llm, llm.get_tokenizer()


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_text_streamed_echoed_and_decoded_agree(setup):
    client, llm, tok = setup
    for prompt in PROMPTS:
        ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
        ids = ref.prompt_token_ids + ref.outputs[0].token_ids
        want = _decode(tok, ids)[len(_decode(tok, ref.prompt_token_ids)):]
        kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == want
        texts, _, _ = stream_text(client.completions.create(**kw, stream=True))
        assert texts[0] == want
        echoed = client.completions.create(**kw, echo=True).choices[0].text
        assert echoed == prompt + want
        texts, _, _ = stream_text(client.completions.create(**kw, echo=True, stream=True))
        assert texts[0] == echoed


def test_stop_string_with_a_leading_space_stops_at_once(setup):
    """Forced "▁is" / "Ġis" tokens: the text is " is is is"; stop=" is" stops at the first."""
    client, _, tok = setup
    word = tok(" is")["input_ids"][-1]
    kw = dict(model=MODEL, prompt="Simple", max_tokens=3, temperature=0,
              extra_body={"allowed_token_ids": [word], "ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == " is is is"
    r = client.completions.create(**kw, stop=[" is"])
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    texts, reasons, _ = stream_text(client.completions.create(**kw, stop=[" is"], stream=True))
    assert texts.get(0, "") == "" and reasons[0] == "stop"
    r = client.completions.create(**kw, echo=True, logprobs=0)
    assert r.choices[0].text == "Simple is is is" and r.choices[0].logprobs.tokens[-3:] == [" is"] * 3


@pytest.mark.parametrize("echo", [False, True])
def test_top_logprobs_one_entry_per_token(setup, echo):
    """logprobs=20: as many entries as the engine has tokens at each position (20, or 21 where
    the actual token is not among the 20), the values the engine's, most likely first; labels
    that would collide are told apart. Prompt positions too under echo."""
    client, llm, _ = setup
    num = 20
    for prompt in PROMPTS:
        ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=num,
                                                  prompt_logprobs=num if echo else None), use_tqdm=False)[0]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=num,
                                      echo=echo, extra_body={"ignore_eos": True})
        engine = (ref.prompt_logprobs if echo else []) + ref.outputs[0].logprobs
        got = r.choices[0].logprobs.top_logprobs
        assert len(got) == len(engine)
        for i, (top, d) in enumerate(zip(got, engine)):
            if d is None:
                assert top is None and i == 0
                continue
            assert len(top) == len(d), f"position {i}"
            want = sorted((lp.logprob for lp in d.values()), reverse=True)
            assert list(top.values()) == pytest.approx(want, abs=1e-6)
            if not echo or i >= len(ref.prompt_token_ids):
                assert len(top) == num  # greedy: the chosen token is among the 20


def test_colliding_labels_keep_every_entry_and_its_value():
    from mambaserve.entrypoints.serving_common import top_logprobs_by_label
    from mambaserve.sampling_params import Logprob

    # the actual token (7, rank 9) first, as the engine orders them; 3 and 5 read alike
    d = {7: Logprob(-4.0, 9, "x"), 3: Logprob(-0.5, 1, "\ufffd"), 4: Logprob(-1.0, 2, "a"),
         5: Logprob(-2.0, 3, "\ufffd")}
    top = top_logprobs_by_label(d, lambda t, lp: lp.decoded_token)
    assert top == {"\ufffd": -0.5, "a": -1.0, "token_id:5": -2.0, "x": -4.0}
    assert list(top) == ["\ufffd", "a", "token_id:5", "x"]
