"""A tiny OpenAI-compatible completions server for testing `mambaserve bench serve` without a model.

It streams `max_tokens` chunks of one word each (server-sent events, with a keep-alive comment
first, a usage chunk when stream_options.include_usage asks for one, with a stand-in
`prompt_tokens_details.cached_tokens`, then "data: [DONE]"),
records every request body, and counts how many requests were in flight at once. It runs on
a free loopback port in a thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class FakeOpenAIServer:
    """Start with `with FakeOpenAIServer() as srv:`; `srv.base_url`, `srv.bodies`, `srv.max_in_flight`."""

    def __init__(self, token_delay: float = 0.002, send_usage: bool = True, vocab_size: int = 100):
        self.token_delay, self.send_usage, self.vocab_size = token_delay, send_usage, vocab_size
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner = None

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    def _cached(self, prompt) -> int:
        """A stand-in for a prefix cache: the longest prefix (in whole tokens, all but the last)
        that this prompt shares with a prompt received before it."""
        if not isinstance(prompt, list):
            return 0
        best = 0
        for b in self.bodies[:-1]:
            other = b["prompt"] if isinstance(b["prompt"], list) else []
            n = 0
            while n < min(len(other), len(prompt) - 1) and other[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, n = body.get("prompt"), body.get("max_tokens")
        ok_prompt = isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                                and all(isinstance(t,
                                                                   int) and 0 <= t < self.vocab_size for t in prompt))
        if not ok_prompt or not isinstance(n, int) or n < 1 or not body.get("stream"):
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": keep-alive\n\n")
            for i in range(n):
                await asyncio.sleep(self.token_delay)
                choice = {"index": 0, "text": f" w{i}", "logprobs": None,
                          "finish_reason": "length" if i == n - 1 else None}
                await resp.write(self._event({"id": "cmpl-0", "object": "text_completion", "model": body["model"],
                                              "choices": [choice], "usage": None}))
            if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                p_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                usage = {"prompt_tokens": p_len, "completion_tokens": n, "total_tokens": p_len + n,
                         "prompt_tokens_details": {"cached_tokens": self._cached(prompt)}}
                await resp.write(self._event({"id": "cmpl-0", "object": "text_completion", "model": body["model"],
                                              "choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    @staticmethod
    def _event(obj: dict) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()
