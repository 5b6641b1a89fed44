"""The scale-out benchmark's arithmetic (no server): cached-token share, token-exact
comparison with the first differing position, and which worker served each turn."""

from __future__ import annotations

import pytest

from sgl_spec.bench.scaleout import (
    Turn,
    cached_share,
    first_difference,
    mismatches,
    placement,
    summarize,
)


def _turn(conv: str, turn: int, worker: str = "w0", prompt: int = 100, cached: int = 0,
          out: tuple[int, ...] = (1, 2, 3), rnd: int = 1, error: str = "") -> Turn:
    return Turn(conv, turn, rnd, prompt, cached, out, "x", worker, error)


def test_cached_share_counts_completed_follow_up_turns_only():
    turns = [_turn("a", 1, prompt=1000, cached=0), _turn("a", 2, prompt=400, cached=300),
             _turn("b", 2, prompt=600, cached=600), _turn("b", 3, error="HTTP 500")]
    assert cached_share(turns) == pytest.approx(900 / 1000)
    assert cached_share([_turn("a", 1, cached=50)]) is None


@pytest.mark.parametrize("a, b, pos", [
    ((1, 2, 3), (1, 2, 3), None),
    ((1, 2, 3), (1, 5, 3), 1),
    ((1, 2), (1, 2, 3), 2),
    ((), (7,), 0),
], ids=["equal", "middle", "shorter", "empty"])
def test_first_difference(a, b, pos):
    assert first_difference(a, b) == pos
    assert first_difference(b, a) == pos


def test_mismatches_name_turn_round_and_position_against_the_reference():
    ref = {("a", 1): _turn("a", 1, out=(1, 2, 3)), ("a", 2): _turn("a", 2, out=(4, 5))}
    turns = [_turn("a", 1, out=(1, 2, 3)), _turn("a", 2, out=(4, 6), rnd=2),
             _turn("a", 3, out=(9,)),  # no reference turn: not compared
             _turn("a", 1, error="timeout", out=())]
    assert mismatches(turns, ref) == [{"conversation": "a", "turn": 2, "round": 2,
                                       "position": 1}]


def test_placement_counts_requests_moves_and_conversations_kept_on_one_worker():
    turns = [_turn("a", 1, "w0"), _turn("a", 2, "w0"), _turn("a", 3, "w1"),
             _turn("b", 2, "w1"), _turn("b", 1, "w1"), _turn("b", 3, "w1"),
             _turn("c", 1, "w0", error="HTTP 503")]
    p = placement(turns)
    assert p["requests"] == {"w0": 2, "w1": 4}
    assert p["paths"] == {"a r1": ["w0", "w0", "w1"], "b r1": ["w1", "w1", "w1"]}
    assert (p["moves"], p["one_worker"]) == (1, 1)


def test_summary_reports_failures_and_the_share_relative_to_the_reference():
    ref = {("a", 1): _turn("a", 1), ("a", 2): _turn("a", 2)}
    turns = [_turn("a", 1), _turn("a", 2, prompt=200, cached=90),
             _turn("b", 1, error="HTTP 500")]
    s = summarize(turns, ref, ref_share=0.6, expected=4)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 2, ["HTTP 500"])
    assert s["mismatches"] == []
    assert s["cached_share"] == pytest.approx(0.45)
    assert s["share_ratio"] == pytest.approx(0.75)
    assert summarize(turns, None, None, 3)["mismatches"] is None
