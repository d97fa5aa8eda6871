"""Request lists for the benchmarks: (prompt, prompt length, output length) triples.

Sources, chosen by `--dataset`:
- "random": random token ids, lengths uniform within +-ratio of --input-len / --output-len;
- "sharegpt-synthetic": random token ids with lengths drawn from a ShareGPT-shaped
  distribution (`sharegpt_synthetic_lengths` documents its source and assumptions);
- "prefix_repetition" (vLLM's name): random prompts that share one of a few random prefixes
  (a system prompt or few-shot context repeated across requests; `prefix_repetition_requests`);
- "multi_turn": conversations of random tokens sent turn by turn, each turn re-sending the
  whole history (`Conversation`; only `bench serve` and benchmarks/prefix_caching.py drive it);
- a path to a ShareGPT-format JSON file: the first human turn is the prompt, the tokenized
  length of the gpt reply that follows it is the output length (needs a tokenizer).
Everything is seeded; nothing here knows about engines or servers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

SYNTHETIC = "sharegpt-synthetic"
RANDOM = "random"
SHAREGPT = "sharegpt"  # a ShareGPT file (--dataset-path)
PREFIX_REPETITION = "prefix_repetition"
MULTI_TURN = "multi_turn"

# ShareGPT filtering as vLLM's benchmarks do it: drop very short pairs and long ones.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# Log-normal fits (natural log of the token count) behind "sharegpt-synthetic"; see
# sharegpt_synthetic_lengths for where they come from.
_PROMPT_MU, _PROMPT_SIGMA = 5.05, 1.2
_OUTPUT_MU, _OUTPUT_SIGMA = 4.92, 0.9


@dataclass
class BenchRequest:
    """One benchmark request. prompt: token ids, or text for a ShareGPT file; prompt_len: its
    length in tokens; output_len: tokens to generate (max_tokens, with EOS ignored)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def random_token_ids(rng, length: int, vocab_size: int) -> list[int]:
    """`length` token ids drawn uniformly from [0, vocab_size)."""
    return rng.integers(0, vocab_size, size=length).tolist()


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """`num` requests of random token ids; each length is uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)] (vLLM's current convention), at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = _rng(seed)
    ins = rng.integers(max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio)) + 1, size=num)
    outs = rng.integers(max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)) + 1, size=num)
    return [BenchRequest(random_token_ids(rng, int(i), vocab_size), int(i), int(o)) for i, o in zip(ins, outs)]


def sharegpt_synthetic_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    """`num` (prompt_len, output_len) pairs shaped like the ShareGPT conversations that vLLM's
    benchmarks sample (ShareGPT_V3_unfiltered_cleaned_split: first human turn as the prompt,
    the gpt reply's token count as the output length, pairs with a side under 4 tokens, a
    prompt over 1,024 tokens or a total over 2,048 dropped).

    Source of the shape, and what is assumed: the targets are the means that vLLM's serving
    benchmark commonly reports for 1,000 such prompts with a Llama tokenizer, about 215k input
    and 200k output tokens, i.e. mean prompt ~ 220 and mean output ~ 200 tokens after the
    filter. The skew is an assumption, not a fit to the file (which could not be read here):
    both lengths are drawn log-normal and independent, prompt sigma 1.2 (heavy tail of pasted
    text and code), output sigma 0.9, with mu tuned so that the filtered means are 220 / 200.
    The result has medians of about 144 / 136 tokens, 99th percentiles of about 940 / 1,040,
    and the same caps (prompt <= 1,024, total <= 2,048, each >= 4) applied by rejection.
    """
    rng = _rng(seed)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num:
        k = 2 * (num - len(pairs)) + 16
        ins = rng.lognormal(_PROMPT_MU, _PROMPT_SIGMA, size=k).round()
        outs = rng.lognormal(_OUTPUT_MU, _OUTPUT_SIGMA, size=k).round()
        for i, o in zip(ins.astype(int).tolist(), outs.astype(int).tolist()):
            if i >= MIN_LEN and o >= MIN_LEN and i <= MAX_PROMPT_LEN and i + o <= MAX_TOTAL_LEN:
                pairs.append((i, o))
    return pairs[:num]


def synthetic_requests(num: int, vocab_size: int, seed: int = 0, output_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT-shaped requests of random token ids (output_len, if given, overrides the drawn one)."""
    rng = _rng(seed + 1)
    return [BenchRequest(random_token_ids(rng, i, vocab_size), i, output_len or o)
            for i, o in sharegpt_synthetic_lengths(num, seed)]


def sharegpt_requests(path: str, num: int, tokenizer, seed: int = 0,
                      output_len: int | None = None) -> list[BenchRequest]:
    """`num` requests from a ShareGPT-format JSON file (a list of {"conversations": [{"from":
    "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}), shuffled with `seed`. The
    prompt is the first human turn (kept as text), the output length the token count of the gpt
    reply after it (or `output_len`). Raises ValueError if the file has too few usable pairs."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read the ShareGPT dataset {path!r}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [p for p in (_first_exchange(entry) for entry in data) if p is not None]
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        p_len = len(tokenizer(prompt)["input_ids"])
        o_len = output_len or len(tokenizer(reply)["input_ids"])
        too_long = p_len > MAX_PROMPT_LEN or (output_len is None and p_len + o_len > MAX_TOTAL_LEN)
        if p_len < MIN_LEN or o_len < MIN_LEN or too_long:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
        if len(out) == num:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, {num} requested")


def _first_exchange(entry) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") == "human":
            for reply in turns[i + 1:]:
                if isinstance(reply, dict) and reply.get("from") == "gpt":
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                               vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """`num` requests of `prefix_len` + `suffix_len` random token ids: `num_prefixes` distinct
    random prefixes, each used by num // num_prefixes requests (the first num % num_prefixes
    prefixes by one more), each request with its own random suffix, in a seeded random order
    (so that requests sharing a prefix are not all adjacent, as in vLLM's dataset). The
    workload of a shared system prompt or few-shot context. Raises ValueError for lengths < 1
    (a suffix of 0 is allowed: whole prompts repeat) or more prefixes than requests."""
    if prefix_len < 1 or suffix_len < 0 or output_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-output-len must be >= 1, "
                         "--prefix-repetition-suffix-len >= 0")
    if not 1 <= num_prefixes <= num:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts={num}], got {num_prefixes}")
    rng = _rng(seed)
    prefixes = [random_token_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    reqs = [BenchRequest(prefixes[i % num_prefixes] + random_token_ids(rng, suffix_len, vocab_size),
                         prefix_len + suffix_len, output_len) for i in range(num)]
    order = rng.permutation(num).tolist()
    return [reqs[i] for i in order]


@dataclass
class Conversation:
    """A synthetic chat sent turn by turn. history: token ids of what precedes the first
    turn's user message (a system prompt and earlier turns: --multi-turn-prefix-len tokens);
    user_turns: each turn's new user message; output_len: tokens each answer generates.

    Turn 0's prompt is history + user_turns[0]; turn k's is turn k-1's prompt + turn k-1's
    answer + user_turns[k] (`next_turn_prompt`), as a chat client re-sends the whole history."""

    history: list[int]
    user_turns: list[list[int]]
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    def first_prompt(self) -> list[int]:
        return self.history + self.user_turns[0]


def next_turn_prompt(prev_prompt: list[int], answer: list[int], user: list[int]) -> list[int]:
    """Turn k's prompt: turn k-1's prompt, the answer it got, the new user message."""
    return list(prev_prompt) + list(answer) + list(user)


def stand_in_answer(conversation: int, turn: int, length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`length` seeded random token ids standing for an answer whose ids the client cannot read
    back (a server without a tokenizer returns no text). The next turn then re-sends a history
    whose answer part the server has not seen: only the previous prompt can be found in its
    cache, which is the lower bound of what a real chat client would get."""
    return random_token_ids(_rng((seed, conversation, turn, 1)), length, vocab_size)


def multi_turn_conversations(num: int, num_turns: int, prefix_len: int, user_len: int, output_len: int,
                             vocab_size: int, seed: int = 0) -> list[Conversation]:
    """`num` conversations of `num_turns` turns: `prefix_len` random tokens of history (0 for
    none), `user_len` random tokens per user message, answers of `output_len` tokens. Turn k's
    prompt holds prefix_len + (k + 1) * user_len + k * output_len tokens. Raises ValueError for
    lengths < 1 (prefix_len >= 0)."""
    if num < 1 or num_turns < 1 or user_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("--num-prompts, --multi-turn-num-turns, --multi-turn-user-len and --multi-turn-output-len "
                         "must be >= 1, --multi-turn-prefix-len >= 0")
    rng = _rng(seed)
    return [Conversation(random_token_ids(rng, prefix_len, vocab_size),
                         [random_token_ids(rng, user_len, vocab_size) for _ in range(num_turns)], output_len)
            for _ in range(num)]


def build_requests(dataset: str, num_prompts: int, *, vocab_size: int, tokenizer=None, input_len: int = 1024,
                   output_len: int | None = None, range_ratio: float = 0.0, seed: int = 0,
                   prefix_len: int = 256, suffix_len: int = 256, num_prefixes: int = 10,
                   prefix_output_len: int = 128) -> list[BenchRequest]:
    """The request list named by --dataset ("random", "sharegpt-synthetic", "prefix_repetition"
    or a ShareGPT file; "multi_turn" is `multi_turn_conversations`, sent turn by turn)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == RANDOM:
        return random_requests(num_prompts, input_len, output_len or 128, range_ratio, vocab_size, seed)
    if dataset == SYNTHETIC:
        return synthetic_requests(num_prompts, vocab_size, seed, output_len)
    if dataset == PREFIX_REPETITION:
        return prefix_repetition_requests(num_prompts, prefix_len, suffix_len, num_prefixes, prefix_output_len,
                                          vocab_size, seed)
    if dataset == MULTI_TURN:
        raise ValueError("--dataset multi_turn sends conversations turn by turn: only `bench serve` runs it")
    if tokenizer is None:
        raise ValueError("a ShareGPT dataset file needs a tokenizer: pass --tokenizer (a directory with tokenizer "
                         "files)")
    return sharegpt_requests(dataset, num_prompts, tokenizer, seed, output_len)
