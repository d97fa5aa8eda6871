"""Incremental detokenisation, for streaming and stop strings.

Decoding a growing token list one token at a time is not a matter of decoding each token alone:
byte-level BPE splits characters over tokens, and tokenizers merge spaces. Each step decodes a
short window (a few tokens of context before the new ones) and keeps the new text only when it
does not end in an incomplete character (U+FFFD). This is the usual windowed method; offsets are
kept per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTEXT = 6  # tokens of left context decoded with the new ones


@dataclass
class DecodeState:
    text: str = ""
    prefix_offset: int = 0  # start of the context window in the output ids
    read_offset: int = 0  # output ids before this are already in `text`


class Detokenizer:
    """Wraps a transformers tokenizer. `step(state, output_ids)` returns the text delta."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def step(self, state: DecodeState, output_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Advance `state` over output_ids (the whole list so far); return the new text."""
        if state.read_offset >= len(output_ids):
            return ""
        prefix = self._decode(output_ids[state.prefix_offset : state.read_offset], skip_special_tokens)
        full = self._decode(output_ids[state.prefix_offset :], skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        delta = full[len(prefix) :]
        state.text += delta
        state.read_offset = len(output_ids)
        state.prefix_offset = max(0, state.read_offset - _CONTEXT)
        return delta
