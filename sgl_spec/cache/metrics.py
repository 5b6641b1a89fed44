"""Prometheus metrics of the radix cache's turns, exported beside sglang's own.

Created in the scheduler process only with ``--enable-metrics`` (sglang's
multiprocess collector then serves them from ``/metrics``). The cache refreshes the
gauges at most once per ``interval`` seconds (``due``), from its insert path, with
the totals of ``summary.totals``.
"""

from __future__ import annotations

import time

from .turn_format import ROLES

# Eviction rules tokens are freed by: the tagged core's turn-aware order, or LRU.
RULES = ("dead_reasoning", "inactive_conversation", "lru")


class CacheMetrics:
    def __init__(self, interval: float = 5.0, krul: bool = False,
                 sparse_from: int | None = None, rounds: bool = False,
                 offload: bool = False):
        from prometheus_client import Counter, Gauge

        self.interval = interval
        self._last = float("-inf")
        self._freed_seen: dict[str, int] = {}
        self.cached_tokens = Gauge(
            name="sgl_spec:cached_tokens",
            documentation="Tokens in the radix cache, by role (turns derived from the "
            "chat template) and tier.",
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
        self.live_states = Gauge(
            name="sgl_spec:live_request_states",
            documentation="Requests a per-request structure holds state for (decode "
            "policy states and slots, LoopServe's offered lines and seeds); 0 when idle.",
            labelnames=("structure",),
            multiprocess_mode="mostrecent",
        )
        self.decode_rows = Gauge(
            name="sgl_spec:decode_rows",
            documentation="Live requests by how their decode steps attend: 'sparse' (a "
            "subset) or 'exact' (short history, LoopServe's first steps); the reasons per "
            "request are at GET /sgl_spec/cache (decode.rows).",
            labelnames=("path",),
            multiprocess_mode="mostrecent",
        )
        self.sparse_from = Gauge(
            name="sgl_spec:decode_sparse_from_tokens",
            documentation="Shortest history that decodes sparse (--spec-min-context, raised "
            "to the decode profile's crossover); -1: every history decodes exactly (exact "
            "mode, or a sparse mode the profile found faster nowhere).",
            multiprocess_mode="mostrecent",
        )
        self.sparse_from.set(-1 if sparse_from is None else sparse_from)

        self.host_restore = Gauge(
            name="sgl_spec:host_restore",
            documentation="HiCache's host-tier restore stage (stock's copy or Krul's "
            "rows), running totals: load-backs admitted and refused, tokens, and seconds "
            "in load_back (admit) and in the scheduler's part of the copy (transfer; on "
            "a CPU pool the copy itself); with a Krul restore profile, its pre-pass, the "
            "copy and the seconds they ran at once (recompute_seconds, load_seconds, "
            "overlap_seconds). Absent without --enable-hierarchical-cache.",
            labelnames=("figure",),
            multiprocess_mode="mostrecent",
        )
        self.krul = None
        if krul:
            self.krul = Gauge(
                name="sgl_spec:krul",
                documentation="Krul's host tier: compressed bytes and their full-size "
                "equivalent (stored_bytes, full_bytes), the restore share recomputed, and "
                "running totals of restores recomputed, their token-layers and seconds, "
                "and loads refused for a failed checksum; compressed nodes by whose layer "
                "pairs they use (the conversation's or the model's), and the estimator's "
                "observed rows and seconds (in the forward pass, on its worker).",
                labelnames=("figure",),
                multiprocess_mode="mostrecent",
            )

        self.tiers = None
        if rounds:
            self.tiers = Gauge(
                name="sgl_spec:kv_tier",
                documentation="Round mode's layer-tiered KV pool: device bytes of the lower "
                "and upper tiers (read from the buffers), host bytes of the stored round "
                "blocks, upper slots in use and working sets, and the running totals of "
                "selections and of the tokens they saw and kept.",
                labelnames=("figure",),
                multiprocess_mode="mostrecent",
            )

        self.offload = None
        if offload:
            self.offload = Gauge(
                name="sgl_spec:offload",
                documentation="--spec-offload auto (SpeContext's adaptive memory "
                "management): layers on the host, device KV bytes of the resident layers' "
                "rows in use and of the staging rows, host bytes of the offloaded layers' "
                "rows in use, the budget, and the share of the host layers' elastic loads "
                "hidden behind compute (-1 until measured).",
                labelnames=("figure",),
                multiprocess_mode="mostrecent",
            )

    TIER_FIGURES = ("host_bytes", "host_blocks", "upper_slots_used", "working_sets",
                    "selections", "tokens_seen", "tokens_kept", "dropped_rounds")

    def update_tiers(self, totals: dict) -> None:
        """Round mode's figures from ``RoundRuntime.totals`` (``GET /sgl_spec/cache`` ->
        tiers)."""
        if self.tiers is None:
            return
        for tier, n in totals["device_bytes"].items():
            self.tiers.labels(figure=f"device_bytes_{tier}").set(n)
        for figure in self.TIER_FIGURES:
            self.tiers.labels(figure=figure).set(totals.get(figure, 0) or 0)

    def update_offload(self, report: dict) -> None:
        """From ``PoolOffload.report`` (``GET /sgl_spec/cache`` -> offload)."""
        if self.offload is None:
            return
        hidden = (report["host_loads"] or {}).get("hidden_share")
        for figure, n in (("host_layers", len(report["host_layers"])),
                          ("device_bytes_layers", report["device_bytes"]["layers"]),
                          ("device_bytes_staging", report["device_bytes"]["staging"]),
                          ("host_bytes", report["host_bytes"]),
                          ("budget_bytes", report["budget_bytes"]),
                          ("host_loads_hidden_share", -1 if hidden is None else hidden)):
            self.offload.labels(figure=figure).set(n)

    def due(self, force: bool = False) -> bool:
        """Whether a refresh is due (and, if so, that one is happening now)."""
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return False
        self._last = now
        return True

    def update(self, totals: dict, freed_by_rule: dict[str, int],
               live: dict[str, int] | None = None, restore: dict | None = None,
               rows: dict[str, dict] | None = None) -> None:
        paths = [r["path"] for r in (rows or {}).values()]
        for path in ("sparse", "exact"):
            self.decode_rows.labels(path=path).set(paths.count(path))
        for figure, n in (restore or {}).items():
            self.host_restore.labels(figure=figure).set(n)
        for structure, n in (live or {}).items():
            self.live_states.labels(structure=structure).set(n)
        for role in (*ROLES, "reasoning", "untagged"):
            self.cached_tokens.labels(role=role, tier="all").set(totals["by_role"].get(role, 0))
        for tier, n in totals["by_tier"].items():
            self.cached_tokens.labels(role="all", tier=tier).set(n)
        for rule, n in freed_by_rule.items():
            delta = n - self._freed_seen.get(rule, 0)
            if delta > 0:
                self.evicted_tokens.labels(rule=rule).inc(delta)
            self._freed_seen[rule] = n

    KRUL_FIGURES = ("stored_bytes", "full_bytes", "recompute_share", "recomputed_restores",
                    "recomputed_token_layers", "recompute_seconds", "refused_loads",
                    "conversation_strategy_nodes", "model_strategy_nodes",
                    "observed_prefill_rows", "observed_decode_rows",
                    "observe_inline_seconds", "observe_worker_seconds")

    def update_krul(self, totals: dict) -> None:
        """Krul's figures from ``Compressor.totals`` (``GET /sgl_spec/cache`` → krul)."""
        if self.krul is None:
            return
        for figure in self.KRUL_FIGURES:
            self.krul.labels(figure=figure).set(totals.get(figure, 0) or 0)
