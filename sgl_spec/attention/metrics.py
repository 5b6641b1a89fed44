"""Prometheus metrics of sparse decode, exported beside sglang's own.

Created in the scheduler process only with ``--enable-metrics`` and a sparse
``--spec-mode`` (sglang's multiprocess collector then serves them from
``/metrics``). A request-step is one request in one decode forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

# Attended positions per sparse request-step: powers of two up to 64k.
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 17))


class SparseMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        self.decode_steps = Counter(
            name="sgl_spec:decode_steps",
            documentation="Request decode steps by attention path: 'sparse' attended "
            "a KV subset, 'exact' the whole history.",
            labelnames=("path",),
        )
        for path in ("sparse", "exact"):
            self.decode_steps.labels(path=path)
        self.reselections = Counter(
            name="sgl_spec:sparse_reselections",
            documentation="Request decode steps that (re)selected the KV subset "
            "(loopserve: every --spec-nd steps once the history is long enough).",
        )
        self.selected_tokens = Histogram(
            name="sgl_spec:sparse_selected_tokens",
            documentation="KV positions attended per sparse request-step (sink + "
            "selection + recent window; mean over KV heads). Mean: _sum / _count.",
            buckets=_TOKEN_BUCKETS,
        )
        self.live_states = Gauge(
            name="sgl_spec:sparse_live_states",
            documentation="Requests holding a selection-policy state.",
            multiprocess_mode="mostrecent",
        )

    def observe_step(self, exact: int, selected: Sequence[float]) -> None:
        """One forward pass: ``exact`` dense rows, one ``selected`` entry per sparse row."""
        if exact:
            self.decode_steps.labels(path="exact").inc(exact)
        if selected:
            self.decode_steps.labels(path="sparse").inc(len(selected))
            for n in selected:
                self.selected_tokens.observe(n)

    def observe_reselections(self, n: int) -> None:
        if n:
            self.reselections.inc(n)

    def set_live_states(self, n: int) -> None:
        self.live_states.set(n)
