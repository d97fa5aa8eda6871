"""Incremental detokenisation and stop strings, with the demo model's byte-level BPE tokenizer."""

import pytest
import torch
from transformers import AutoTokenizer

from mambaserve import LLM, SamplingParams
from mambaserve.config import default_model
from mambaserve.engine.detokenizer import DecodeState, Detokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model())


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # ünïcödé ✓ 日本語 🙂\n", "a  b\t\tc\n\n\n    d"])
def test_deltas_add_up_to_the_full_decode(tok, text):
    ids = tok(text)["input_ids"]
    d, state, pieces = Detokenizer(tok), DecodeState(), []
    for n in range(1, len(ids) + 1):
        pieces.append(d.step(state, ids[:n]))
    assert "".join(pieces) == state.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_random_token_streams_never_emit_broken_characters(tok):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tok.vocab_size, (30,), generator=g).tolist()
        d, state = Detokenizer(tok), DecodeState()
        for n in range(1, len(ids) + 1):
            d.step(state, ids[:n], skip_special_tokens=True)
        full = tok.decode(ids, skip_special_tokens=True)
        # held-back partial characters at the very end are allowed to be missing
        assert full.startswith(state.text) and len(full) - len(state.text) <= 4


def test_stop_strings_cut_the_text():
    llm = LLM(dtype="float32", device="cpu")
    base = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = base.text[5:9]
    assert stop and stop in base.text
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                          include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index(stop) + len(stop)]
    assert llm.llm_engine.usage().num_slots_used == 0


def test_stop_token_text_is_left_out():
    llm = LLM(dtype="float32", device="cpu")
    base = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[6]
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1] and out.stop_reason == stop_tok
    assert out.text == tok.decode(base.token_ids[:first])


def test_stop_strings_wait_for_min_tokens():
    # vLLM: stop strings count only once more than min_tokens tokens exist, and only in the text
    # that is new from then on; an occurrence inside the first min_tokens tokens never stops it
    llm = LLM(dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    base = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    min_tokens = 8
    head = tok.decode(base.token_ids[:min_tokens])
    stop = next(w for w in (" of", " the", " a", "e") if w in head and w in base.text[len(head):])
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40, min_tokens=min_tokens,
                                                          stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > min_tokens
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop, len(head))]
    assert llm.llm_engine.usage().num_slots_used == 0
