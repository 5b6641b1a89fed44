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

# Labels other than path (a multiprocess collector may add some) are summed over.
_STEPS = re.compile(r'^sgl_spec:decode_steps_total\{[^}]*path="(\w+)"[^}]*\}\s+(\S+)', re.M)
_RESELECT = re.compile(r"^sgl_spec:sparse_reselections_total(?:\{[^}]*\})?\s+(\S+)", re.M)


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
    found = _STEPS.findall(text)
    if not found:
        return None
    by_path = {"sparse": 0.0, "exact": 0.0}
    for path, value in found:
        by_path[path] = by_path.get(path, 0.0) + float(value)
    reselections = sum(float(v) for v in _RESELECT.findall(text))
    return SparseCounters(by_path["sparse"], by_path["exact"], reselections)


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
