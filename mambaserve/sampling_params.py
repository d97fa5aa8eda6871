"""Per-request sampling parameters with vLLM / OpenAI semantics, and the `Logprob` record.

`SamplingParams` is user input: it validates itself on creation and raises `ValueError` with a
message naming the field. It knows nothing about tokenizers or models: the number of tokens a
request may produce beyond `max_tokens` (the model's context length) and token ids outside the
vocabulary are checked by the engine, which knows those limits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by them would overflow float32.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class Logprob:
    """The log-probability of one token, as returned beside sampled and prompt tokens.

    logprob: natural-log probability under the model's raw distribution.
    rank: 1 for the most likely token of the vocabulary, 2 for the next, ...; None if unknown.
    decoded_token: the token's text, filled by the detokenizer (None until then).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float (not a bool): inf or NaN in a sampling parameter turns logits into NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the text of a completion (vLLM's `StructuredOutputsParams`): exactly one of

    json: a JSON schema (a dict, or its JSON text) the completion must be an instance of.
    regex: a regular expression the whole completion must match.
    choice: a list of strings, one of which the completion must be exactly.
    grammar: an EBNF grammar (GBNF notation, rule `root` first; or Lark's, root `start` or the
        first rule) the completion must derive.
    json_object: True for any JSON object (OpenAI's JSON mode).

    Options: disable_any_whitespace (JSON without free whitespace between tokens: compact and
    faster to finish), disable_additional_properties (objects of a schema take no property it
    does not list; the grammar engine already treats a schema without `additionalProperties`
    so). whitespace_pattern and structural_tag are vLLM's too, but not supported: setting one
    is a ValueError.

    Validated on creation (ValueError naming the field); whether a schema, regex or grammar
    compiles is checked when the request is added, by the grammar engine.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {kinds or 'none'}")
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"StructuredOutputsParams.{name} is not supported")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams.{name} must be a bool, got {getattr(self, name)!r}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object), "
                                 f"got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"StructuredOutputsParams.choice must be a list of strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("StructuredOutputsParams.json_object must be True (or left out), "
                             f"got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    n: number of completions to return for the prompt.
    temperature: softmax temperature; 0 (anything below 1e-5) means greedy decoding.
    top_p: nucleus sampling; keep the smallest set of most likely tokens whose probability
        reaches top_p (1.0 = off).
    top_k: keep the k most likely tokens (0 or -1 = off).
    min_p: drop tokens whose probability is below min_p times the most likely one's (0 = off).
    seed: makes this request's sampling reproducible, whatever else is in the batch.
    presence_penalty, frequency_penalty: OpenAI penalties in [-2, 2] over the tokens generated
        so far (subtracted from the logit once if present / once per occurrence).
    repetition_penalty: HF-style multiplicative penalty (> 0, 1 = off) over prompt and output
        tokens: positive logits are divided by it, negative ones multiplied.
    stop: strings that end the completion (a str is normalised to a one-item list).
    stop_token_ids: token ids that end the completion, besides EOS.
    ignore_eos: keep generating after EOS (stop strings and stop_token_ids still apply).
    max_tokens: maximum number of generated tokens; None = up to the model's context length.
    min_tokens: EOS and stop_token_ids cannot be sampled, and stop strings do not count,
        before this many tokens.
    logprobs: if not None, return the sampled token's logprob and this many top logprobs.
    prompt_logprobs: if not None, return each prompt token's logprob and this many top ones.
    skip_special_tokens: leave special tokens out of the detokenized text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    logit_bias: {token id: bias} added to the raw logits before penalties and sampling (OpenAI's
        logit_bias; each bias in [-100, 100]: -100 in effect bans a token, 100 forces it).
    allowed_token_ids: if not None, only these token ids can be generated (the rest get -inf).
    Their token ids must be in the model's vocabulary: the engine refuses the request otherwise.
    structured_outputs: a `StructuredOutputsParams` constraint on the text (JSON schema, regex,
        choice, grammar, JSON object), applied to the logits before every other step of sampling;
        EOS is allowed only where the constraint is complete. Needs the `xgrammar` package.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name, what in (("stop", "a string or a list of strings"), ("stop_token_ids", "a list of token ids")):
            value = getattr(self, name)
            if isinstance(value, bytes) or not (value is None or isinstance(value, str) or hasattr(value, "__iter__")):
                raise ValueError(f"SamplingParams.{name} must be {what}, got {value!r:.80}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got "
                             f"{self.logit_bias!r:.80}")
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not hasattr(self.allowed_token_ids, "__iter__"):
                raise ValueError("SamplingParams.allowed_token_ids must be a list of token ids, got "
                                 f"{self.allowed_token_ids!r:.80}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()
        if self.logit_bias:
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # a truthy "false" would turn the flag on
                raise bad(name, "must be a bool")
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise bad("temperature", "must be a number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 = off)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "must fit in 64 bits (-2**63 <= seed < 2**63)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0 (1 = off)")
        if any(not isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain an empty string")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed "
                f"max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, "must be an integer >= 0 or None")
        for t, b in (self.logit_bias or {}).items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not _is_number(b) or not -100.0 <= b <= 100.0:
                raise ValueError(f"SamplingParams.logit_bias[{t}] must be a number in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (None = every token allowed)")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a list of non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")

    def biased_token_ids(self) -> list[int]:
        """The token ids of logit_bias and allowed_token_ids, for the engine's vocabulary check
        (a stop token id outside the vocabulary is harmless: it is never generated)."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def is_greedy(self) -> bool:
        """True when decoding is greedy (temperature 0): top-k/top-p/min-p/seed do not matter."""
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
