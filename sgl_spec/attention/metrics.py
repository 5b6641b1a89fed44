"""Prometheus metrics of sparse decode and sparse prefill, exported beside sglang's own.

Created in the scheduler process only with ``--enable-metrics`` and a sparse
``--spec-mode`` (:class:`SparseMetrics`) or ``--spec-prefill loopserve``
(:class:`PrefillMetrics`); sglang's multiprocess collector then serves them from
``/metrics``. A request-step is one request in one decode forward pass; a
request-extend is one request in one extend (prefill) forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

# Attended positions per sparse request-step: powers of two up to 64k.
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 17))
# Selected fraction of the causal extend matrix.
_DENSITY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)


def by_path(name: str, documentation: str):
    """A counter labelled ``path`` with both series ("sparse", "exact") present at 0."""
    from prometheus_client import Counter

    counter = Counter(name=name, documentation=documentation, labelnames=("path",))
    for path in ("sparse", "exact"):
        counter.labels(path=path)
    return counter


class SparseMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        self.decode_steps = by_path(
            "sgl_spec:decode_steps",
            "Request decode steps by attention path: 'sparse' attended a KV subset, "
            "'exact' the whole history.")
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


# Seconds of one decode pass: 5 ms doubling 10 times (to ~5 s).
_PASS_BUCKETS = tuple(5e-3 * 2**i for i in range(11))
PASS_PATHS = ("exact", "sparse", "reselect")


class PassMetrics:
    """Wall time of decode passes by what their attention did, in any ``--spec-mode``:
    "exact" (every row read its whole history), "sparse" (some row read a subset),
    "reselect" (some row also renewed its selection). A pass is timed from its plan to
    the next decode pass's plan (the scheduler's whole iteration: layers, logits,
    sampling, output); a pass followed by an extend or by idle time is not timed."""

    def __init__(self):
        from prometheus_client import Histogram

        self.pass_seconds = Histogram(
            name="sgl_spec:decode_pass_seconds",
            documentation="Wall time of a decode pass, plan to the next decode pass's plan, "
            "by attention path: 'exact', 'sparse' (some row attended a KV subset), "
            "'reselect' (some row renewed its selection). Mean: _sum / _count.",
            labelnames=("path",), buckets=_PASS_BUCKETS)
        for path in PASS_PATHS:
            self.pass_seconds.labels(path=path)

    def observe_pass(self, path: str, seconds: float) -> None:
        self.pass_seconds.labels(path=path).observe(seconds)


class PrefillMetrics:
    def __init__(self):
        from prometheus_client import Counter, Histogram

        self.extends = by_path(
            "sgl_spec:sparse_prefill_extends",
            "Request-extends by prefill attention path: 'sparse' attended the selected "
            "vertical/slash lines, 'exact' everything (fewer than "
            "--spec-prefill-min-tokens new tokens).")
        self.density = Histogram(
            name="sgl_spec:sparse_prefill_density",
            documentation="Selected cells / causal cells per sparse request-extend, "
            "mean over layers and KV heads.",
            buckets=_DENSITY_BUCKETS,
        )
        self.select_seconds = Counter(
            name="sgl_spec:sparse_prefill_select_seconds",
            documentation="Time spent selecting lines (all layers) in sparse "
            "request-extends.",
        )
        self.seeded = Counter(
            name="sgl_spec:sparse_prefill_seeded_extends",
            documentation="Sparse request-extends whose selection was seeded with "
            "the stored lines of the sequence they continue (--spec-prefill-reuse).",
        )

    def observe_pass(self, sparse: int, exact: int) -> None:
        if sparse:
            self.extends.labels(path="sparse").inc(sparse)
        if exact:
            self.extends.labels(path="exact").inc(exact)

    def observe_extend(self, density: float, select_s: float, seeded: bool) -> None:
        self.density.observe(density)
        self.select_seconds.inc(select_s)
        if seeded:
            self.seeded.inc()


# Seconds of the retrieval head per decode pass: 50 µs doubling 13 times.
_HEAD_BUCKETS = tuple(5e-5 * 2**i for i in range(14))
_SHARE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)


class SpeContextMetrics:
    """``--spec-mode specontext``: the retrieval head and elastic loading."""

    def __init__(self):
        from prometheus_client import Histogram

        self.head_seconds = Histogram(
            name="sgl_spec:specontext_head_seconds",
            documentation="Wall time of the retrieval head per decode pass (queries, "
            "scoring every sparse row's history, top-B), before the layers run.",
            buckets=_HEAD_BUCKETS)
        self.rows_loaded = Histogram(
            name="sgl_spec:specontext_rows_loaded",
            documentation="KV positions copied into a request's staging buffer per decode "
            "step and KV head (elastic loading: the set difference against the previous "
            "step; the first sparse step loads all of sink + budget + window), each layer.",
            buckets=_TOKEN_BUCKETS)
        self.overlap = Histogram(
            name="sgl_spec:specontext_selection_overlap",
            documentation="|S_now & S_last| / budget per request-step and KV head, for "
            "rows whose previous step also attended a selection.",
            buckets=_SHARE_BUCKETS)

    def observe_head(self, seconds: float) -> None:
        self.head_seconds.observe(seconds)

    def observe_loads(self, per_row_head: float) -> None:
        self.rows_loaded.observe(per_row_head)

    def observe_overlap(self, shares: Sequence[float]) -> None:
        for s in shares:
            self.overlap.observe(s)
