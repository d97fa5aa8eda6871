"""One `bench serve` request over HTTP: its JSON body for the chosen backend and the timing of
its server-sent events. Shared by the load generator (`serve.py`) and the multi-turn client
(`multi_turn.py`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from mambaserve.benchmarks.datasets import BenchRequest
from mambaserve.benchmarks.serve_results import RequestResult

# --backend -> (default endpoint, payload kind)
BACKENDS = {"vllm": ("/v1/completions", "completions"), "openai": ("/v1/completions", "completions"),
            "openai-chat": ("/v1/chat/completions", "chat")}


async def stream_completion(session, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """POST one streaming completion request and time its server-sent events."""
    import aiohttp

    res = RequestResult(prompt_len=prompt_len)
    t0 = last = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:  # one line at a time
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # event separators, ": keep-alive" comments, other SSE fields
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = f"server error: {str(chunk['error'])[:300]}"
                    return res
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.usage_completion_tokens = int(usage["completion_tokens"])
                details = (usage or {}).get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    res.usage_cached_tokens = int(details["cached_tokens"])
                choices = chunk.get("choices")
                if choices:
                    now = time.perf_counter()
                    if res.num_chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.num_chunks += 1
                    delta = choices[0].get("delta")  # a chat chunk; a completions chunk has text
                    res.text += (delta.get("content") if isinstance(delta, dict) else choices[0].get("text")) or ""
        res.latency = time.perf_counter() - t0
        res.success = res.num_chunks > 0
        if not res.success:
            res.error = "the stream carried no completion chunk"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # JSONDecodeError is a ValueError
        res.error = f"{type(e).__name__}: {e}"
    return res


def request_payload(model: str, req: BenchRequest, args: argparse.Namespace) -> dict:
    """The streaming request body for --backend (completions: prompt and max_tokens; chat: one
    user message and max_completion_tokens), usage asked for in the stream's last chunk."""
    body = {"model": model, "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if BACKENDS[args.backend][1] == "chat":
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body
