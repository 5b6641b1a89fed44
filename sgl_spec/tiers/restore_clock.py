"""The host-tier restore stage, timed where every HiCache server passes (stock's full
copy and Krul's compressed rows alike), so that the two can be compared by the one
stage in which they differ rather than by a whole follow-up's TTFT.

Two parts, both in the scheduler thread:

* ``admit``: ``load_back`` of a matched host prefix: locking, allocating device slots
  and building the transfer; with Krul also verifying the stored rows' checksums and
  running the restore pre-pass (the rows its profile left unstored).
* ``transfer``: ``start_loading``, the host-to-device copy of every layer. On a CPU
  pool sglang runs it in line, so this is the copy itself (stock: a gather; Krul: the
  one-pass decode into the pool). On a GPU it only submits the copy to the loader
  stream; sglang's ``load_back_duration`` histogram times the copy there. With a Krul
  restore pre-pass pipelined, also the wait for the pre-pass after the copy.

Of these, a Krul restore's two parts and the time they ran at once: ``recompute_seconds``
(the pre-pass, T_C), ``load_seconds`` (the in-line copy, T_L) and ``overlap_seconds``
(T_C + T_L minus the time from the first pre-pass's start to the last one's end: 0 when
serial). A restore stage costs about ``seconds`` = T_C + T_L - overlap.

``GET /sgl_spec/cache`` serves the running totals (``restore``); a client takes the
difference around one request to get that request's restore stage.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

FIGURES = ("loads", "refused", "tokens", "admit_seconds", "transfer_seconds",
           "recompute_seconds", "load_seconds", "overlap_seconds")


@dataclass
class RestoreClock:
    loads: int = 0               # load-backs admitted
    refused: int = 0             # load-backs that returned False (too short, no room, or
                                 # a Krul checksum failed): recomputed instead
    tokens: int = 0              # tokens whose transfer was started
    admit_seconds: float = 0.0
    transfer_seconds: float = 0.0
    recompute_seconds: float = 0.0  # Krul's restore pre-passes (T_C)
    load_seconds: float = 0.0       # the in-line copies (T_L)
    overlap_seconds: float = 0.0    # of T_C + T_L, the time both ran at once

    @contextmanager
    def admitting(self):
        """Times one ``load_back``; the caller sets ``ok[0]`` to its result."""
        ok = [False]
        t0 = time.perf_counter()
        try:
            yield ok
        finally:
            self.admit_seconds += time.perf_counter() - t0
            if ok[0]:
                self.loads += 1
            else:
                self.refused += 1

    @contextmanager
    def transferring(self, tokens: int):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.transfer_seconds += time.perf_counter() - t0
            self.tokens += tokens

    def pipeline(self, recompute_s: float, load_s: float, wall_s: float | None) -> None:
        """One batch's restore parts: the pre-passes' own seconds, the copy's, and the
        seconds from the first pre-pass's start to the last one's end (None: none was
        pipelined)."""
        self.recompute_seconds += recompute_s
        self.load_seconds += load_s
        if wall_s is not None:
            self.overlap_seconds += max(0.0, recompute_s + load_s - wall_s)

    def totals(self) -> dict:
        out = asdict(self)
        out["seconds"] = self.admit_seconds + self.transfer_seconds
        return out


def delta(after: dict | None, before: dict | None) -> dict | None:
    """The restore stage between two ``totals()`` (None if either is missing: a server
    without HiCache)."""
    if not after or not before:
        return None
    return {k: after[k] - before.get(k, 0) for k in (*FIGURES, "seconds") if k in after}
