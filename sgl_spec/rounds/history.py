"""A conversation's stored rounds: where each finished round's upper-layer KV lives.

``RoundHistory`` is what a radix node's ``rounds`` payload holds: the rounds stored so far
on the path to it, in order, each a ``StoredRound`` (its turn-tag round index, its
positions and its host block). It is immutable and shared: a longer history reuses the
shorter one's blocks, so one block per round lives in the host tier however many nodes
refer to it. A history serves any prefix of its tokens (``upto``): the KV of a position
depends on the tokens before it alone.

A round is one block, except where a later request stored more tokens of the same round
(the end-of-turn marker a chat template appends to an answer): that piece is a second
block of the same round index; selection takes a round's pieces together.
"""

from __future__ import annotations

from typing import NamedTuple

from sgl_spec.tiers.blocks import RoundBlock


class StoredRound(NamedTuple):
    round: int  # the turn tags' round index (0: the system prompt)
    start: int
    end: int  # positions [start, end); the block holds at least end - start rows
    block: RoundBlock

    @property
    def tokens(self) -> int:
        return self.end - self.start


class RoundHistory(NamedTuple):
    rounds: tuple[StoredRound, ...] = ()

    @property
    def end(self) -> int:
        """The first position no stored round covers."""
        return self.rounds[-1].end if self.rounds else 0

    def upto(self, n: int) -> RoundHistory:
        """The history of the first ``n`` positions (a round that runs past ``n`` is cut
        there; its block's first rows serve)."""
        if n >= self.end:
            return self
        kept = [r for r in self.rounds if r.start < n]
        if kept and kept[-1].end > n:
            kept[-1] = kept[-1]._replace(end=n)
        return RoundHistory(tuple(kept))

    def plus(self, new: list[StoredRound]) -> RoundHistory:
        if new and new[0].start != self.end:
            raise ValueError(f"a round from {new[0].start} does not continue a history "
                             f"ending at {self.end}")
        return RoundHistory(self.rounds + tuple(new))

    def groups(self) -> dict[int, list[int]]:
        """Round index -> the indices of its pieces in ``rounds``, in order."""
        out: dict[int, list[int]] = {}
        for i, r in enumerate(self.rounds):
            out.setdefault(r.round, []).append(i)
        return out
