"""Krul's per-conversation attention statistics, gathered by the attention path (Sec 5).

Algorithm 1 chooses a conversation's layer pairs from its own attention
(``sgl_spec.krul.select``); ``sgl_spec.krul.similarity.Similarity`` holds what it needs in
O(L^2), whatever the length. This module feeds it from the served passes, the paper's
token-wise split:

* **prefill**: ``prefill_rows`` query positions of each extend (the last half of them its
  last positions, the rest drawn from the extend, seeded by rid and offset), the same in
  every layer. Their rows (m x Hq x n) are computed in line with the layer; folding them
  into the Gram (the L^2 / 2 dot products over m x Hq x n values) is, with a GPU, a worker
  thread's job, off the forward pass (the paper's asynchronous CPU part; past
  ``max_queued_bytes`` of rows waiting, a layer folds in line: bounded memory). On a CPU
  host the folds run in line: a second thread of torch work slowed the forward passes
  far more than the folds cost (``ObserveConfig.worker``).
* **decode**: a request's query row (1 x Hq x n) at every layer, at each step whose
  sequence length is a multiple of ``decode_every`` (no per-request counter), folded in
  line and dropped when the pass ends.

Lifetime: one accumulator per request, created at its first observed pass, seeded
with the sums of the conversation's earlier turns (``seed``: the radix cache hands
over the deepest ``krul_stats`` payload on the matched path), shared with the cache
at each checkpoint (``stats``: the payload on the checkpoint's node is the same object,
so late prefill folds still land in it) and dropped from here at release. Worker jobs
of a released request finish into the orphaned accumulator.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_spec.krul.similarity import Similarity, Step, attention_rows

from .batch import BatchView

logger = logging.getLogger(__name__)

MAX_SEEDS = 4096  # seeds kept for requests not yet observed (matched, then aborted)


@dataclass(frozen=True)
class ObserveConfig:
    prefill_rows: int = 8  # query positions observed per extend, at most
    # ... and one per this many new tokens (none under it): a row costs the same over the
    # whole history whatever the extend's length, so a short follow-up observing rows pays
    # a large share of its TTFT; one row per 128 new tokens keeps it a small one
    # (bench.krul_overhead measures it; docs/design/krul.md)
    tokens_per_row: int = 128
    decode_every: int = 64  # decode steps between observed ones (an observed step reads
    # every layer's keys: 1/64 of that per step)
    max_queued_bytes: int = 256 << 20  # rows waiting for the worker, at most
    # Fold prefill rows on a worker thread (True), in line (False), or None: a worker
    # where the model runs on a GPU (the CPU is free meanwhile: the paper's split), in
    # line on a CPU host, where a worker competes with the model for the same cores
    # (bench.krul_overhead measures both).
    worker: bool | None = None

    def __post_init__(self):
        if (self.prefill_rows < 1 or self.decode_every < 1 or self.tokens_per_row < 1
                or self.max_queued_bytes < 0):
            raise ValueError(f"ObserveConfig values must be positive: {self}")


class Observed(NamedTuple):
    """One request observed in a pass."""

    rid: str
    index: int  # its place in the pass (the extend span)
    q_idx: torch.Tensor  # [m] rows of the pass's q
    q_pos: torch.Tensor  # [m] their positions in the sequence
    decode: bool  # a decode row (its keys: positions 0..n-1 of its req_to_token row)
    deferred: bool  # prefill rows: folded on the worker
    step: Step
    row: int  # its req_to_token row
    n: int  # keys it has in this pass (positions 0..n-1)


class ObservePlan(NamedTuple):
    items: list[Observed]
    req_to_token: torch.Tensor | None = None  # the pass's, for rows read in place


def prefill_positions(rid: str, prefix: int, new: int, rows: int) -> list[int]:
    """Sorted distinct positions among the extend's ``new`` tokens after ``prefix``: its
    last ``rows // 2`` (at least one) and the rest drawn from the others (seeded)."""
    m = min(rows, new)
    last = max(1, m // 2) if m else 0
    out = list(range(prefix + new - last, prefix + new))
    rest = new - last
    if m - last > 0 and rest > 0:
        g = torch.Generator().manual_seed(zlib.crc32(f"{rid}:{prefix}".encode()))
        pick = torch.randperm(rest, generator=g)[: m - last]
        out += (prefix + pick).tolist()
    return sorted(out)


class Folder:
    """A worker thread that runs queued folds in order; bounded by bytes queued."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.seconds = 0.0
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn, nbytes: int) -> bool:
        """Queue ``fn()``; False (nothing queued) when that would pass the byte bound."""
        with self._lock:
            if self.queued_bytes + nbytes > self.max_bytes:
                return False
            self.queued_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sgl_spec-krul-fold",
                                                daemon=True)
                self._thread.start()
        self._q.put((fn, nbytes))
        return True

    def _run(self) -> None:
        while True:
            fn, nbytes = self._q.get()
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # a fold must never take the scheduler down
                logger.exception("sgl_spec krul: folding attention rows failed")
            finally:
                with self._lock:
                    self.queued_bytes -= nbytes
                    self.seconds += time.perf_counter() - t0
                self._q.task_done()

    def drain(self) -> None:
        """Wait until every queued fold ran (tests, shutdown)."""
        self._q.join()


class KrulObserver:
    """Plans which rows a pass observes and computes them layer by layer. Driven by the
    scheduler thread (the attention core's plan and run, the cache's match, checkpoint
    and release); only folds run on the worker."""

    def __init__(self, num_layers: int, cfg: ObserveConfig = ObserveConfig(),
                 device: torch.device | str = "cpu"):
        self.num_layers, self.cfg = num_layers, cfg
        worker = cfg.worker if cfg.worker is not None else torch.device(device).type == "cuda"
        self.folder = Folder(cfg.max_queued_bytes) if worker else None
        self._acc: dict[str, Similarity] = {}
        self._seeds: OrderedDict[str, Similarity] = OrderedDict()
        self.rows = {"prefill": 0, "decode": 0}  # (row, query head)s observed
        self.inline_seconds = 0.0  # rows computed and folded in the forward pass

    # ---- the cache's side -------------------------------------------------------
    def seed(self, rid: str, sim: Similarity | None) -> None:
        """The conversation's sums so far (the deepest payload on the matched path)."""
        self._seeds.pop(rid, None)
        if sim is not None and rid not in self._acc:
            self._seeds[rid] = sim.copy()
            if len(self._seeds) > MAX_SEEDS:
                self._seeds.popitem(last=False)

    def stats(self, rid: str) -> Similarity | None:
        """The request's accumulator (shared, not a copy), None if nothing observed."""
        return self._acc.get(rid)

    def release(self, rid: str) -> None:
        self._acc.pop(rid, None)
        self._seeds.pop(rid, None)

    @property
    def live_states(self) -> int:
        return len(self._acc) + len(self._seeds)

    def totals(self) -> dict:
        f = self.folder
        return {"observed_prefill_rows": self.rows["prefill"],
                "observed_decode_rows": self.rows["decode"],
                "observe_inline_seconds": round(self.inline_seconds, 4),
                "observe_worker_seconds": round(f.seconds, 4) if f else 0.0}

    # ---- the attention path's side ------------------------------------------------
    def _accumulator(self, rid: str) -> Similarity:
        acc = self._acc.get(rid)
        if acc is None:
            acc = self._seeds.pop(rid, None) or Similarity(self.num_layers)
            self._acc[rid] = acc
        return acc

    def plan(self, batch: BatchView) -> ObservePlan | None:
        items = []
        if batch.mode == "decode":
            every = self.cfg.decode_every
            for i, (rid, n, row) in enumerate(zip(batch.rids, batch.seq_lens, batch.pool_rows)):
                if n % every == 0:
                    items.append(Observed(rid, i, torch.tensor([i]), torch.tensor([n - 1]),
                                          True, False, self._accumulator(rid).step(), row, n))
        elif batch.mode == "extend":
            q_start = 0
            every = self.cfg.decode_every
            for i, (rid, n, e, row) in enumerate(zip(batch.rids, batch.seq_lens,
                                                     batch.extend_lens, batch.pool_rows)):
                # a one-token extend (a decode step in a mixed batch) as a decode step
                rows = 1 if e == 1 else min(self.cfg.prefill_rows, e // self.cfg.tokens_per_row)
                if e > 1 and rows == 0:  # a short turn: a row would cost more than its share
                    self._accumulator(rid)  # of TTFT; its sums carry on (decode rows add)
                elif e > 1 or (e == 1 and n % every == 0):
                    pos = torch.tensor(prefill_positions(rid, n - e, e, rows))
                    items.append(Observed(rid, i, q_start + pos - (n - e), pos, False,
                                          self.folder is not None,
                                          self._accumulator(rid).step(), row, n))
                q_start += e
        return ObservePlan(items, batch.req_to_token) if items else None

    def run(self, plan: ObservePlan, layer: int, q: torch.Tensor, k_buf: torch.Tensor,
            scale: float, span_keys=None) -> None:
        """Layer ``layer`` of the pass: compute the observed rows and fold (or queue)
        them. ``span_keys(index)``: an extend request's keys, already gathered."""
        t0 = time.perf_counter()
        last = layer == self.num_layers - 1
        for ob in plan.items:
            qo = q.index_select(0, ob.q_idx.to(q.device))
            rows = _rows_in_place(qo, k_buf, plan.req_to_token, ob, scale)
            if rows is None:  # not a call the C++ kernel takes: gather the keys
                k = (k_buf.index_select(0, plan.req_to_token[ob.row, :ob.n].long()) if ob.decode
                     else span_keys(ob.index))
                rows = attention_rows(qo, k, ob.q_pos, scale)
            if layer == 0:
                self.rows["decode" if ob.decode else "prefill"] += rows.shape[0] * rows.shape[1]
            rows = rows.cpu()
            if ob.deferred:
                fold = lambda ob=ob, rows=rows: _fold(ob.step, layer, rows, ob.q_pos, last)  # noqa: E731
                if self.folder.submit(fold, rows.numel() * rows.element_size()):
                    continue
                self.folder.drain()  # over the bound: the step's queued layers first, in order
            _fold(ob.step, layer, rows, ob.q_pos, last)
        self.inline_seconds += time.perf_counter() - t0


def _rows_in_place(q: torch.Tensor, k_buf: torch.Tensor, req_to_token: torch.Tensor | None,
                   ob: Observed, scale: float) -> torch.Tensor | None:
    """``attention_rows`` of ``ob`` with its keys read in place from the pool by the C++
    kernel (CPU), instead of a gather, a float copy and a tiny-M bmm, which cost most of
    a short follow-up's observation. None where the kernel does not take the call."""
    if req_to_token is None:
        return None
    from sgl_spec.kernels.sparse_decode import head_logits

    m, hq, _ = q.shape
    rows = torch.full((m,), ob.row, dtype=torch.int64)
    logits = head_logits(q.float() * scale, k_buf, req_to_token, rows, ob.q_pos + 1, ob.n)
    if logits is None:
        return None
    return torch.softmax(logits.view(m, hq, ob.n), dim=-1)


def _fold(step: Step, layer: int, rows: torch.Tensor, q_pos: torch.Tensor, last: bool) -> None:
    step.add(layer, rows, q_pos)
    if last:
        step.close()
