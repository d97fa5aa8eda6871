"""`bench serve --dataset multi_turn`: conversations sent turn by turn over HTTP.

Each conversation is one client: it sends turn 0's prompt, reads the streamed answer, then
sends turn 1's prompt (turn 0's prompt + the answer + a new user message) and so on, the way a
chat client re-sends its whole history every turn; the last turns carry the longest prompts.
Conversations start at --request-rate (Poisson, or gamma with --burstiness) and at most
--max-concurrency of them are in flight at once (a conversation holds its place across its
turns, as a user in a chat does). A failed turn ends its conversation.

The answer put into the history is the server's own: its text tokenized again when a
tokenizer is at hand (a real client re-sends text too, so a re-tokenization that differs from
the generated ids is what a server meets in practice); without one (dummy weights, a server
with no tokenizer returns no text) a seeded stand-in of the answer's length
(`datasets.stand_in_answer`). Knows nothing about our engine: it only speaks HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from mambaserve.benchmarks.datasets import (
    BenchRequest,
    Conversation,
    multi_turn_conversations,
    next_turn_prompt,
    random_token_ids,
    stand_in_answer,
)
from mambaserve.benchmarks.serve_requests import request_payload, stream_completion
from mambaserve.benchmarks.serve_results import RequestResult


def conversations_from_args(args: argparse.Namespace, vocab_size: int) -> list[Conversation]:
    """--num-prompts conversations shaped by the --multi-turn-* flags."""
    return multi_turn_conversations(args.num_prompts, args.multi_turn_num_turns, args.multi_turn_prefix_len,
                                    args.multi_turn_user_len, args.multi_turn_output_len, vocab_size, args.seed)


def answer_ids(res: RequestResult, tokenizer, conversation: int, turn: int, output_len: int, vocab_size: int,
               seed: int) -> list[int]:
    """The token ids of a turn's answer as the client re-sends them: its text tokenized (with a
    tokenizer), else a stand-in of the reported (or asked) length."""
    if tokenizer is not None:
        return tokenizer(res.text, add_special_tokens=False)["input_ids"]
    n = res.usage_completion_tokens if res.usage_completion_tokens is not None else output_len
    return stand_in_answer(conversation, turn, n, vocab_size, seed)


async def run_conversations(conversations: list[Conversation], url: str, model: str, args: argparse.Namespace,
                            tokenizer, vocab_size: int) -> tuple[list[RequestResult], float]:
    """Send every conversation turn by turn (module doc); returns one result per turn sent
    (conversation-major order, `turn` set) and the duration in seconds. A short probe request
    of its own random tokens goes first (not counted; it shares no prefix with any turn);
    ValueError if it fails."""
    import aiohttp
    import numpy as np

    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    per_conversation: list[list[RequestResult]] = [[] for _ in conversations]
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        probe_ids = random_token_ids(np.random.default_rng((args.seed, 2**31)), 16, vocab_size)
        probe = await stream_completion(session, url, request_payload(model, BenchRequest(probe_ids, 16, 4), args), 16)
        if not probe.success:
            raise ValueError(f"the test request to {url} failed: {probe.error}")

        async def talk(ci: int, conv: Conversation) -> None:
            prompt = conv.first_prompt()
            for turn in range(conv.num_turns):
                if turn:
                    answer = answer_ids(per_conversation[ci][-1], tokenizer, ci, turn - 1, conv.output_len,
                                        vocab_size, args.seed)
                    prompt = next_turn_prompt(prompt, answer, conv.user_turns[turn])
                req = BenchRequest(prompt, len(prompt), conv.output_len)
                res = await stream_completion(session, url, request_payload(model, req, args), req.prompt_len)
                res.turn = turn
                per_conversation[ci].append(res)
                if not res.success:
                    return

        async def one(ci: int, conv: Conversation) -> None:
            if sem is None:
                return await talk(ci, conv)
            async with sem:
                return await talk(ci, conv)

        start = time.perf_counter()
        tasks = []
        for i, conv in enumerate(conversations):
            if i and args.request_rate != float("inf"):
                k = args.burstiness  # gamma(k, 1/(rate k)) gaps: mean 1/rate; k = 1 is a Poisson process
                await asyncio.sleep(float(rng.gamma(k, 1.0 / (args.request_rate * k))))
            tasks.append(asyncio.create_task(one(i, conv)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return [r for results in per_conversation for r in results], duration
