"""Per-request state that the radix cache and the attention path of one scheduler
share, keyed by rid: a ``RequestHub``.

Both live in the scheduler process (sglang runs the model in it) but are built by
different sglang factories. The attention path builds the hub with its core
(``sgl_spec.attention.build_core``); the cache, built after it, is handed the core's hub
(``sgl_spec.integration.radix.create_cache``). They meet here:

* releases: the cache calls ``release(rid)`` when the scheduler gives a request's KV
  row back (finished, aborted, retracted); the attention path's listeners free what
  they keep per request (selection-policy states);
* LoopServe's kept lines: at the end of a sparse extend the prefill ``offer_lines``;
  when the cache checkpoints that request into the tree it ``take_lines`` and keeps
  them as a payload of the node ending at the extend's last token; when a later
  request (the next turn, the next chunk) matches or continues that path, the cache
  ``set_seeds`` with the deepest lines on it, and the prefill reads ``seeds``.

* decode rows: the decoder reports how each live request decodes (``rows``), for
  ``GET /sgl_spec/cache``;

* live counts: every per-request structure of the process registers a counter
  (``add_live_source``); ``live()`` reads them all, for ``GET /sgl_spec/cache`` and the
  ``sgl_spec:live_request_states`` gauge, so that a test or the soak harness can check
  that finished, aborted and retracted requests leave nothing behind.

Not thread-safe: the scheduler thread makes every call. Nothing outlives a release;
seeds are also dropped once read, and when unread after ``SEED_TTL`` forward passes
(``tick``): a request matched in the waiting queue and aborted there is never released,
and sglang matches a request again in the round that runs its extend. At most
``MAX_KEPT`` offers and as many seeds are kept, oldest dropped first: offered lines have
no taker where the cache is not sgl_spec's tagged tree (``--disable-radix-cache``,
another ``--radix-cache-backend``) or where sglang keeps a streaming session's row
without releasing it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

MAX_KEPT = 4096  # offers, and seeds, kept at most (oldest dropped)
SEED_TTL = 8  # forward passes an unread seed is kept (match and extend share a round)


class Lines(NamedTuple):
    """Lines selected by one extend: ``layers`` (layer -> LineSet) over tokens [0, end)."""

    end: int
    layers: dict[int, Any]


class RequestHub:
    def __init__(self):
        self._listeners: list[Callable[[str], None]] = []
        self._idle_listeners: list[Callable[[], None]] = []
        self._offered: OrderedDict[str, Lines] = OrderedDict()
        self._seeds: OrderedDict[str, tuple[Lines, int]] = OrderedDict()  # (lines, set in pass)
        self._pass = 0
        self._live: dict[str, Callable[[], int]] = {}
        self._rows: Callable[[], dict[str, dict]] | None = None

    def add_release_listener(self, fn: Callable[[str], None]) -> None:
        if fn not in self._listeners:
            self._listeners.append(fn)

    def add_idle_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` when ``idle`` is called (seeds kept elsewhere: round mode's)."""
        if fn not in self._idle_listeners:
            self._idle_listeners.append(fn)

    def remove_release_listener(self, fn: Callable[[str], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def add_live_source(self, name: str, count: Callable[[], int]) -> None:
        """``count()``: how many requests the structure ``name`` holds state for now
        (a later source of the same name replaces it)."""
        self._live[name] = count

    def add_rows_source(self, rows: Callable[[], dict[str, dict]]) -> None:
        """``rows()``: per live request, how its decode steps attend (the decoder's)."""
        self._rows = rows

    def rows(self) -> dict[str, dict]:
        return self._rows() if self._rows is not None else {}

    def live(self) -> dict[str, int]:
        """Per structure, the requests it holds state for (all 0 once every request has
        finished or been aborted, and seeds have expired)."""
        out = {"prefill_lines_offered": len(self._offered), "prefill_seeds": len(self._seeds)}
        out.update((name, int(count())) for name, count in self._live.items())
        return out

    def tick(self) -> None:
        """One forward pass began: drop seeds unread for ``SEED_TTL`` passes."""
        self._pass += 1
        if self._seeds:
            cutoff = self._pass - SEED_TTL
            for rid in [r for r, (_, at) in self._seeds.items() if at < cutoff]:
                del self._seeds[rid]

    def idle(self) -> None:
        """No request runs or waits: drop the offers and seeds nobody can read any more
        (those of requests aborted in the queue, which are never released)."""
        self._offered.clear()
        self._seeds.clear()
        for fn in self._idle_listeners:
            fn()

    def release(self, rid: str) -> None:
        """The request's KV row is given back: drop everything kept for it."""
        self._offered.pop(rid, None)
        self._seeds.pop(rid, None)
        for fn in self._listeners:
            fn(rid)

    def offer_lines(self, rid: str, lines: Lines) -> None:
        _put(self._offered, rid, lines)

    def take_lines(self, rid: str, up_to: int) -> Lines | None:
        """The offered lines of ``rid`` if the tree now holds their tokens (end <= up_to)."""
        lines = self._offered.get(rid)
        if lines is None or lines.end > up_to:
            return None
        del self._offered[rid]
        return lines

    def set_seeds(self, rid: str, lines: Lines | None) -> None:
        self._seeds.pop(rid, None)
        if lines is not None:
            _put(self._seeds, rid, (lines, self._pass))

    def seeds(self, rid: str, prefix_len: int) -> Lines | None:
        """Seeds for an extend of ``rid`` over ``prefix_len`` cached tokens (read once)."""
        lines, _ = self._seeds.pop(rid, (None, 0))
        return lines if lines is not None and lines.end <= prefix_len else None

    def __len__(self) -> int:
        """Requests with offered lines or seeds (0 once all are released)."""
        return len(self._offered.keys() | self._seeds.keys())


def _put(kept: OrderedDict, rid: str, value) -> None:
    """Newest last; the oldest entry goes past ``MAX_KEPT``."""
    kept.pop(rid, None)
    kept[rid] = value
    if len(kept) > MAX_KEPT:
        kept.popitem(last=False)

