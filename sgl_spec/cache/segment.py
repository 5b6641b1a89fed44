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


def _match_at(arr: np.ndarray, pos: int, pattern: tuple[int, ...]) -> int:
    """1 on a full match at pos, 0 on a mismatch, -1 if arr ends inside a match."""
    n = len(arr)
    avail = min(len(pattern), n - pos)
    for i in range(avail):
        if arr[pos + i] != pattern[i]:
            return 0
    return 1 if avail == len(pattern) else -1


def segment(tokens: Sequence[int], fmt: TurnFormat) -> list[Span]:
    """Spans covering ``tokens`` exactly, in order; boundaries where the tag changes."""
    arr = as_numpy(tokens)
    n = len(arr)
    if n == 0:
        return []
    if len(fmt.first_ids) == 1:
        cand = np.flatnonzero(arr == fmt.first_ids[0])
    else:
        cand = np.flatnonzero(np.isin(arr, fmt.first_ids))

    spans: list[Span] = []
    start, tag, closed_at = 0, UNTAGGED, None
    turn, rnd = 0, 0
    think_open = fmt.think[0] if fmt.think else None
    think_close = fmt.think[1] if fmt.think else None
    skip_to = 0

    def cut(at: int, new_tag: TurnTag, new_closed: int | None):
        nonlocal start, tag, closed_at
        if at > start:
            spans.append(Span(start, at, tag, closed_at))
        start, tag, closed_at = at, new_tag, new_closed

    for p in cand.tolist():
        if p < skip_to:
            continue
        opened = None
        pending = False
        for role, pattern in fmt.openers:
            m = _match_at(arr, p, pattern)
            if m == 1:
                opened = (role, pattern)
                break
            pending |= m == -1
        if opened is not None or pending:
            role = opened[0] if opened else None
            if spans or start > 0 or tag != UNTAGGED or p > 0:
                turn += 1
            if role == "user":
                rnd += 1
            cut(p, TurnTag(turn, role, rnd, False), None)
            skip_to = p + (len(opened[1]) if opened else n)
            continue
        if fmt.end and _match_at(arr, p, fmt.end) == 1:
            if closed_at is None and tag.role is not None:
                closed_at = p + len(fmt.end)
                # The span so far is open; close state is positional, not a cut.
                tag_now = tag
                spans_start = start
                spans.append(Span(spans_start, p + len(fmt.end), tag_now, closed_at))
                start = p + len(fmt.end)
            skip_to = p + len(fmt.end)
            continue
        if think_open and not tag.reasoning and tag.role is not None:
            if _match_at(arr, p, think_open) == 1:
                cut(p, tag._replace(reasoning=True), closed_at)
                skip_to = p + len(think_open)
                continue
        if think_close and tag.reasoning and _match_at(arr, p, think_close) == 1:
            stop = p + len(think_close)
            if stop < n:
                cut(stop, tag._replace(reasoning=False), closed_at)
            skip_to = stop
    if n > start:
        spans.append(Span(start, n, tag, closed_at))
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
