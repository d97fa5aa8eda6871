"""Incremental detokenisation and stop strings: the demo model's byte-level BPE tokenizer, and the
tokenizer kinds of `tests/tokenized.py` (byte-level BPE, SentencePiece-style Unigram and BPE with
byte fallback)."""

import pytest
import torch
from transformers import AutoTokenizer

from mambaserve import LLM, SamplingParams
from mambaserve.config import default_model
from mambaserve.engine.detokenizer import DecodeState, Detokenizer
from tests.tokenized import KINDS, build_tokenizer, tokenized_checkpoint


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
                                                          include_stop_str_in_output=True),
                                                          use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index(stop) + len(stop)]
    assert llm.llm_engine.usage().num_slots_used == 0


def test_streamed_text_only_grows_and_ends_as_the_whole():
    """Outputs of LLMEngine.step() for a request with stop strings: each text is a prefix of the
    next and of the final one (vLLM holds back the tail a stop could start in); without that,
    the start of a stop string showed and then vanished. Random stops from the greedy text."""
    import random

    llm = LLM(dtype="float32", device="cpu")
    engine, rng = llm.llm_engine, random.Random()
    prompt = "def fibonacci(n):"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0].text
    for _ in range(4):
        cut = rng.randrange(8, len(base) - 6)
        stops = [base[cut:cut + rng.randrange(2, 7)], "\x00never" * rng.randrange(1, 3)]
        params = SamplingParams(temperature=0, max_tokens=48, stop=stops)
        whole = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        engine.add_request("s", prompt, params)
        texts = []
        while engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in engine.step()]
        assert texts[-1] == whole == base[:base.index(stops[0])]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), (stops, texts)


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


# ---------------------------------------------------------------- other tokenizer kinds
TEXTS = ["Simple is better [than] complex é ✓ 日本 🙂 is is", "def fibonacci(n):\n    return a  [1] [ 2 ]\n\n  x"]


def _kind_tokenizer(kind: str):
    return AutoTokenizer.from_pretrained(default_model()) if kind == "demo" else build_tokenizer(197, kind)


def _continuation(tok, prompt: list[int], output: list[int]) -> str | None:
    """What decode(prompt + output) adds to decode(prompt), or None where decode(prompt) is no
    prefix of it (then no continuation text is right)."""
    def d(ids):
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head, whole = d(prompt), d(prompt + output)
    return whole[len(head):] if whole.startswith(head) else None


def _stream(tok, prompt: list[int], output: list[int]) -> tuple[list[str], DecodeState]:
    d, state = Detokenizer(tok), DecodeState.after_prompt(prompt)
    return [d.step(state, output[:n]) for n in range(1, len(output) + 1)], state


@pytest.mark.parametrize("kind", KINDS + ("demo",))
def test_output_text_is_what_it_adds_to_the_prompt(kind):
    """Streamed deltas add up to the text, which is what the output adds to the prompt's text:
    the first token keeps its leading space in SentencePiece vocabularies (Metaspace, byte
    fallback), and byte-level BPE stays as it was. Cuts anywhere, also inside a character."""
    tok = _kind_tokenizer(kind)
    g = torch.Generator().manual_seed(1)
    cases = [(ids[:c], ids[c:]) for text in TEXTS for ids in [tok(text)["input_ids"]] for c in range(1, len(ids))]
    cases += [(ids[:c], ids[c:]) for _ in range(10)
              for ids in [torch.randint(0, len(tok), (24,), generator=g).tolist()] for c in (1, 5, 12)]
    checked = 0
    for prompt, output in cases:
        pieces, state = _stream(tok, prompt, output)
        assert "".join(pieces) == state.text
        ref = _continuation(tok, prompt, output)
        if ref is None:
            continue
        if ref.endswith("\ufffd"):  # an incomplete last character is held back
            assert ref.startswith(state.text)
        else:
            assert state.text == ref, (prompt, output)
            checked += 1
    assert checked > len(cases) // 2


@pytest.mark.parametrize("kind", ["sp-unigram", "sp-bpe", "byte-bpe"])
def test_first_generated_word_keeps_its_space(kind):
    tok = build_tokenizer(197, kind)
    prompt, word = tok("Simple")["input_ids"], tok(" is")["input_ids"][-1]
    assert tok.convert_ids_to_tokens(word) in ("▁is", "Ġis")
    pieces, state = _stream(tok, prompt, [word] * 3)
    assert pieces == [" is"] * 3 and state.text == " is is is"


@pytest.mark.parametrize("kind", KINDS)
def test_token_text_keeps_the_space_that_sets_twins_apart(kind):
    """Logprob labels: twins such as "▁[" (" [") and "[" ("[") read apart after a word, for every
    pair of twins in the vocabulary; a token alone reads as decode([token]); a byte-fallback
    fragment after a word reads as U+FFFD, not as the word."""
    tok = build_tokenizer(197, kind)
    d, ctx = Detokenizer(tok), tok("Simple is")["input_ids"]
    vocab = tok.get_vocab()
    twins = [(vocab[m + w], vocab[w]) for w in vocab for m in "▁Ġ" if m + w in vocab and w.isprintable()]
    assert len(twins) >= 2
    for spaced, bare in twins:
        assert d.token_text(ctx, spaced) == " " + tok.decode([bare]) and d.token_text(ctx, bare) == tok.decode([bare])
        assert d.token_text([], bare) == tok.decode([bare])
    if kind == "sp-bpe":
        assert d.token_text(ctx, tok.convert_tokens_to_ids("<0xC3>")) == "\ufffd"


@pytest.mark.parametrize("kind", ["sp-unigram", "sp-bpe"])
def test_engine_text_stop_strings_and_labels_with_sentencepiece(kind):
    """Through the engine: three forced "▁is" read " is is is"; the stop string " is" stops at
    the first token (not one late); a free greedy run's text is what it adds to the prompt; the
    logprob labels keep the space."""
    llm = LLM(model=tokenized_checkpoint("mamba2", kind), dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    word = tok(" is")["input_ids"][-1]
    forced = {"temperature": 0, "max_tokens": 3, "allowed_token_ids": [word], "ignore_eos": True}
    out = llm.generate("Simple", SamplingParams(**forced, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [word] * 3 and out.text == " is is is"
    assert [d[word].decoded_token for d in out.logprobs] == [" is"] * 3
    out = llm.generate("Simple", SamplingParams(**forced, stop=[" is"]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [word] and out.text == "" and out.stop_reason == " is"
    for prompt in ("Simple is", "The quick brown fox", "def add(a, b):"):
        res = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        assert res.outputs[0].text == _continuation(tok, res.prompt_token_ids, res.outputs[0].token_ids)
    assert llm.llm_engine.usage().num_slots_used == 0
