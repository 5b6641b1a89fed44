"""Cut a token sequence into turns and reasoning spans (a :class:`TurnFormat` scan).

A turn starts at the first token of a role opener and runs to the next opener.
Inside a turn, a reasoning span runs from the start marker through the end
marker. Tokens before the first opener (BOS, raw ``/generate`` text) are turn 0
with no role: a request that is not chat-formatted is one untagged turn.

Rounds follow Round Attention: a round is one user question and everything
answering it (assistant and tool turns), so the round index steps at each user
turn; a system prompt is round 0.

The scan is one vectorised search for the patterns' first tokens and a Python
step per candidate, so its cost is O(tokens) in numpy plus O(turns) in Python.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple, Sequence

import numpy as np

from sgl_spec.cache.turn_format import TurnFormat


class TurnTag(NamedTuple):
    """What a cached span belongs to. ``role`` is None for untagged text and for a
    turn whose opener is not complete yet (the sequence ends inside it)."""

    turn: int
    role: str | None
    round: int
    reasoning: bool


class Span(NamedTuple):
    """Tokens [start, end) with one tag; ``closed_at`` is the position after the
    turn's end marker, or None while the turn is still open."""

    start: int
    end: int
    tag: TurnTag
    closed_at: int | None


UNTAGGED = TurnTag(turn=0, role=None, round=0, reasoning=False)


def as_numpy(tokens: Sequence[int]) -> np.ndarray:
    if isinstance(tokens, array) and tokens.typecode == "q":
        return np.frombuffer(tokens, dtype=np.int64)
    return np.asarray(tokens, dtype=np.int64)


def _events(arr: np.ndarray, fmt: TurnFormat, lo: int):
    """(position, kind, role, length) of the pattern matches starting at or after
    ``lo``, in order; kind 0 = opener (role None: the sequence ends inside it),
    1 = end marker, 2 = reasoning start, 3 = reasoning end. One vectorised pass
    finds the candidates; each is checked in Python (a few per turn)."""
    n = len(arr)
    view = arr[lo:]
    hit = view == fmt.first_ids[0]
    for t in fmt.first_ids[1:]:  # a handful: cheaper than np.isin
        hit |= view == t
    cand = np.flatnonzero(hit)
    if not len(cand):
        return
    longest = fmt.longest
    kinds = fmt.kinds
    for p in (cand + lo).tolist():
        window = tuple(arr[p : p + longest].tolist())
        for pattern, kind, role in kinds:
            if window[: len(pattern)] == pattern:
                yield p, kind, role, len(pattern)
                break
        else:
            if p + longest > n and any(
                len(pat) > len(window) and pat[: len(window)] == window
                for pat, kind, _ in kinds if kind == 0
            ):
                yield p, 0, None, n - p


def segment(tokens: Sequence[int], fmt: TurnFormat, start: int = 0,
            state: tuple[TurnTag, int | None] | None = None,
            base: int = 0) -> list[Span]:
    """Spans covering ``tokens[start:]`` in order; boundaries where the tag changes.

    ``state`` is (tag, closed_at) in force at ``start`` (from the cached prefix),
    so a cache can segment only what it has not tagged yet. ``base`` is the
    sequence position of ``tokens[0]``; spans are in sequence positions.
    """
    arr = as_numpy(tokens)
    n = len(arr)
    if n <= start:
        return []
    spans: list[Span] = []
    tag, closed_at = state if state is not None else (UNTAGGED, None)
    if closed_at is not None:
        closed_at -= base  # positions below are relative to tokens[0]
    turn, rnd = tag.turn, tag.round
    opened = state is not None and start + base > 0
    skip_to = start

    def cut(at: int, new_tag: TurnTag, new_closed: int | None):
        nonlocal start, tag, closed_at
        if at > start:
            spans.append(Span(start, at, tag, closed_at))
        start, tag, closed_at = at, new_tag, new_closed

    for p, kind, role, size in _events(arr, fmt, start):
        if p < skip_to:
            continue
        if kind == 0:
            if opened or spans or tag != UNTAGGED or p + base > 0:
                turn += 1
            if role == "user":
                rnd += 1
            cut(p, TurnTag(turn, role, rnd, False), None)
            skip_to = p + size
        elif kind == 1:
            if closed_at is None and tag.role is not None:
                closed_at = p + size
                # Closing is positional, not a cut: the span ends after the marker
                # and _merge joins it with the rest of the turn.
                spans.append(Span(start, p + size, tag, closed_at))
                start = p + size
            skip_to = p + size
        elif kind == 2 and not tag.reasoning and tag.role is not None:
            cut(p, tag._replace(reasoning=True), closed_at)
            skip_to = p + size
        elif kind == 3 and tag.reasoning:
            cut(p + size, tag._replace(reasoning=False), closed_at)
            skip_to = p + size
    if n > start:
        spans.append(Span(start, n, tag, closed_at))
    if base:
        spans = [Span(a + base, b + base, t, None if c is None else c + base)
                 for a, b, t, c in spans]
    return _merge(spans)


def _merge(spans: list[Span]) -> list[Span]:
    """Join neighbours with the same tag (the end marker splits a span in two)."""
    out: list[Span] = []
    for s in spans:
        if out and out[-1].tag == s.tag and out[-1].end == s.start:
            prev = out[-1]
            out[-1] = Span(prev.start, s.end, s.tag, s.closed_at or prev.closed_at)
        else:
            out.append(s)
    return out
