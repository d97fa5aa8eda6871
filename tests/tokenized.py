"""A tiny checkpoint that has a tokenizer, for tests that speak text (server, CLI, chat).

`tokenized_checkpoint(name, kind)` copies a tiny random checkpoint of `tests/models/tiny.py` and
saves beside it a tokenizer of a few KB of text, with a vocabulary no larger than the model's,
`<|endoftext|>` at the model's EOS id, and a small chat template. The model's weights are
random: its text is gibberish, but deterministic. Tokenizer kinds (`KINDS`):
- "byte-bpe": byte-level BPE (GPT-2 style, Granite's and the demo model's kind); characters it
  never saw in training (most of non-ASCII) become `<|unk|>`: the vocabulary is too small for
  the 256 byte symbols.
- "sp-unigram": a SentencePiece-style Unigram model, words as "▁word" pieces (Metaspace), whose
  decoder drops the space marker of the first token decoded; "▁[" and "[" both exist.
- "sp-bpe": a SentencePiece-style BPE (Llama / Mistral / Jamba layout: Metaspace, byte fallback
  to <0xXX> tokens for the bytes of `FALLBACK_CHARS`, a decoder that strips one leading space).
"""

from __future__ import annotations

import functools
import shutil
import tempfile

from tests.models.tiny import CONFIGS, checkpoint

# Ids 0, 1, 2 match the tiny configs' pad, bos and eos ids.
SPECIAL_TOKENS = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|unk|>", "<|system|>", "<|user|>",
                  "<|assistant|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_TEXT = """
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Readability counts. Errors should never pass silently, unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess. Now is better than never.
If the implementation is hard to explain, it is a bad idea.
def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
I am fine, thank you. What is the capital of France? The capital of France is Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: ( ) [ ] { } < > = + - * / % # @ & | ; : ' " ! ? , .
Tell me a story about a cat who lived in a small house near the sea and liked to read books.
"""


def training_text() -> str:
    """The few KB of text the tokenizer is trained on (some code and prose)."""
    return _TEXT * 3


KINDS = ("byte-bpe", "sp-unigram", "sp-bpe")
FALLBACK_CHARS = "éü✓日本🙂"  # sp-bpe spells these with byte tokens


def _byte_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator([training_text()], trainer=trainer)
    return tok


def _sp_unigram(vocab_size: int):
    """Specials, then every character of the text, "▁", then the text's most frequent words as
    "▁word" pieces (and a few bare ones), scored by log frequency: SentencePiece's layout."""
    import collections
    import math

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    text = training_text()
    chars = sorted(set(text) - {" ", "\n"}) + ["\n"]
    words = collections.Counter(text.split())
    pieces = dict.fromkeys(SPECIAL_TOKENS, 0.0) | {"▁": -2.0} | dict.fromkeys(chars, -8.0)
    pieces |= {"is": -6.0, "better": -6.0, "▁[": -5.0}  # twins of "▁is", "▁better", "["
    for w, n in words.most_common():
        if len(pieces) >= vocab_size:
            break
        pieces.setdefault("▁" + w, math.log(n / len(text)))
    tok = Tokenizer(models.Unigram(list(pieces.items())[:vocab_size], unk_id=SPECIAL_TOKENS.index("<|unk|>")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _sp_bpe(vocab_size: int):
    """BPE trained on the text split at "▁" word starts, rebuilt with byte fallback: the bytes of
    FALLBACK_CHARS get <0xXX> tokens at the end of the vocabulary."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in sorted({b for c in FALLBACK_CHARS for b in c.encode()})]
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE(unk_token="<|unk|>"))
    trained.pre_tokenizer = meta
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(byte_tokens), special_tokens=SPECIAL_TOKENS,
                                  show_progress=False)
    trained.train_from_iterator([training_text()], trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({t: len(vocab) + i for i, t in enumerate(byte_tokens)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<|unk|>", byte_fallback=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def build_tokenizer(vocab_size: int, kind: str = "byte-bpe"):
    """A transformers fast tokenizer of the given kind (see the module docstring) of at most
    vocab_size tokens."""
    from transformers import PreTrainedTokenizerFast

    tok = {"byte-bpe": _byte_bpe, "sp-unigram": _sp_unigram, "sp-bpe": _sp_bpe}[kind](vocab_size)
    assert tok.get_vocab_size() <= vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [0, 1, 2]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|startoftext|>", eos_token="<|endoftext|>",
        unk_token="<|unk|>", additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.cache
def tokenized_checkpoint(name: str = "granite-moe", kind: str = "byte-bpe") -> str:
    """Path of a copy of the tiny checkpoint `name` with a tokenizer of `kind` saved in it (built
    once per test session)."""
    path = tempfile.mkdtemp(prefix=f"mambaserve-{name}-{kind}-")
    shutil.copytree(checkpoint(name), path, dirs_exist_ok=True)
    build_tokenizer(CONFIGS[name]["vocab_size"], kind).save_pretrained(path)
    return path
