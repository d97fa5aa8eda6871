"""Prefix-cache bookkeeping shared by the KV block pool and the state checkpoint pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counters of the prefix cache since the engine started, in prompt tokens (vLLM's
    prefix_cache_queries / prefix_cache_hits): queries = prompt tokens of the sequences looked
    up at admission (each admission counts, a re-admission after preemption too); hits = the
    tokens of those served from the cache. Both only grow."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0
