"""Round Attention's benchmark without a server: one byte budget for every row, the recall
questions' positions, the summary's ratios and its table."""

from __future__ import annotations

import pytest

from sgl_spec.bench import rounds


@pytest.mark.parametrize("share", [0.2, 0.3, 1.0])
def test_round_mode_gets_the_same_device_bytes_as_exact(share):
    full, upper = rounds.tier_sizes(10_000, watershed=12, layers=30, share=share)
    assert abs(full * 12 + upper * 18 - 10_000 * 30) <= 30  # token-layers: bytes / token-layer
    assert upper == max(1, int(share * full))
    if share == 1.0:
        assert full == 10_000


def test_recall_questions_ask_an_early_a_middle_and_a_recent_round(hf_tok):
    convs = rounds.recall_set(hf_tok, 3, (20, 24), (40, 60), seed=1)
    assert len(convs) == 3
    for conv, asks in convs:
        assert 20 <= conv.rounds <= 24 and [p for p, _, _ in asks] == list(rounds.POSITIONS)
        k = conv.rounds
        asked = {p: next(i + 1 for i, f in enumerate(conv.facts) if f.value == gold
                         and f.key in msgs[-1]["content"]) for p, msgs, gold in asks}
        assert asked["early"] <= k // 5 and 2 * k // 5 < asked["middle"] <= 3 * k // 5
        assert asked["recent"] >= k - 1
        for _, msgs, _ in asks:  # the whole history, then the question
            assert msgs[: 2 * k + 1] == list(conv.messages[:-1])


def _capacity(running, tok_s, nbytes, share):
    probe = {"bytes": nbytes, "kept_share": share}
    return {"conversations": 8, "peak_running": running, "retracted": 0, "history_cached": running, "output_tok_s": tok_s,
            "bytes_per_conversation": nbytes, "kept_share": share, "probe": probe}


def test_the_capacity_summary_compares_with_exact_and_equation_2():
    played = {"exact": [_capacity(5, 10.0, 1000, None)],
              "round-topk": [_capacity(8, 14.0, 500, 0.2)]}
    s = rounds.summarize("capacity", played, layers=30, watershed=12)
    r = s["round-topk"]
    assert r["running_vs_exact"] == 8 / 5 and r["tok_s_vs_exact"] == 1.4
    assert r["eq2_share"] == pytest.approx(0.4 + 0.2 * 0.6)
    assert r["bytes_vs_exact"] == 0.5 and r["bytes_vs_eq2"] == pytest.approx(0.5 / 0.52)
    md = rounds.markdown({"workload": "capacity", "summary": s, "meta": {"git": "x"},
                          "config": {"model": "m", "watershed": 12, "layers": 30,
                                     "budget_tokens": 100, "conversations": 8,
                                     "rounds_per_conversation": 20, "upper_share": 0.3}})
    assert "| round-topk | 8 / 8 | 0 | 8 |" in md and "0.520" in md


def test_answers_decoding_at_once_are_counted_on_the_clients_clock():
    from sgl_spec.bench.round_play import Reply, peak_overlap

    def r(a, b):
        return Reply("", 0.1, 1.0, 2, 0, 10, a, b)

    assert peak_overlap([r(0, 2), r(1, 3), r(2.5, 4), r(5, 6)]) == 2
    assert peak_overlap([r(0, 10), r(1, 3), r(2, 4)]) == 3
    assert peak_overlap([Reply("", None, None, 0, 0, 10)]) == 0


def test_side_by_side_questions_rotate_the_rows():
    rows = ["stock", "exact", "round-topk"]
    orders = [rounds.turn_order(rows, j) for j in range(6)]
    assert all(sorted(o) == sorted(rows) for o in orders)
    assert [o[0] for o in orders] == rows * 2  # each row first as often as the others
