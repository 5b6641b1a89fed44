"""Per-request round spans for the attention path.

The cache segments a request's prompt once, when the scheduler first matches it,
and keeps the spans by request id. A lookup is then O(rounds): the attention
backend asks for the rounds of each request in a forward batch without walking
the radix tree. Spans are freed when the request is released; a capacity bound
catches requests that leave without a release (aborts before scheduling).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

from sgl_spec.cache.segment import Span, segment
from sgl_spec.cache.turn_format import TurnFormat


class RoundSpan(NamedTuple):
    """Tokens [start, end) of a request's sequence in one turn piece."""

    start: int
    end: int
    round: int
    turn: int
    role: str | None
    reasoning: bool


class RequestRounds:
    """rid -> spans of the request's prompt. Owned by the scheduler's cache;
    read by the attention backend in the same process and thread."""

    def __init__(self, fmt: TurnFormat | None, capacity: int = 4096):
        self.fmt = fmt
        self.capacity = capacity
        self._spans: OrderedDict[str, list[RoundSpan]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._spans)

    def observe(self, rid: str, tokens: Sequence[int]) -> None:
        """Segment the prompt of ``rid`` (once; later calls are O(1))."""
        if rid in self._spans:
            return
        spans = _from_segments(segment(tokens, self.fmt)) if self.fmt else [
            RoundSpan(0, len(tokens), 0, 0, None, False)
        ]
        self._spans[rid] = spans
        while len(self._spans) > self.capacity:
            self._spans.popitem(last=False)

    def get(self, rid: str, seq_len: int | None = None) -> list[RoundSpan] | None:
        """The spans of ``rid``; the last one reaches ``seq_len`` (generated
        tokens belong to the open turn). None for an unknown request."""
        spans = self._spans.get(rid)
        if spans is None or seq_len is None or not spans:
            return spans
        last = spans[-1]
        if seq_len > last.end:
            return spans[:-1] + [last._replace(end=seq_len)]
        return spans

    def release(self, rid: str) -> None:
        self._spans.pop(rid, None)


def _from_segments(spans: list[Span]) -> list[RoundSpan]:
    return [
        RoundSpan(s.start, s.end, s.tag.round, s.tag.turn, s.tag.role, s.tag.reasoning)
        for s in spans
    ]


_REGISTRY: RequestRounds | None = None


def registry() -> RequestRounds | None:
    """The scheduler process's round registry (None until a SpecRadixCache exists)."""
    return _REGISTRY


def set_registry(rounds: RequestRounds | None) -> None:
    global _REGISTRY
    _REGISTRY = rounds
