"""Prometheus metrics of the turn-aware cache, exported beside sglang's own.

Created in the scheduler process only with ``--enable-metrics`` (sglang's
multiprocess collector then serves them from ``/metrics``). Gauges are refreshed
at most once per ``interval`` seconds, from the cache's insert path.
"""

from __future__ import annotations

import time

from sgl_spec.cache.summary import totals
from sgl_spec.cache.tree_core import RULES
from sgl_spec.cache.turn_format import ROLES


class CacheMetrics:
    def __init__(self, interval: float = 1.0):
        from prometheus_client import Counter, Gauge

        self.interval = interval
        self._last = 0.0
        self._freed_seen: dict[str, int] = {}
        self.cached_tokens = Gauge(
            name="sgl_spec:cached_tokens",
            documentation="Tokens in the turn-aware radix cache, by role and tier.",
            labelnames=("role", "tier"),
            multiprocess_mode="mostrecent",
        )
        self.evicted_tokens = Counter(
            name="sgl_spec:evicted_tokens",
            documentation="Tokens freed by cache eviction, by eviction rule.",
            labelnames=("rule",),
        )
        for rule in RULES:
            self.evicted_tokens.labels(rule=rule)

    def maybe_update(self, core, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        t = totals(core)
        for role in (*ROLES, "reasoning", "untagged"):
            self.cached_tokens.labels(role=role, tier="all").set(t["by_role"].get(role, 0))
        for tier, n in t["by_tier"].items():
            self.cached_tokens.labels(role="all", tier=tier).set(n)
        for rule, n in core.freed_by_rule.items():
            delta = n - self._freed_seen.get(rule, 0)
            if delta > 0:
                self.evicted_tokens.labels(rule=rule).inc(delta)
            self._freed_seen[rule] = n
