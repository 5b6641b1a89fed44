"""Asynchronous prefetch of a pass's elastic loads (SpeContext Sec 5).

The retrieval head selects before the layers run, so every layer's staging copies
(``sgl_spec.sparse.elastic.ElasticPass.ahead``) are known at plan time and can run while earlier
layers compute; layer l's attention waits only for layer l's copies. Three ways:

* ``inline``: no overlap; layer l copies its rows right before its attention;
* ``thread``: a worker thread copies layer after layer from the start of the pass
  (CPU: torch ops release the GIL, so copies and compute can overlap on separate
  cores; whether that pays on a given CPU is not yet measured: issue 16);
* ``stream``: a CUDA side stream with one event per layer (the paper's design);
  unverified until a GPU is lent.

``get_prefetcher(name)`` builds one; ``auto`` is ``stream`` on CUDA, else ``inline``.
Each keeps a ``LoadClock``: the seconds its copies of the counted layers took and the
seconds their attention waited for them (with ``--spec-offload``, the host layers': the
share of the host loads hidden behind compute, the paper's Figure 9). The ``stream``
prefetcher's copies are not timed (events would sync the stream).
Each prefetcher serves one decoder (the scheduler thread) and at most one pass at a
time: ``start`` waits for the previous pass's copies first.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import torch

from sgl_spec.sparse.elastic import Loads

# layer -> (staging K, staging V, pool K, pool V), each [rows, Hkv, D]
LayerBuffers = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
PREFETCHERS = ("auto", "inline", "thread", "stream")


class LoadClock:
    """Copy and wait seconds of the elastic loads of ``layers`` (None: every layer)."""

    def __init__(self):
        self.layers: frozenset[int] | None = None
        self.copy_s = 0.0  # copying the loads
        self.blocked_s = 0.0  # a layer's attention waiting for its loads
        self.passes = 0

    def counts(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def totals(self) -> dict:
        """Running totals and the share of the copy time hidden behind compute."""
        hidden = None if self.copy_s <= 0 else max(0.0, 1.0 - self.blocked_s / self.copy_s)
        return {"passes": self.passes, "copy_seconds": self.copy_s,
                "blocked_seconds": self.blocked_s, "hidden_share": hidden}


class Prefetcher(ABC):
    name: ClassVar[str]
    timed: ClassVar[bool] = True  # whether ``clock`` measures its copies

    # Whether start() needs every layer's buffers up front (else wait() gets the layer's).
    needs_buffers: ClassVar[bool] = True
    # Whether start() takes the decoded token's own row too (``ElasticPass.current``):
    # only a prefetcher that copies once the layer has written it (at wait) can.
    copies_current: ClassVar[bool] = False

    @abstractmethod
    def start(self, loads: Loads, layers: int, buffers: LayerBuffers | None) -> None:
        """Begin copying ``loads`` for layers ``0..layers-1``."""

    @abstractmethod
    def wait(self, layer: int, bufs: tuple[torch.Tensor, ...]) -> None:
        """Return once layer ``layer``'s copies are done (or ordered before its use);
        ``bufs``: that layer's (staging K, staging V, pool K, pool V)."""


class InlinePrefetcher(Prefetcher):
    name = "inline"
    needs_buffers = False
    copies_current = True  # one copy call per layer: the loads ahead and the token's row

    def __init__(self):
        self._loads: Loads | None = None
        self.clock = LoadClock()

    def start(self, loads, layers, buffers) -> None:
        self._loads = loads
        self.clock.passes += 1

    def wait(self, layer: int, bufs) -> None:
        t0 = time.perf_counter()
        self._loads.copy(*bufs)
        if self.clock.counts(layer):  # nothing hidden: the layer waits for all of it
            dt = time.perf_counter() - t0
            self.clock.copy_s += dt
            self.clock.blocked_s += dt


class ThreadPrefetcher(Prefetcher):
    name = "thread"

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sgl_spec-prefetch")
        self._job: Future | None = None
        self._done: list[threading.Event] = []
        self.clock = LoadClock()

    def start(self, loads, layers, buffers) -> None:
        if self._job is not None:
            self._job.result()  # the previous pass's copies (normally long done)
        self._done = [threading.Event() for _ in range(layers)]
        done, clock = self._done, self.clock
        clock.passes += 1

        def run() -> None:
            try:
                for layer in range(layers):
                    t0 = time.perf_counter()
                    loads.copy(*buffers(layer))
                    if clock.counts(layer):
                        clock.copy_s += time.perf_counter() - t0
                    done[layer].set()
            finally:
                for e in done:  # a failed copy must not hang the layers: they re-raise
                    e.set()

        self._job = self._pool.submit(run)

    def wait(self, layer: int, bufs) -> None:
        t0 = time.perf_counter()
        self._done[layer].wait()
        if self.clock.counts(layer):
            self.clock.blocked_s += time.perf_counter() - t0
        if self._job.done() and self._job.exception() is not None:
            raise self._job.exception()


class StreamPrefetcher(Prefetcher):
    """CUDA side stream; the events order each layer's attention after its copies."""

    name = "stream"
    timed = False

    def __init__(self):
        self.clock = LoadClock()
        self._stream = torch.cuda.Stream()
        self._events: list[torch.cuda.Event] = []

    def start(self, loads, layers, buffers) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())  # the plan's indices
        self._events = []
        with torch.cuda.stream(self._stream):
            for layer in range(layers):
                loads.copy(*buffers(layer))
                e = torch.cuda.Event()
                e.record(self._stream)
                self._events.append(e)

    def wait(self, layer: int, bufs) -> None:
        torch.cuda.current_stream().wait_event(self._events[layer])


_CLASSES: dict[str, type[Prefetcher]] = {
    c.name: c for c in (InlinePrefetcher, ThreadPrefetcher, StreamPrefetcher)}


def get_prefetcher(name: str, device: torch.device | str) -> Prefetcher:
    if name not in PREFETCHERS:
        raise ValueError(f"--spec-prefetch {name!r} is invalid; valid: {', '.join(PREFETCHERS)}")
    if name == "auto":
        name = "stream" if torch.device(device).type == "cuda" else "inline"
    if name == "stream" and torch.device(device).type != "cuda":
        raise ValueError("--spec-prefetch stream needs a CUDA device; valid on CPU: auto, "
                         "inline, thread")
    return _CLASSES[name]()
