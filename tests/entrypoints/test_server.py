"""The OpenAI-compatible server, driven over loopback by the official `openai` client and httpx.

A real uvicorn server runs in a background thread of this process, on a free port, over a
tiny random GraniteMoeHybrid checkpoint with a tiny BPE tokenizer (`tests/tokenized.py`).
Greedy outputs are compared with the offline `LLM.generate` over the same checkpoint; the
load test checks that the server stays healthy and that every state slot and KV block is back
in the pool afterwards, as /metrics reports them.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from mambaserve import LLM, SamplingParams  # noqa: E402
from tests.entrypoints.servers import (  # noqa: E402
    AUTH,
    KEY,
    MODEL,
    NUM_KV_BLOCKS,
    PROMPTS,
    metrics,
    running_server,
    stream_text,
    wait_idle,
)
from tests.tokenized import tokenized_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with running_server("--api-key", KEY) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The offline engine over the same checkpoint: greedy texts are the reference."""
    llm = LLM(tokenized_checkpoint(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    cache = {}

    def greedy(prompt, max_tokens: int, **kw):
        key = (json.dumps(prompt), max_tokens, repr(sorted(kw.items())))
        if key not in cache:
            p = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
            out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]
            cache[key] = out.outputs[0]
        return cache[key]

    greedy.llm = llm
    return greedy


# ---------------------------------------------------------------------------- basics
def test_models_health_metrics(base_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200  # no key needed outside /v1
    m = metrics(base_url)
    assert m["mambaserve:state_slots_total"] > 0 and m["mambaserve:kv_blocks_total"] > 0
    assert "vllm:time_to_first_token_seconds_count" in m


def _series_sum(base_url: str, name: str) -> float:
    """A metric's value summed over its label sets (request_success_total has one per finish reason)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base_url}/metrics").text.splitlines()
               if line.split("{")[0] == name)


def test_each_of_n_completions_counts_as_a_request_in_the_metrics(base_url, client):
    """As vLLM counts them: request_success_total adds up with the counts of the latency and
    request-size histograms, and their sums with the response's usage (the prompt once per completion)."""
    rng = random.Random()
    names = ["vllm:request_success_total", "vllm:e2e_request_latency_seconds_count",
             "vllm:time_to_first_token_seconds_count", "vllm:request_prompt_tokens_count",
             "vllm:request_generation_tokens_count", "vllm:request_prompt_tokens_sum",
             "vllm:request_generation_tokens_sum"]
    wait_idle(base_url)
    before = {k: _series_sum(base_url, k) for k in names}
    n = rng.randint(2, 4)
    r = client.completions.create(model=MODEL, prompt=" ".join(rng.sample(PROMPTS, 3)), n=n, temperature=1.0,
                                  seed=rng.randrange(1 << 30), max_tokens=rng.randint(2, 9), stop=[" "])
    wait_idle(base_url)
    d = {k: _series_sum(base_url, k) - before[k] for k in names}
    assert [d[k] for k in names[:5]] == [n] * 5, d
    assert d["vllm:request_generation_tokens_sum"] == r.usage.completion_tokens
    assert d["vllm:request_prompt_tokens_sum"] == n * r.usage.prompt_tokens


def test_completion_equals_offline(client, offline):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    ref = offline(PROMPTS[0], 8)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(offline.llm.get_tokenizer()(PROMPTS[0])["input_ids"])


@pytest.mark.parametrize("stop", [None, "stop"])
def test_streamed_equals_non_streamed(client, offline, stop):
    ref = offline(PROMPTS[1], 16)
    if stop == "stop":  # a stop string taken from the middle of the greedy text
        stop = ref.text[5:7]
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop)
    whole = client.completions.create(**kw).choices[0]
    texts, reasons, chunks = stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts[0] == whole.text and reasons[0] == whole.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    if stop is None:
        assert whole.text == ref.text
    else:
        assert whole.text == ref.text[: ref.text.find(stop)] and whole.finish_reason == "stop"
        assert whole.model_extra["stop_reason"] == stop


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]
    tok = offline.llm.get_tokenizer()
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    ref = offline(ids, 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    events = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    texts, reasons, _ = stream_text(events)
    assert texts[0] == ref.text and reasons[0] == r.choices[0].finish_reason
    assert events[-1].usage.total_tokens == r.usage.total_tokens
    # the offline LLM.chat renders the same prompt and so gives the same greedy reply
    [out] = offline.llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert out.prompt_token_ids == ids and out.outputs[0].text == r.choices[0].message.content


def test_logit_bias_and_allowed_token_ids(client, offline):
    """OpenAI's logit_bias (token ids as strings) and vLLM's allowed_token_ids, as offline."""
    ids = offline.llm.get_tokenizer()("The quick brown fox", add_special_tokens=False)["input_ids"]
    base = offline(ids, 6)
    forced = (base.token_ids[0] + 1) % 100 + 5
    kw = dict(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    r = client.completions.create(**kw, logit_bias={str(forced): 100, str(base.token_ids[1]): -100},
                                  extra_body={"ignore_eos": True})
    ref = offline(ids, 6, logit_bias={forced: 100.0, base.token_ids[1]: -100.0}, ignore_eos=True)
    assert ref.token_ids == [forced] * 6 and r.choices[0].text == ref.text
    allowed = sorted(set(base.token_ids[2:]) | {7, 11})
    r = client.completions.create(**kw, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    ref = offline(ids, 6, allowed_token_ids=allowed, ignore_eos=True)
    assert set(ref.token_ids) <= set(allowed) and r.choices[0].text == ref.text


def test_tokenize_detokenize_version(base_url, client, offline):
    tok = offline.llm.get_tokenizer()
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert r["tokens"] == tok("The quick brown fox")["input_ids"] and r["count"] == len(r["tokens"]) > 0
    assert r["max_model_len"] == offline.llm.llm_engine.max_model_len
    messages = [{"role": "user", "content": "Hello there"}]
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens
    assert httpx.post(f"{base_url}/detokenize",
                      json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    assert httpx.get(f"{base_url}/version").json()["version"]
    for path, body in [("tokenize", {}), ("tokenize", {"prompt": "x", "messages": messages}),
                       ("tokenize", {"messages": [{"content": "no role"}]}), ("detokenize", {"tokens": [10**9]}),
                       ("detokenize", {"tokens": "abc"})]:
        _error(httpx.post(f"{base_url}/{path}", json=body), 400)
    _error(httpx.post(f"{base_url}/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_offline_chat_batches_conversations_and_refuses_bad_ones(offline):
    llm, params = offline.llm, SamplingParams(temperature=0.0, max_tokens=4)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": [{"type": "text", "text": "Tell"}, {"type": "text", "text": "me"}]}],
             [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Once upon"}]]
    outs = llm.chat(convs[:2], params, use_tqdm=False)
    cont = llm.chat(convs[2], params, use_tqdm=False, continue_final_message=True)[0]
    for conv, out in zip(convs, outs + [cont]):
        flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Tell\nme"} for m in conv]
        if conv is convs[2]:  # the last message left open: no end-of-turn after it, no assistant header
            text = tok.apply_chat_template(flat, tokenize=False, continue_final_message=True)
            assert text.endswith("Once upon")
        else:
            text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == offline(ids, 4).token_ids
    engine = llm.llm_engine
    for bad, match in [([{"content": "no role"}], "role"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                        "text content"),
                       ([], "conversation")]:
        with pytest.raises(ValueError, match=match):
            llm.chat([convs[0], bad] if bad else bad, params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(convs[0], params, chat_template_kwargs={"chat_template": "{{ 1 }}"})


def test_n_and_seeds(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=3)
    a = client.completions.create(**kw, seed=7)
    b = client.completions.create(**kw, seed=7)
    c = client.completions.create(**kw, seed=8)
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa: E731
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert len(set(texts(a))) > 1  # the n completions are sampled independently
    streamed, _, _ = stream_text(client.completions.create(**kw, seed=7, stream=True))
    assert [streamed[i] for i in range(3)] == texts(a)
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                           n=2, seed=3) for _ in range(2)]
    assert [ch.message.content for ch in chat[0].choices] == [ch.message.content for ch in chat[1].choices]
    # several prompts x n: choice index = prompt index * n + completion index
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]


def test_logprobs(client, offline):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=2)
    ref = offline(PROMPTS[3], 6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for got, top, want, tok in zip(lp.token_logprobs, lp.top_logprobs, ref.logprobs, ref.token_ids):
        assert got == pytest.approx(want[tok].logprob, abs=1e-5)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(got, abs=1e-6)  # greedy: rank 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-6) and bytes(entry.bytes).decode() == entry.token
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                                   stream=True))
    tokens = [e.token for ev in streamed for ch in ev.choices if ch.logprobs for e in ch.logprobs.content]
    assert tokens == [e.token for e in content]


def test_token_id_prompts_and_echo(client, offline):
    tok = offline.llm.get_tokenizer()
    ids = [tok(p)["input_ids"] for p in PROMPTS[4:6]]
    r = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    assert r.choices[0].text == offline(ids[0], 5).text
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda c: c.index)] == [offline(i, 5).text for i in ids]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=5, temperature=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == PROMPTS[4] + offline(PROMPTS[4], 5).text
    assert len(ch.logprobs.tokens) == len(ids[0]) + 5 and ch.logprobs.token_logprobs[0] is None
    assert "".join(ch.logprobs.tokens) == ch.text
    assert all(isinstance(x, float) for x in ch.logprobs.token_logprobs[1:])
    texts, _, _ = stream_text(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=5, temperature=0,
                                                        echo=True, stream=True))
    assert texts[0] == ch.text
    # max_tokens=0 with echo: the prompt and its logprobs only (what evaluation harnesses ask)
    r = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == tok.decode(ids[1]) and len(r.choices[0].logprobs.tokens) == len(ids[1])
    assert r.usage.completion_tokens == 0


# ---------------------------------------------------------------------------- errors
def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors(base_url, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 2048, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])

    url = f"{base_url}/v1/completions"
    _error(httpx.post(url, json={"prompt": "x"}), 401)
    _error(httpx.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    _error(httpx.post(url, content=b'{"prompt": "x", ', headers={**AUTH, "Content-Type": "application/json"}), 400)
    bad_bodies = [
        {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "top_p": 0}, {"prompt": "x", "n": 0},
        {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "logprobs": 21}, {"prompt": []}, {"prompt": ""},
        {"prompt": [[1, 2], []]}, {"prompt": [10**9]}, {"prompt": [-1]}, {"prompt": [True]}, {},
        {"prompt": "x", "stop": [""]}, {"prompt": "x", "presence_penalty": 3}, {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "max_tokens": 4096}, {"prompt": "x", "seed": 2**64}, [1, 2],
        {"prompt": "x", "logit_bias": {"abc": 1}}, {"prompt": "x", "logit_bias": {"5": 101}},
        {"prompt": "x", "logit_bias": {str(10**9): 1}}, {"prompt": "x", "allowed_token_ids": []},
        {"prompt": "x", "allowed_token_ids": [10**9]},
    ]
    for body in bad_bodies:
        _error(httpx.post(url, json=body, headers=AUTH), 400)
    chat_url = f"{base_url}/v1/chat/completions"
    for body in [{"messages": []}, {"messages": "hi"}, {"messages": [{"content": "no role"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}]:
        _error(httpx.post(chat_url, json=body, headers=AUTH), 400)
    _error(httpx.post(url, json={"model": "nope", "prompt": "x"}, headers=AUTH), 404)
    _error(httpx.get(f"{base_url}/v1/nothing", headers=AUTH), 404)
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    _error(httpx.post(url, content=big, headers={**AUTH, "Content-Type": "application/json"}), 413)
    _error(httpx.post(url, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                      headers={**AUTH, "Content-Type": "application/json"}), 413)  # chunked: no Content-Length
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_queue_full_gives_503():
    with running_server("--max-num-seqs", "1", "--max-queue-len", "1", "--enforce-eager") as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        running = c.completions.create(model=MODEL, prompt="hello", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(running))  # admitted and decoding: the one running slot is taken
        waiting = threading.Thread(target=lambda: c.completions.create(model=MODEL, prompt="hi", max_tokens=2))
        waiting.start()
        deadline = time.monotonic() + 10
        while metrics(url)["vllm:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert e.value.status_code == 503
        running.close()  # disconnect: aborts the running request, so the waiting one runs
        waiting.join(30)
        assert not waiting.is_alive()
        m = wait_idle(url)
        assert m["mambaserve:state_slots_used"] == 0 and m["mambaserve:kv_blocks_used"] == 0


def test_shutdown_aborts_streams_and_stops_the_loop():
    with running_server("--enforce-eager") as (url, server):
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            engine = server.engine
            server.should_exit = True
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    assert not engine.is_running and engine.engine.usage().num_slots_used == 0
    assert not engine.engine.has_unfinished_requests()


def test_non_streaming_disconnect_aborts(base_url):
    before = metrics(base_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=httpx.Timeout(10, read=0.3),
                   json={"prompt": "hello", "max_tokens": 1500, "ignore_eos": True})
    m = wait_idle(base_url)
    assert m["mambaserve:state_slots_used"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["mambaserve:request_aborted_total"] == before["mambaserve:request_aborted_total"] + 1
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1500


def test_engine_failure_fails_requests_not_the_loop(served, client, monkeypatch):
    url, server = served
    engine = server.engine.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:  # mid-decode
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
    m = wait_idle(url)
    assert m["mambaserve:state_slots_used"] == 0 and m["mambaserve:kv_blocks_used"] == 0
    assert httpx.get(f"{url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).choices[0].text


# ---------------------------------------------------------------------------- load
@pytest.mark.timeout(120)
def test_load(base_url, offline):
    """64 concurrent clients, 200 requests: greedy streams (checked against offline outputs),
    whole responses, clients that leave mid-stream, invalid bodies. Then: all slots free."""
    rng = random.Random(0)
    lengths = (3, 6, 9)
    refs = {(p, n): offline(p, n).text for p in PROMPTS for n in lengths}
    kinds = ["stream"] * 110 + ["whole"] * 30 + ["leave"] * 30 + ["invalid"] * 30
    rng.shuffle(kinds)
    invalid = [b'{"prompt": ', b'{"prompt": "x", "temperature": -2}', b'{"prompt": [999999]}', b'[]',
               b'{"prompt": "x", "model": "other"}', b'{"messages": 3}']
    results = {"stream": 0, "whole": 0, "leave": 0, "invalid": 0, "health": 0}

    async def one(client: httpx.AsyncClient, i: int, kind: str, sem: asyncio.Semaphore):
        prompt, n = rng.choice(PROMPTS), rng.choice(lengths)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        async with sem:
            if kind == "invalid":
                r = await client.post("/v1/completions", content=invalid[i % len(invalid)],
                                      headers={"Content-Type": "application/json"})
                assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
            elif kind == "whole":
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == refs[prompt, n]
            else:
                if kind == "leave":
                    body.update(max_tokens=200, ignore_eos=True)
                text, chunks, leave_after = "", 0, rng.randint(1, 3)
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        text += json.loads(line[6:])["choices"][0]["text"]
                        chunks += 1
                        if kind == "leave" and chunks == leave_after:
                            break  # leaves mid-stream: the server must abort it
                if kind == "stream":
                    assert text == refs[prompt, n]
            results[kind] += 1
            if i % 20 == 0:
                assert (await client.get("/health")).status_code == 200
                results["health"] += 1

    async def main():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, limits=limits, timeout=60) as client:
            sem = asyncio.Semaphore(64)
            await asyncio.gather(*(one(client, i, k, sem) for i, k in enumerate(kinds)))

    aborted = metrics(base_url)["mambaserve:request_aborted_total"]
    start = time.monotonic()
    asyncio.run(main())
    assert results == {"stream": 110, "whole": 30, "leave": 30, "invalid": 30, "health": 10}
    m = wait_idle(base_url)
    assert m["mambaserve:state_slots_used"] == 0 and m["mambaserve:kv_blocks_used"] == 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["mambaserve:request_aborted_total"] - aborted == 30  # every client that left was aborted
    assert httpx.get(f"{base_url}/health").status_code == 200
    print(f"load test: {len(kinds)} requests in {time.monotonic() - start:.1f} s")
