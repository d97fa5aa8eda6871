"""Prefix caching as a server's client sees it: usage.prompt_tokens_details.cached_tokens, the
vllm:prefix_cache_* counters in /metrics and POST /reset_prefix_cache.

The reference is the offline engine over the same checkpoint and pool sizes, fed the same
requests in the same order: its RequestOutput.num_cached_tokens and usage() counters must be
what the server reports. The checks that need real hits run once the prefix-cache core is in.
"""

from __future__ import annotations

import random
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from mambaserve import LLM, SamplingParams  # noqa: E402
from mambaserve.cache import prefix_cache  # noqa: E402
from tests.entrypoints.servers import AUTH, KEY, MODEL, NUM_KV_BLOCKS, metrics, running_server, wait_idle  # noqa: E402
from tests.tokenized import tokenized_checkpoint  # noqa: E402

CORE = hasattr(prefix_cache, "PrefixCache")  # the caching itself, beside the contract's counters
MAMBA_BLOCK = 16


@pytest.fixture(scope="module")
def served():
    with running_server("--api-key", KEY, "--mamba-block-size", str(MAMBA_BLOCK)) as (url, server):
        yield url, server


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _prompt(rng, n):
    return [rng.randrange(1, 200) for _ in range(n)]


def test_cached_tokens_and_counters_equal_the_offline_engine(served):
    url, server = served
    rng = random.Random()
    p, q = _prompt(rng, 3 * MAMBA_BLOCK + 5), _prompt(rng, 2 * MAMBA_BLOCK + 3)
    messages = [{"role": "system", "content": "You are terse. " * 8}, {"role": "user", "content": "Hi there"}]
    offline = LLM(tokenized_checkpoint(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, mamba_block_size=MAMBA_BLOCK)
    greedy = {"temperature": 0.0, "max_tokens": 3}

    def ref(prompt, n=1):
        params = SamplingParams(n=n, **greedy)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return offline.chat(prompt, params, use_tqdm=False)[0].num_cached_tokens
        return offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].num_cached_tokens

    wait_idle(url)
    assert server.engine.engine.reset_prefix_cache()  # a cold cache, as the offline engine's
    before = server.engine.engine.usage()  # the loop thread is idle (no request): a consistent read
    got, want = [], []
    with _client(url) as c:
        for _ in range(2):  # the repeat finds the prompt cached
            got.append(c.completions.create(model=MODEL, prompt=p, **greedy).usage.prompt_tokens_details.cached_tokens)
            want.append(ref(p))
        events = list(c.completions.create(model=MODEL, prompt=p, stream=True, stream_options={"include_usage": True},
                                           **greedy))
        got.append(events[-1].usage.prompt_tokens_details.cached_tokens)  # the final usage chunk
        want.append(ref(p))
        for stream in (False, True):
            kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            r = c.chat.completions.create(model=MODEL, messages=messages, **kw, **greedy)
            usage = list(r)[-1].usage if stream else r.usage
            got.append(usage.prompt_tokens_details.cached_tokens)
            want.append(ref(messages))
        for _ in range(2):  # n=2: the prompt counts once, as in prompt_tokens
            r = c.completions.create(model=MODEL, prompt=q, n=2, **greedy)
            assert r.usage.prompt_tokens == len(q)
            got.append(r.usage.prompt_tokens_details.cached_tokens)
            want.append(ref(q, n=2))
    assert got == want
    assert min(got) >= 0 and max(got[:3] + got[5:]) <= len(p), got
    if CORE:  # every repeat reuses all of its prompt's whole checkpoint blocks but the last token's
        assert got[1] == got[2] == (len(p) - 1) // MAMBA_BLOCK * MAMBA_BLOCK and got[4] > 0 and got[6] > 0
    m = wait_idle(url)
    usage, ref_usage = server.engine.engine.usage(), offline.llm_engine.usage()
    assert m["vllm:prefix_cache_queries_total"] == usage.prefix_cache_queries
    assert m["vllm:prefix_cache_hits_total"] == usage.prefix_cache_hits
    assert not any(k.startswith("vllm:prefix_cache") and k.endswith("_created") for k in m)
    # the same requests in the same order: the same lookups and hits (counted per sequence: n=2 twice)
    assert usage.prefix_cache_queries - before.prefix_cache_queries == ref_usage.prefix_cache_queries
    assert usage.prefix_cache_hits - before.prefix_cache_hits == ref_usage.prefix_cache_hits
    if CORE:
        assert ref_usage.prefix_cache_hits >= sum(want) > 0
        assert ref_usage.prefix_cache_queries >= len(p) * 3 + 2 * len(q) * 2


@pytest.mark.skipif(not CORE, reason="needs the prefix-cache core")
def test_cache_salt_shares_a_prefix_only_with_the_same_salt(served):
    """vLLM's cache_salt on both endpoints: a salted request hits only its own salt's prefix."""
    url, _ = served
    rng = random.Random()
    p = _prompt(rng, 3 * MAMBA_BLOCK + 5)
    messages = [{"role": "user", "content": f"Tell me {rng.random()} " * 6}]
    greedy = {"temperature": 0.0, "max_tokens": 2}
    full = (len(p) - 1) // MAMBA_BLOCK * MAMBA_BLOCK
    with _client(url) as c:
        def cached(salt, chat=False):
            extra = {"extra_body": {"cache_salt": salt}} if salt is not None else {}
            r = (c.chat.completions.create(model=MODEL, messages=messages, **greedy, **extra) if chat else
                 c.completions.create(model=MODEL, prompt=p, **greedy, **extra))
            return r.usage.prompt_tokens_details.cached_tokens

        assert [cached(s) for s in ("a", "a", "b", None, "b", None)] == [0, full, 0, 0, full, full]
        chat = [cached(s, chat=True) for s in ("a", "b", "a")]
        assert chat[:2] == [0, 0] and chat[2] > 0


def test_prompt_token_counters_count_as_vllm_does(served):
    """vLLM's vllm:prompt_tokens counts every sequence's whole prompt, cached tokens included (n x
    the prompt for n > 1), vllm:prompt_tokens_cached the cached part, and prompt_tokens_by_source
    splits the first into local_compute + local_cache_hit; each request's usage says its share."""
    url, server = served
    rng = random.Random()
    prompts = [_prompt(rng, 3 * MAMBA_BLOCK + 5), _prompt(rng, 2 * MAMBA_BLOCK + 1)]
    offline = LLM(tokenized_checkpoint(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, mamba_block_size=MAMBA_BLOCK)
    wait_idle(url)
    assert server.engine.engine.reset_prefix_cache()  # a cold cache, as the offline engine's
    before = metrics(url, labels=True)
    want_total = 0
    with _client(url) as c:
        for p, n in ((prompts[0], 1), (prompts[0], 2), (prompts[1], 3), (prompts[0], 1)):
            c.completions.create(model=MODEL, prompt=p, n=n, temperature=0.0, max_tokens=2)
            offline.generate({"prompt_token_ids": p}, SamplingParams(n=n, temperature=0.0, max_tokens=2),
                             use_tqdm=False)
            want_total += n * len(p)
    wait_idle(url)
    got = {k: v - before.get(k, 0.0) for k, v in metrics(url, labels=True).items()}
    ref = offline.llm_engine.usage()
    assert got["vllm:prompt_tokens_total"] == want_total == ref.prompt_tokens_seen
    source = 'vllm:prompt_tokens_by_source_total{{source="{}"}}'.format
    computed, hit = got[source("local_compute")], got[source("local_cache_hit")]
    assert computed + hit == want_total and hit == got["vllm:prompt_tokens_cached_total"] == ref.prompt_tokens_cached
    assert hit >= 2 * ((len(prompts[0]) - 1) // MAMBA_BLOCK * MAMBA_BLOCK)  # the repeats of prompts[0] at least


def test_reset_prefix_cache_endpoint(served):
    url, server = served
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401  # behind the API key
    wait_idle(url)
    r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json() == {}
    p = _prompt(random.Random(), 2 * MAMBA_BLOCK + 1)
    with _client(url) as c:
        c.completions.create(model=MODEL, prompt=p, max_tokens=1)
        wait_idle(url)
        assert httpx.post(f"{url}/reset_prefix_cache", headers=AUTH).status_code == 200
        # forgotten: the same prompt is computed again
        assert c.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0

        started, release = threading.Event(), threading.Event()

        def long_stream():
            with _client(url) as c2:
                stream = c2.completions.create(model=MODEL, prompt=p, max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
                for _ in stream:
                    started.set()
                    if release.is_set():
                        break
                stream.close()

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        assert started.wait(60)
        r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH)  # a request runs: refused, nothing dropped
        release.set()
        t.join(60)
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "requests_running" and "running" in err["message"]


def test_caching_off_reports_no_details():
    with running_server("--no-enable-prefix-caching") as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as c:
            p = _prompt(random.Random(), 40)
            for _ in range(2):
                assert c.completions.create(model=MODEL, prompt=p, max_tokens=2).usage.prompt_tokens_details is None
        m = wait_idle(url)
        assert m["vllm:prefix_cache_queries_total"] == m["vllm:prefix_cache_hits_total"] == 0
