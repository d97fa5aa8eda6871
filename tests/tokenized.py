"""A tiny checkpoint that has a tokenizer, for tests that speak text (server, CLI, chat).

`tokenized_checkpoint(name)` copies a tiny random checkpoint of `tests/models/tiny.py` and
saves beside it a byte-level BPE tokenizer trained on a few KB of text, with a vocabulary no
larger than the model's, `<|endoftext|>` at the model's EOS id, and a small chat template.
The model's weights are random: its text is gibberish, but deterministic.

Characters the tokenizer never saw in training (most of non-ASCII) become `<|unk|>`: the
vocabulary is too small for the 256 byte symbols.
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


def build_tokenizer(vocab_size: int):
    """A transformers fast tokenizer (byte-level BPE) of at most vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator([training_text()], trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [0, 1, 2]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|startoftext|>", eos_token="<|endoftext|>",
        unk_token="<|unk|>", additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.lru_cache(maxsize=None)
def tokenized_checkpoint(name: str = "granite-moe") -> str:
    """Path of a copy of the tiny checkpoint `name` with a tokenizer saved in it (built once
    per test session)."""
    path = tempfile.mkdtemp(prefix=f"mambaserve-{name}-tok-")
    shutil.copytree(checkpoint(name), path, dirs_exist_ok=True)
    build_tokenizer(CONFIGS[name]["vocab_size"]).save_pretrained(path)
    return path
