"""Greedy agreement between two rows' outputs (``agreement``) and the speed ratios and
chat summaries (``summary``), on hand-made turn results."""

from __future__ import annotations

import pytest

from sgl_spec.bench import agreement, summary
from sgl_spec.bench.agreement import Agreement
from sgl_spec.bench.chat_client import TurnResult


def _turn(conv="c", turn=1, ttft=1.0, latency=2.0, out=11, ids=(1, 2, 3), top=None,
          cached=0, prompt="p") -> TurnResult:
    top = top if top is not None else tuple(((f"t{i}", -0.1), ("x", -3.0)) for i in ids)
    return TurnResult(conversation=conv, turn=turn, ttft_s=ttft, latency_s=latency,
                      prompt_tokens=100, cached_tokens=cached, output_tokens=out,
                      finish_reason="length", text="", prompt_sha1=prompt,
                      output_ids=tuple(ids), top_logprobs=top)


# --------------------------------------------------------------------------- ratios, speed


@pytest.mark.parametrize(
    ("row", "baseline", "want"),
    [(1.0, 4.0, 0.25), (3.0, 3.0, 1.0), (None, 1.0, None), (1.0, 0.0, None)],
    ids=["faster", "equal", "missing", "zero-baseline"],
)
def test_ratio(row, baseline, want):
    assert summary.ratio(row, baseline) == want


def test_ratios_only_shared_numbers():
    got = summary.ratios({"a": 2.0, "b": "x", "c": 1, "d": None}, {"a": 4.0, "c": 2, "b": "y"})
    assert got == {"a": 0.5, "c": 0.5}


def test_tpot_and_summary():
    turns = [_turn(turn=1, ttft=3.0, latency=4.0, out=11),
             _turn(turn=2, ttft=1.0, latency=3.0, out=21, cached=90),
             _turn(turn=3, ttft=2.0, latency=3.0, out=1, cached=110)]
    assert turns[0].tpot_s == pytest.approx(0.1)
    assert turns[2].tpot_s is None
    s = summary.summarize_turns(turns)
    assert s.ttft_turn1_mean_s == 3.0
    assert s.ttft_later_mean_s == 1.5
    assert s.tpot_median_s == pytest.approx(0.1)
    assert s.output_tok_per_s == pytest.approx(33 / 10)
    assert s.cached_tokens_later_mean == 100
    assert s.cached_tokens_total == 200


# --------------------------------------------------------------------------- divergences


def test_near_tie_threshold_is_two_bf16_ulps():
    """One threshold for the harness and the real-server tests: 0.25 nats, two bf16 steps
    of logits in [16, 32)."""
    assert agreement.NEAR_TIE_NATS == 0.25 == 2 * 2.0 ** (4 - 7)


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [((1, 2, 3), (1, 2, 3), None), ((1, 2, 3), (1, 5, 3), 1), ((1, 2), (1, 2, 3), 2),
     ((), (), None), ((4,), (5,), 0)],
    ids=["equal", "middle", "prefix", "empty", "first"],
)
def test_first_divergence(a, b, want):
    assert agreement.first_divergence(a, b) == want


def test_divergence_margin_and_near_tie():
    ref = _turn(ids=(1, 2, 3), top=((("a", -0.1), ("b", -2.0)), (("c", -0.60), ("d", -0.62)),
                                    (("e", -0.1), ("f", -1.0))))
    tie = _turn(ids=(1, 9, 3), top=((("a", -0.1), ("b", -2.0)), (("d", -0.60), ("c", -0.65)),
                                    (("e", -0.1), ("f", -1.0))))
    d = agreement.divergence(ref, tie)
    assert (d.position, d.reference_token, d.candidate_token) == (1, 2, 9)
    assert d.reference_margin == pytest.approx(0.02)
    assert d.candidate_margin == pytest.approx(0.05)
    assert d.near_tie
    wide = _turn(ids=(7, 2, 3), top=((("z", -0.1), ("a", -2.0)),) * 3)
    d = agreement.divergence(ref, wide)
    assert d.position == 0 and d.reference_margin == pytest.approx(1.9) and not d.near_tie
    assert agreement.divergence(ref, _turn(ids=(1, 2, 3))) is None


@pytest.mark.parametrize("gap, near", [(0.125, True), (0.25, True), (0.3, False)],
                         ids=["one-ulp", "two-ulps", "real"])
def test_near_tie_boundary(gap, near):
    top = ((("a", -0.1), ("b", -0.1 - gap)),)
    d = agreement.divergence(_turn(ids=(1,), top=top), _turn(ids=(2,), top=top))
    assert d.near_tie is near
    assert agreement.divergence(_turn(ids=(1,), top=top), _turn(ids=(2,), top=top),
                                near_tie_nats=0.1).near_tie is (gap <= 0.1)


def test_divergence_at_eos_has_no_margin():
    ref = _turn(ids=(1, 2), top=((("a", -0.1), ("b", -2.0)),))  # EOS has no logprobs
    cand = _turn(ids=(1, 2, 3), top=((("a", -0.1), ("b", -2.0)), (("c", -1.0), ("d", -1.01))))
    d = agreement.divergence(ref, cand)
    assert d.position == 2 and d.reference_token is None and d.reference_margin is None
    assert d.candidate_margin is None and not d.near_tie


def test_compare_and_counts():
    ref = [_turn(turn=1), _turn(turn=2, ids=(1, 2, 4)), _turn(turn=3)]
    cand = [_turn(turn=1), _turn(turn=2, ids=(1, 2, 5), prompt="q"), _turn(turn=3, ids=(8,))]
    rows = agreement.compare_turns(ref, cand)
    assert [r["identical"] for r in rows] == [True, False, False]
    assert [r["same_prompt"] for r in rows] == [True, False, True]
    counts = agreement.counts(rows)
    assert counts == {"turns": 3, "identical": 1, "near_tie_divergences": 0,
                      "other_divergences": 2, "same_prompts": 2, "acceptable": False}
    with pytest.raises(ValueError, match="no result"):
        agreement.compare_turns(ref, cand[:1])
    fig = agreement.figures(ref, cand)
    assert fig["counts"] == counts and fig["turns"] == rows
    assert fig["tokens"] == {"n": 3, "identical": 1, "mean_prefix": (3 + 2 + 0) / 3,
                             "min_prefix": 0, "mean_share": (1 + 2 / 3 + 0) / 3}


# --------------------------------------------------------------------------- token agreement


@pytest.mark.parametrize("reference, candidate, expect", [
    ([1, 2, 3, 4], [1, 2, 3, 4], Agreement(4, 1.0)),
    ([1, 2, 3, 4], [9, 2, 3, 4], Agreement(0, 0.75)),
    ([1, 2, 3, 4], [1, 2, 9, 9], Agreement(2, 0.5)),
    ([1, 2, 3, 4], [1, 2], Agreement(2, 0.5)),
    ([1, 2], [1, 2, 3, 4], Agreement(2, 0.5)),
    ([], [], Agreement(0, 1.0)),
    ([], [5], Agreement(0, 0.0)),
    ([7, 8], [8, 7], Agreement(0, 0.0)),
], ids=["identical", "diverge-at-0", "diverge-at-2", "candidate-shorter",
        "candidate-longer", "both-empty", "reference-empty", "swapped"])
def test_greedy_agreement(reference, candidate, expect):
    got = agreement.greedy_agreement(reference, candidate)
    assert got == expect
    prefix, share = got  # unpacks as the (tokens_before_divergence, matching_share) pair
    assert (prefix, share) == tuple(expect)


def test_agreement_summary():
    got = agreement.agreement_summary([Agreement(4, 1.0), Agreement(0, 0.5),
                                       Agreement(2, 0.75)])
    assert got == {"n": 3, "identical": 1, "mean_prefix": 2.0, "min_prefix": 0,
                   "mean_share": 0.75}
    assert agreement.agreement_summary([])["mean_share"] is None


def test_compare_runs_pairs_rows_and_reports_divergences_with_margins(tmp_path, capsys):
    import json
    from dataclasses import asdict

    def turn(ids, margins, conv="c0", turn_no=1):
        top = tuple((("a", -0.1), ("b", -0.1 - m)) for m in margins)
        return TurnResult(conv, turn_no, 0.1, 0.2, 10, 0, len(ids), "length", "x", "sha",
                          tuple(ids), top)

    def write(d, name, chat, longgen):
        d.mkdir(exist_ok=True)
        (d / f"turns-{name}.json").write_text(json.dumps(
            {"chat": [asdict(t) for t in chat], "longgen": [asdict(t) for t in longgen]}))

    before, after = tmp_path / "before", tmp_path / "after"
    write(before, "exact", [turn([1, 2, 3], [1.0, 0.2, 1.0])], [turn([5, 6], [2.0, 2.0], "lg")])
    write(after, "exact", [turn([1, 9, 3], [1.0, 0.1, 1.0])], [turn([5, 6], [2.0, 2.0], "lg")])
    write(before, "only-before", [turn([1], [1.0])], [])
    rows = agreement.compare_runs(str(before), str(after))
    assert list(rows) == ["exact"]
    chat = rows["exact"]["chat"]["counts"]
    assert (chat["identical"], chat["near_tie_divergences"], chat["other_divergences"]) == (0, 1, 0)
    assert rows["exact"]["longgen"]["counts"]["identical"] == 1
    agreement.main([str(before), str(after), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "| exact | chat | 1 | 1 | 0 | 1 | 0 | 1: 0.100 |" in out
    assert (tmp_path / "out" / "results.json").exists()
    with pytest.raises(SystemExit):
        agreement.main([str(before), str(tmp_path / "nowhere")])
