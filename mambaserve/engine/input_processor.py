"""Input processing: from what a user sends (a prompt and SamplingParams) to validated sequences.

It loads the tokenizer, knows the end-of-sequence ids (the model config's, the tokenizer's and
generation_config.json's), parses and tokenizes prompts, checks them against the vocabulary and
max_model_len, takes a private copy of the sampling parameters, and fans a request with n > 1
out into n sequences. It changes no engine state: a request it refuses leaves nothing behind.
It knows nothing of scheduling, caches or outputs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from mambaserve.config import EngineConfig
from mambaserve.engine.sequence import Sequence
from mambaserve.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve")


class QueueFullError(RuntimeError):
    """add_request found no room for a request's n sequences within max_queue_len (the server answers 503)."""


@dataclass
class ProcessedRequest:
    """A validated request: its prompt (text, or None for token ids), prompt token ids, its
    own SamplingParams, and one Sequence per completion ("id" for n = 1, "id#0".."id#{n-1}")."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float


def load_tokenizer(config: EngineConfig):
    """The transformers tokenizer of config.tokenizer (default: the model's directory), or None
    with skip_tokenizer_init. Raises ValueError when it cannot be loaded."""
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    path = config.tokenizer or config.model
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code,
                                             use_fast=config.tokenizer_mode != "slow")
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(f"could not load a tokenizer from {path!r} "
                         f"(use skip_tokenizer_init=True for token ids only): {e}") from e


def generation_config_folder(config: EngineConfig) -> str | None:
    """Where generation_config.json is read from (vLLM's generation_config): "auto" the model's
    folder, "vllm" none (None), else the folder named."""
    if config.generation_config == "vllm":
        return None
    return config.model if config.generation_config == "auto" else config.generation_config


def read_generation_config(model_dir: str | None) -> dict:
    """The generation_config.json of `model_dir` as a dict; {} when there is none (or no folder),
    or it is unreadable (logged)."""
    path = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}


# generation_config.json keys vLLM takes as the default sampling parameters, by SamplingParams name
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_sampling_defaults(model_dir: str | None) -> dict:
    """The default sampling parameters a checkpoint's generation_config.json sets ({SamplingParams
    field: value}), as vLLM applies them to requests that leave them unset; do_sample is not read
    (as in vLLM)."""
    data = read_generation_config(model_dir)
    return {name: data[key] for key, name in GENERATION_DEFAULTS.items()
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)}


def generation_config_eos_ids(model_dir: str | None) -> list[int]:
    """eos_token_id of the checkpoint's generation_config.json (an id or a list), or [] when
    there is none or it is unreadable (logged)."""
    eos = read_generation_config(model_dir).get("eos_token_id")
    path = os.path.join(model_dir or "", "generation_config.json")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        logger.warning("ignoring eos_token_id %r of %s: not token ids", eos, path)
        return []
    return ids


class InputProcessor:
    """Prompt parsing and validation for one engine.

    model_config: the model's HF config (its eos_token_id). vocab_size and max_model_len: the
    limits prompts are checked against. Raises ValueError when the tokenizer cannot be loaded.

    eos_token_ids: the model config's EOS id(s) and the tokenizer's (vLLM stops on the
    tokenizer's; a checkpoint whose two disagree ends its text with the tokenizer's).
    extra_eos_token_ids: end tokens only generation_config.json names (a chat model's end of
    turn beside the end of text): as in vLLM, they stop a request unless ignore_eos, with the
    token as its stop_reason, and min_tokens masks them too.
    """

    def __init__(self, config: EngineConfig, model_config, vocab_size: int, max_model_len: int):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_queue_len = config.max_queue_len
        self.tokenizer = load_tokenizer(config)
        eos = getattr(model_config, "eos_token_id", None)
        ids = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(int(tok_eos))
        self.eos_token_ids: list[int] = ids
        self.extra_eos_token_ids: list[int] = [t for t in generation_config_eos_ids(generation_config_folder(config))
                                              if t not in ids]
        self.max_logprobs = vocab_size if config.max_logprobs == -1 else config.max_logprobs

    def check_queue_room(self, req: ProcessedRequest, num_waiting: int) -> None:
        """Refuse a request whose n sequences do not fit in max_queue_len waiting sequences (each
        of the n counts): ValueError when they never could (the request's fault, the server's
        400), QueueFullError when the num_waiting already queued leave no room now (503)."""
        limit, n = self.max_queue_len, len(req.seqs)
        if limit is not None and n > limit:
            raise ValueError(f"n={n} sequences exceed max_queue_len={limit} waiting sequences")
        if limit is not None and num_waiting + n > limit:
            raise QueueFullError(f"the request queue is full ({num_waiting} of {limit} waiting sequences; "
                                 f"this adds {n})")

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt. Raises ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): pass prompt_token_ids")
        return self.tokenizer(prompt)["input_ids"]

    def parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text prompt, a list of token ids, or a dict with
        "prompt_token_ids" (vLLM's TokensPrompt; "prompt" kept as its text) or "prompt", and
        optionally "cache_salt" (read by `cache_salt`). Any other key of a dict (vLLM's
        multi_modal_data, a misspelt key) is refused: dropping it would serve a request other
        than the one asked for."""
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(map(repr, set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}))
            if unknown:
                raise ValueError(f"unsupported prompt key(s) {', '.join(unknown)}: a dict prompt takes 'prompt', "
                                 "'prompt_token_ids' and 'cache_salt'")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"a dict prompt's 'prompt' must be a string, got {type(text).__name__}")
            if ids is not None:
                if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                    raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
                return text, list(ids)
            if text is not None:
                return text, self.tokenize(text)
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    @staticmethod
    def cache_salt(prompt) -> str | None:
        """A dict prompt's "cache_salt" (vLLM's: only requests with the same salt share cached
        prefixes), else None. Raises ValueError unless it is a non-empty string."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise ValueError(f"'cache_salt' must be a non-empty string, got {salt!r:.40}")
        return salt

    def process(self, request_id: str, prompt, params: SamplingParams | None, arrival_time: float) -> ProcessedRequest:
        """Validate a request and build its sequences. Raises ValueError for sampling params
        that are not a SamplingParams (or hold nonsense), an empty prompt, token ids outside
        the vocabulary, logit_bias or allowed_token_ids outside it, stop strings without a
        tokenizer, or a prompt that leaves no room within max_model_len."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        # a private copy, validated again: the caller may change or reuse its object while this
        # request runs (vLLM copies it too), and a field set to nonsense after creation is refused
        params = dataclasses.replace(params)
        text, token_ids = self.parse_prompt(prompt)
        salt = self.cache_salt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine runs with skip_tokenizer_init=True): "
                             "use stop_token_ids")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.biased_token_ids()):
            raise ValueError(f"logit_bias and allowed_token_ids must name token ids in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={asked} is more than max_logprobs={self.max_logprobs} (the "
                                 "engine's max_logprobs sets the limit, as in vLLM)")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                # completion i draws from seed + i, wrapped into the signed 64-bit range
                p = dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Sequence(seq_id, prompt_token_ids=token_ids, sampling_params=p, prompt=text,
                                 arrival_time=arrival_time, cache_salt=salt))
        return ProcessedRequest(request_id, text, list(token_ids), params, seqs, arrival_time)
