"""Incremental detokenisation, for streaming, stop strings and logprob labels.

Decoding a growing token list one token at a time is not a matter of decoding each token alone:
byte-level BPE splits characters over tokens, byte-fallback tokenizers spell a character as
several <0xXX> tokens, and SentencePiece-style decoders (Metaspace, Llama's "strip one leading
space") drop the space marker of the first token they decode, so "▁is" alone reads "is" but
" is" after a word. Each step therefore decodes a short window, a few tokens of context before
the new ones, and keeps the text the new tokens add to the context's text; it holds the text
back while it ends in an incomplete character (U+FFFD). The first window reaches back into the
prompt (`DecodeState.after_prompt`), so the first generated token keeps its leading space: the
output text is what `decode(prompt + output)` adds to `decode(prompt)`. This is the prefix
offset / read offset method of vLLM's incremental detokenizer, written for this engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_CONTEXT = 6  # tokens of left context decoded with the new ones


@dataclass
class DecodeState:
    """Per sequence: the text so far and two offsets into `context + output ids`."""

    text: str = ""
    prefix_offset: int = 0  # start of the context window
    read_offset: int = 0  # ids before this are already in `text`
    context: list[int] = field(default_factory=list)  # the prompt's last ids, decoded before the output

    @classmethod
    def after_prompt(cls, prompt_token_ids: list[int]) -> DecodeState:
        """The state of a sequence that continues `prompt_token_ids` (nothing decoded yet)."""
        context = list(prompt_token_ids[-_CONTEXT:])
        return cls(prefix_offset=0, read_offset=len(context), context=context)


def _tail(state: DecodeState, output_ids: list[int], start: int) -> list[int]:
    """(state.context + output_ids)[start:], without copying the whole output."""
    n = len(state.context)
    return state.context[start:] + output_ids if start < n else output_ids[start - n:]


class Detokenizer:
    """Wraps a transformers tokenizer. `step(state, output_ids)` returns the text delta."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def step(self, state: DecodeState, output_ids: list[int], skip_special_tokens: bool = True,
             final: bool = False) -> str:
        """Advance `state` over output_ids (the whole list so far); return the new text. final:
        the sequence ends with these ids, so an incomplete character at the end is no longer
        held back (it reads U+FFFD, as in decode())."""
        total = len(state.context) + len(output_ids)
        if state.read_offset >= total:
            return ""
        window = _tail(state, output_ids, state.prefix_offset)
        prefix = self._decode(window[: state.read_offset - state.prefix_offset], skip_special_tokens)
        full = self._decode(window, skip_special_tokens)
        if full.endswith("\ufffd") and not final:
            return ""  # wait for the rest of the character
        delta = full[len(prefix):]
        state.text += delta
        state.read_offset = total
        state.prefix_offset = max(0, total - _CONTEXT)
        return delta

    def token_text(self, context_ids: list[int], token: int) -> str:
        """The text `token` adds after `context_ids` (a few tokens before it; may be empty):
        a logprob label that keeps the token's leading space in SentencePiece vocabularies, so
        that "▁[" reads " [" and stays apart from "[". Special tokens are spelled out. Falls
        back to the token decoded alone where the context's text is no prefix of the whole's
        (the context ends in an incomplete character)."""
        context = list(context_ids[-_CONTEXT:])
        if not context:
            return self._decode([token], False)
        prefix = self._decode(context, False)
        full = self._decode(context + [token], False)
        if prefix.endswith("\ufffd") or not full.startswith(prefix):
            return self._decode([token], False)
        return full[len(prefix):]

    def label_logprobs(self, logprobs: dict, context_ids: list[int]) -> None:
        """Set `decoded_token` of every entry of one position's {token id: Logprob}, each as the
        text it adds after `context_ids` (the tokens before that position)."""
        for tok, lp in logprobs.items():
            lp.decoded_token = self.token_text(context_ids, tok)
