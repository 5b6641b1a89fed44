"""How much sparse decode acted: sgl_spec's counters from a server's ``/metrics``.

A sparse ``--spec-mode`` with ``--enable-metrics`` exports (``sgl_spec.attention.metrics``)
``sgl_spec:decode_steps_total{path="sparse"|"exact"}``: request decode steps that
attended a KV subset or the whole history, and ``sgl_spec:sparse_reselections_total``.
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

_RESELECT_NAME = "sgl_spec:sparse_reselections_total"
_RESELECT = re.compile(rf"^{_RESELECT_NAME}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)


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


class SparseCounters(NamedTuple):
    """Request decode steps by attention path, and reselections (loopserve)."""

    sparse: float
    exact: float
    reselections: float

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
    reselections = sum(float(v) for v in _RESELECT.findall(text))
    return SparseCounters(steps.get("sparse", 0.0), steps.get("exact", 0.0), reselections)


def read(url: str) -> SparseCounters | None:
    """The counters of the server at ``url``; None without them or without /metrics."""
    try:
        r = requests.get(url.rstrip("/") + "/metrics", timeout=30)
        r.raise_for_status()
    except requests.RequestException as exc:
        logger.warning("no sparse-decode counters from %s/metrics: %s", url, exc)
        return None
    return parse(r.text)


def delta(after: SparseCounters | None, before: SparseCounters | None) -> dict | None:
    """What happened between two reads, as a results.json record; None without counters."""
    if after is None:
        return None
    before = before or SparseCounters(0.0, 0.0, 0.0)
    d = SparseCounters(*(a - b for a, b in zip(after, before)))
    return {"sparse_steps": int(d.sparse), "decode_steps": int(d.steps),
            "reselections": int(d.reselections), "sparse_share": d.sparse_share}
