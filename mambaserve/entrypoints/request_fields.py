"""Which request fields of the OpenAI API and of vLLM's extensions the server implements, and
what it does with the others: nothing is dropped without a word.

Every field a request model declares is implemented. The fields below are known (OpenAI's or
vLLM's) but not implemented: a request may send one only with the value that means "off" (its
default, or null), which changes nothing; any other value is a 400 naming the field. A field
that is neither declared nor listed is unknown: also a 400 naming it (the models forbid extra
fields). `user` is accepted and ignored, as vLLM ignores it (it only labels the caller).
"""

from __future__ import annotations

from typing import Any


class UnsupportedFieldError(ValueError):
    """A known request field set to a value this server does not implement."""

    def __init__(self, field: str, why: str = ""):
        self.param = field
        super().__init__(f"`{field}` is not supported by this server{': ' + why if why else ''}")


_OFF = object()  # only null turns the field off

# field -> the value that leaves it off (besides null)
COMMON: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": _OFF, "truncation_side": _OFF,
    "logprob_token_ids": _OFF, "bad_words": [], "priority": 0, "request_id": _OFF, "session_id": _OFF,
    "return_tokens_as_token_ids": False, "return_token_ids": False, "return_token_offsets": False,
    "routed_experts_prompt_start": 0, "kv_transfer_params": _OFF,
    "ec_transfer_params": _OFF, "vllm_xargs": _OFF, "repetition_detection": _OFF, "stream_interval": _OFF,
    "logits_processors": _OFF, "watermarking": False, "guided_whitespace_pattern": _OFF,
    "service_tier": _OFF, "metadata": _OFF, "store": False, "safety_identifier": _OFF,
    "prompt_cache_key": _OFF, "prompt_cache_retention": _OFF, "prompt_cache_options": _OFF,
    "mm_processor_kwargs": _OFF, "media_io_kwargs": _OFF,
}
CHAT: dict[str, Any] = {
    **COMMON, "audio": _OFF, "modalities": ["text"], "function_call": _OFF, "functions": _OFF, "prediction": _OFF,
    "reasoning_effort": _OFF, "verbosity": _OFF, "web_search_options": _OFF, "moderation": _OFF,
    "echo": False, "chat_template": _OFF, "thinking_token_budget": _OFF, "include_reasoning": True,
    "return_prompt_text": False, "return_mm_kwargs": True, "best_of": _OFF,
}
COMPLETION: dict[str, Any] = {**COMMON, "prompt_embeds": _OFF}
STREAM_OPTIONS: dict[str, Any] = {"include_obfuscation": False}

_WHY = {
    "use_beam_search": "no beam search", "function_call": "use tools and tool_choice",
    "functions": "use tools and tool_choice", "chat_template": "the model's own chat template is used",
    "guided_whitespace_pattern": "xgrammar takes no whitespace pattern (use disable_any_whitespace)",
    "include_obfuscation": "stream chunks are sent unpadded",
}


def drop_unsupported(data: Any, table: dict[str, Any]) -> Any:
    """`data` (a request's JSON object) without the fields of `table` that are off; raises
    UnsupportedFieldError for one that is on."""
    if not isinstance(data, dict) or not table:
        return data
    out = {}
    for k, v in data.items():
        if k not in table:
            out[k] = v
            continue
        off = table[k]
        if v is None or (off is not _OFF and type(v) is type(off) and v == off):
            continue
        raise UnsupportedFieldError(k, _WHY.get(k, ""))
    return out
