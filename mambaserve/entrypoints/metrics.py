"""Prometheus metrics of a served engine, in a registry of their own (so that two servers in
one process, as in the tests, do not collide).

The engine loop thread is the only writer: it calls `observe_output` for every output it
delivers and `update_engine` after every iteration, which copies the engine's queue and cache
counts into gauges. The HTTP side only renders them (`render`). Prometheus' client is
thread-safe, so nothing here takes a lock of its own.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from mambaserve.engine.stats import EngineUsage

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_THROUGHPUT_WINDOW_S = 10.0

CONTENT_TYPE = CONTENT_TYPE_LATEST


# Metric names and labels are vLLM's, so that its Grafana dashboard and alerts work unchanged;
# the state slots and KV blocks as counts are ours (mambaserve:...).
VLLM_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_by_source_total",
                "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:request_success_total",
                "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens", "vllm:avg_generation_throughput_toks_per_s")
# exposed once speculative decoding drafts (`SpecDecodeCollector`)
SPEC_DECODE_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                       "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))  # 1 ... 500,000 tokens

# Counters get no `_created` series (vLLM's dashboards do not read them; every scrape would carry one per series).
disable_created_metrics()


class ServerMetrics:
    """The server's metrics. `model_name` labels every series, as vLLM's do.

    vllm:kv_cache_usage_perc is the fraction (0-1) of the cache in use: of this engine's two
    pools, the fuller one (state slots or KV blocks), since either one running out stops
    admission."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.cache_usage = gauge("vllm:kv_cache_usage_perc",
                                 "Fraction of the cache in use (the fuller of the state-slot and KV-block pools).")
        self.slots_used = gauge("mambaserve:state_slots_used", "Conv/SSM state slots held by sequences.")
        self.slots_total = gauge("mambaserve:state_slots_total", "Conv/SSM state slots in the pool.")
        self.blocks_used = gauge("mambaserve:kv_blocks_used", "Paged KV-cache blocks held by sequences.")
        self.blocks_total = gauge("mambaserve:kv_blocks_total", "Paged KV-cache blocks in the pool.")
        self.throughput = gauge("vllm:avg_generation_throughput_toks_per_s",
                                f"Generated tokens per second over the last {_THROUGHPUT_WINDOW_S:.0f} s.")
        # vLLM's accounting: every sequence's whole prompt once (cached tokens included), split by source
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of each sequence, cached ones included.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV and states came from.",
                            labels + ["source"], registry=r)
        self.prompt_tokens_computed = by_source.labels(model_name, "local_compute")
        self.prompt_tokens_hit = by_source.labels(model_name, "local_cache_hit")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted by recompute.")
        self.aborted = counter("mambaserve:request_aborted", "Requests aborted (client gone, shutdown, error).")
        self._finished = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              _TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time between successive generated tokens of a request.", _TPOT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between successive generated tokens of a request.", _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of finished requests.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens of finished requests.", _TOKEN_BUCKETS)
        self._last_stats = {"prompt_tokens_seen": 0, "prompt_tokens_cached": 0, "prompt_tokens_computed": 0,
                            "generation_tokens": 0, "preemptions": 0}
        self._window: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens so far)
        self.throughput.set_function(self._throughput)
        self.prefix_cache = PrefixCacheCollector(model_name)
        r.register(self.prefix_cache)
        self.spec_decode = SpecDecodeCollector(model_name)
        r.register(self.spec_decode)

    def update_engine(self, usage: EngineUsage) -> None:
        """Copy the engine's counts (`LLMEngine.usage()`) into the gauges and counters. Call
        from the loop thread."""
        self.prefix_cache.update(usage)
        self.spec_decode.update(usage)
        self.running.set(usage.num_running)
        self.waiting.set(usage.num_waiting)
        self.slots_used.set(usage.num_slots_used)
        self.slots_total.set(usage.num_slots_total)
        self.blocks_used.set(usage.num_blocks_used)
        self.blocks_total.set(usage.num_blocks_total)
        self.cache_usage.set(max(usage.num_slots_used / max(usage.num_slots_total, 1),
                                 usage.num_blocks_used / max(usage.num_blocks_total, 1)))
        counts = {"prompt_tokens_seen": (usage.prompt_tokens_seen, (self.prompt_tokens,)),
                  "prompt_tokens_cached": (usage.prompt_tokens_cached,
                                           (self.prompt_tokens_cached, self.prompt_tokens_hit)),
                  "prompt_tokens_computed": (usage.prompt_tokens_seen - usage.prompt_tokens_cached,
                                             (self.prompt_tokens_computed,)),
                  "generation_tokens": (usage.generation_tokens, (self.generation_tokens,)),
                  "preemptions": (usage.preemptions, (self.preemptions,))}
        for name, (value, counters) in counts.items():
            delta = value - self._last_stats[name]
            if delta > 0:
                for counter in counters:
                    counter.inc(delta)
            self._last_stats[name] = value
        now = time.monotonic()
        self._window.append((now, usage.generation_tokens))
        while len(self._window) > 2 and now - self._window[1][0] > _THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def _throughput(self) -> float:
        # Evaluated at scrape time, so that it decays to 0 while the engine idles.
        if not self._window:
            return 0.0
        (t0, n0), (_, n1) = self._window[0], self._window[-1]
        now = time.monotonic()
        return (n1 - n0) / (now - t0) if now > t0 else 0.0

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` tokens of one sequence arrived `seconds` after its previous ones."""
        per_token = seconds / max(num_tokens, 1)
        for _ in range(max(num_tokens, 1)):
            self.tpot.observe(per_token)
            self.itl.observe(per_token)

    def observe_finished(self, seconds: float, finish_reason: str | None, prompt_tokens: int = 0,
                         generation_tokens: int = 0) -> None:
        """A sequence (one of a request's n completions) finished `seconds` after its request
        arrived, with its finish reason, its prompt's tokens and the tokens it generated."""
        self.e2e.observe(seconds)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self._finished.labels(self._model_name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------- prefix cache
class PrefixCacheCollector:
    """vLLM's prefix-cache counters, in prompt tokens: `vllm:prefix_cache_queries` (looked up at
    admission) and `vllm:prefix_cache_hits` (served from the cache), exposed as the `_total`
    samples of counters labelled with model_name, without `_created` series. They are read from
    `EngineUsage` at scrape time instead of being incremented here, so they equal the engine's
    `Scheduler.prefix_cache_stats` as of the loop thread's last `update_engine`."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.queries = 0
        self.hits = 0

    def update(self, usage: EngineUsage) -> None:
        """Take the engine's counts (the loop thread; two int stores, read whole by a scrape)."""
        self.queries, self.hits = usage.prefix_cache_queries, usage.prefix_cache_hits

    def describe(self):
        return list(self.collect())  # the registry checks these names against the others'

    def collect(self):
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.",
                 self.queries),
                ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", self.hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


# ---------------------------------------------------------------------------- speculative decoding
class SpecDecodeCollector:
    """vLLM's speculative-decoding counters, read from `EngineUsage.spec_decode` at scrape time:
    `vllm:spec_decode_num_drafts` (verifying sequence-steps), `_num_draft_tokens`,
    `_num_accepted_tokens`, and `_num_accepted_tokens_per_pos` labelled by draft position
    (0-based); `_total` samples labelled with model_name, no `_created` series. Nothing is
    exposed until the engine has drafted (an engine without speculative decoding shows none)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats = None

    def update(self, usage: EngineUsage) -> None:
        """Take the engine's counts (the loop thread; one reference store, read whole by a scrape)."""
        self.stats = usage.spec_decode if usage.spec_decode.num_drafts else None

    def describe(self):
        return []  # the names appear only once drafting starts

    def collect(self):
        st = self.stats
        if st is None:
            return
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Sequence-steps that verified drafts.", st.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", st.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", st.num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=["model_name", "position"])
        for pos, value in enumerate(st.num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(pos)], value)
        yield family
