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


def test_the_asked_rounds_selection_is_read_from_the_servers_newest():
    sels = [{"rid": "a", "rounds": [1, 2, 3], "share": [0.5, 0.2, 0.3], "kept": [0, 1, 3]},
            {"rid": "b", "rounds": [1, 2, 3], "share": None, "kept": [0, 1, 2, 3]},
            {"rid": "a", "rounds": [1, 2, 3, 4], "share": [0.1, 0.4, 0.3, 0.2],
             "kept": [0, 2, 4]}]
    got = rounds.asked_selection(sels, "a", 3)  # the newest of a's: 3 ranks 2nd, left out
    assert got["asked_rank"] == 2 and got["asked_share"] == 0.3 and not got["asked_kept"]
    assert got["kept"] == [0, 2, 4] and got["share"] == {1: 0.1, 2: 0.4, 3: 0.3, 4: 0.2}
    assert rounds.asked_selection(sels, "b", 2) == {"kept": [0, 1, 2, 3], "asked_kept": True}
    assert rounds.asked_selection(sels, "c", 1) is None


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


def _recall_run(tmp_path, name, part, answers, kept=None, **cfg):
    """A recall run's results.json; ``kept``: per round row, whether each question's
    selection kept its asked round ("1"/"0"; runs before selections were recorded: none)."""
    import json

    d = tmp_path / name
    d.mkdir()
    config = {"model": "m", "layers": 24, "watershed": 12, "rows": ["exact", "round-topk"],
              "seed": 0, "round_tokens": [300, 420], "conversations": 18,
              "rounds_range": [20, 40], "part": part, **cfg}
    played = {row: [{"answers": [{"position": p, "text": t, "gold": "1", "em": t == "1"}
                                 for p, t in zip(rounds.POSITIONS, answers[row])],
                     "kept_share": None if row == "exact" else 0.2}]
              for row in config["rows"]}
    for row, ks in (kept or {}).items():
        for a, k in zip(played[row][0]["answers"], ks, strict=True):
            a["selection"] = {"kept": [0, 1], "asked_kept": k == "1"}
    (d / "results.json").write_text(json.dumps({"meta": {"git": name}, "workload": "recall",
                                                "config": config, "played": played}))
    return str(d)


def test_recall_parts_pool_into_one_table(tmp_path):
    a = _recall_run(tmp_path, "a", [0, 1], {"exact": "111", "round-topk": "101"})
    b = _recall_run(tmp_path, "b", [1, 2], {"exact": "011", "round-topk": "111"})
    res = rounds.pool_recall([a, b])
    s = res["summary"]
    assert s["exact"]["em"] == {"early": 50.0, "middle": 100.0, "recent": 100.0}
    assert s["round-topk"]["em"] == {"early": 100.0, "middle": 50.0, "recent": 100.0}
    assert s["round-topk"]["em_vs_exact"]["early"] == 50.0
    assert s["round-topk"]["greedy_agreement"] == pytest.approx(4 / 6)
    assert res["config"]["part"] == [0, 1] and s["round-topk"]["n"] == 6
    md = rounds.markdown(res)
    assert "2 of them: 2 question(s) per position" in md
    assert s["round-topk"]["asked_kept"] is None  # runs without the selections recorded
    k = rounds.pool_recall([_recall_run(tmp_path, f"k{i}", [i, i + 1], answers,
                                        kept={"round-topk": ks})
                            for i, (answers, ks) in enumerate([
                                ({"exact": "111", "round-topk": "101"}, "101"),
                                ({"exact": "111", "round-topk": "111"}, "011")])])
    assert k["summary"]["round-topk"]["asked_kept"] == {"early": 50.0, "middle": 50.0,
                                                        "recent": 100.0}
    assert "| 50.0 / 50.0 / 100.0 |" in rounds.markdown(k)
    c = _recall_run(tmp_path, "c", [1, 3], {"exact": "111", "round-topk": "111"})
    with pytest.raises(ValueError, match="another run played"):
        rounds.pool_recall([a, b, c])
    d = _recall_run(tmp_path, "d", [5, 6], {"exact": "111", "round-topk": "111"}, watershed=11)
    with pytest.raises(ValueError, match="watershed"):
        rounds.pool_recall([a, d])


def test_pooled_share_weights_parts_by_the_tokens_they_saw():
    assert rounds.pooled_share([{"kept_share": 0.1, "tokens_seen": 300},
                                {"kept_share": 0.3, "tokens_seen": 100}]) == pytest.approx(0.15)
    # runs that did not record tokens_seen: the plain mean
    assert rounds.pooled_share([{"kept_share": 0.1}, {"kept_share": 0.3, "tokens_seen": 100}]
                               ) == pytest.approx(0.2)
    assert rounds.pooled_share([{"kept_share": None}, {"kept_share": 0.3}]) is None


def test_a_part_outside_the_preset_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        rounds.main(["--workload", "speed", "--part", "0", "2", "--out", "/tmp/x"])
    assert e.value.code == 2 and "--part A B needs --workload recall" in capsys.readouterr().err


def test_losses_are_the_questions_a_round_row_missed_and_exact_answered(tmp_path, capsys):
    from sgl_spec.bench import round_why

    run = _recall_run(tmp_path, "a", [4, 6], {"exact": "110", "round-topk": "100"})
    # conversation 4 of the preset plays first: its middle question is the one lost
    assert round_why.losses(run) == [{"conv": 4, "position": "middle",
                                      "rows": {"round-topk": "0"}}]
    wrong = round_why.losses(run, "wrong")  # the recent one: both rows wrong
    assert [(q["conv"], q["position"]) for q in wrong] == [(4, "middle"), (4, "recent")]
    assert len(round_why.losses(run, "all")) == 3
    with pytest.raises(SystemExit) as e:  # the run's L_w is 12: its questions are not these
        round_why.main(["--losses", run, "--watershed", "8"])
    assert e.value.code == 2 and "watershed 12 (here 8)" in capsys.readouterr().err
    q = {"rows": {"round-topk": "4821", "round-fixed": "1111", "round-adaptive": "9"},
         "kept": {"topk": True, "fixed": False, "adaptive": True},
         "picked": {"topk": [3, 7], "fixed": [7], "adaptive": [7]},
         "value_round": {"4821": 3, "1111": 5}}
    assert round_why.verdict(q) == {"round-topk": "misread: round 3's value (kept)",
                                    "round-fixed": "selection miss (round 5's value)",
                                    "round-adaptive": "misread: no round's value"}


def test_the_selection_is_replayed_on_the_recall_presets_questions(model_path, tmp_path,
                                                                   capsys):
    import json

    from sgl_spec.bench import round_why

    round_why.main(["--quick", "--ask", "0:recent", "--watershed", "4",
                    "--model-path", model_path, "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    for q in res["questions"]:
        assert q["rounds"] >= 20 and q["picked"]["topk"][-1] == q["rounds"]  # recent kept
        assert q["kept"]["topk"] == (q["asked_round"] in q["picked"]["topk"])
        assert 1 <= q["asked_rank"] <= q["rounds"] and 0 < q["asked_share"] < 1
        assert sum(t["share"] for t in q["top"]) <= 1 + 1e-6
    assert "| 0 | recent |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        round_why.main(["--quick", "--ask", "0:late", "--watershed", "8"])
    assert e.value.code == 2 and "early, middle, recent" in capsys.readouterr().err
