"""How much sparse decode acted: sgl_spec's counters from a server's ``/metrics``.

A sparse ``--spec-mode`` with ``--enable-metrics`` exports (``sgl_spec.attention.metrics``)
``sgl_spec:decode_steps_total{path="sparse"|"exact"}``: request decode steps that
attended a KV subset or the whole history, and ``sgl_spec:sparse_reselections_total``;
``specontext`` also the histograms of its head time per pass, rows loaded per step
and KV head (elastic loading) and the overlap of consecutive selections
(``sgl_spec:specontext_*``, read as their ``_sum`` and ``_count``).
Counters are cumulative since the server started: read them before and after a
workload and take the ``delta``. A server without them (stock sglang, exact mode,
metrics off) reads as None.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import requests

logger = logging.getLogger(__name__)

_RESELECT = "sgl_spec:sparse_reselections_total"


def by_path(text: str, counter: str) -> dict[str, float]:
    """``counter{path=...}`` of a Prometheus text exposition, summed per path over any
    other labels (a multiprocess collector may add some); empty when absent."""
    pattern = re.compile(rf'^{re.escape(counter)}\{{[^}}]*path="(\w+)"[^}}]*\}}\s+(\S+)', re.M)
    out: dict[str, float] = {}
    for path, value in pattern.findall(text):
        out[path] = out.get(path, 0.0) + float(value)
    return out


def add(counts: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Per-path counts summed over several reads (None: no counter anywhere)."""
    out: dict[str, float] = {}
    for c in counts:
        for k, v in (c or {}).items():
            out[k] = out.get(k, 0.0) + v
    return out or None


# SparseCounters field -> the series it sums (over any labels).
_HISTOGRAM_PARTS = {
    "loaded_sum": "sgl_spec:specontext_rows_loaded_sum",
    "loaded_n": "sgl_spec:specontext_rows_loaded_count",
    "overlap_sum": "sgl_spec:specontext_selection_overlap_sum",
    "overlap_n": "sgl_spec:specontext_selection_overlap_count",
    "head_s": "sgl_spec:specontext_head_seconds_sum",
    "head_n": "sgl_spec:specontext_head_seconds_count",
}


def scalar(text: str, series: str) -> float:
    """``series`` of a Prometheus text exposition, summed over its labels (0 if absent)."""
    pattern = re.compile(rf"^{re.escape(series)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
    return sum(float(v) for v in pattern.findall(text))


class SparseCounters(NamedTuple):
    """Request decode steps by attention path, reselections (loopserve), and
    specontext's elastic loading (sums and counts of its histograms)."""

    sparse: float
    exact: float
    reselections: float
    loaded_sum: float = 0.0  # rows loaded per (step, KV head), summed over steps
    loaded_n: float = 0.0
    overlap_sum: float = 0.0
    overlap_n: float = 0.0
    head_s: float = 0.0
    head_n: float = 0.0

    @property
    def steps(self) -> float:
        return self.sparse + self.exact

    @property
    def sparse_share(self) -> float | None:
        return self.sparse / self.steps if self.steps else None


def parse(text: str) -> SparseCounters | None:
    """The counters of a Prometheus text exposition; None when it has no decode steps."""
    steps = by_path(text, "sgl_spec:decode_steps_total")
    if not steps:
        return None
    reselections = scalar(text, _RESELECT)
    return SparseCounters(steps.get("sparse", 0.0), steps.get("exact", 0.0), reselections,
                          **{f: scalar(text, name) for f, name in _HISTOGRAM_PARTS.items()})


def fetch(url: str) -> str | None:
    """The Prometheus text of the server at ``url``; None without /metrics."""
    try:
        r = requests.get(url.rstrip("/") + "/metrics", timeout=30)
        r.raise_for_status()
    except requests.RequestException as exc:
        logger.warning("no sparse-decode counters from %s/metrics: %s", url, exc)
        return None
    return r.text


def read(url: str) -> SparseCounters | None:
    """The counters of the server at ``url``; None without them or without /metrics."""
    text = fetch(url)
    return None if text is None else parse(text)


_PASS = "sgl_spec:decode_pass_seconds"


def passes(text: str) -> dict[str, list[float]]:
    """``sgl_spec:decode_pass_seconds`` by path: [seconds, passes] (sum and count, any
    ``--spec-mode`` with metrics on); empty when absent (stock sglang)."""
    sums, counts = by_path(text, _PASS + "_sum"), by_path(text, _PASS + "_count")
    return {p: [sums.get(p, 0.0), n] for p, n in counts.items()}


def pass_delta(after: dict[str, list[float]], before: dict[str, list[float]]
               ) -> dict[str, list[float]]:
    """Per path, [seconds, passes] between two ``passes`` reads (paths with a pass)."""
    out = {}
    for p, (s, n) in after.items():
        s0, n0 = before.get(p, [0.0, 0.0])
        if n > n0:
            out[p] = [s - s0, n - n0]
    return out


def pass_ms(d: dict[str, list[float]] | None) -> dict[str, float]:
    """Mean milliseconds per pass, by path, of a ``pass_delta``."""
    return {p: 1e3 * s / n for p, (s, n) in (d or {}).items() if n}


def minus(after: SparseCounters | None, before: SparseCounters | None
          ) -> SparseCounters | None:
    """What happened between two reads; None without counters."""
    if after is None:
        return None
    before = before or SparseCounters(0.0, 0.0, 0.0)
    return SparseCounters(*(a - b for a, b in zip(after, before)))


def plus(a: SparseCounters | None, b: SparseCounters | None) -> SparseCounters | None:
    """Two stretches' counters together (a row resumed on another server)."""
    if a is None or b is None:
        return a if b is None else b
    return SparseCounters(*(x + y for x, y in zip(a, b)))


def delta(after: SparseCounters | None, before: SparseCounters | None) -> dict | None:
    """What happened between two reads, as a results.json record; None without counters."""
    d = minus(after, before)
    if d is None:
        return None
    mean = lambda total, n: total / n if n else None  # noqa: E731
    return {"sparse_steps": int(d.sparse), "decode_steps": int(d.steps),
            "reselections": int(d.reselections), "sparse_share": d.sparse_share,
            "rows_loaded_per_step": mean(d.loaded_sum, d.loaded_n),
            "selection_overlap": mean(d.overlap_sum, d.overlap_n),
            "head_ms_per_pass": mean(1e3 * d.head_s, d.head_n)}
