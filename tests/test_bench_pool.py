"""Pooling exact match over harness runs of several seeds (sgl_spec.bench.pool)."""
import json

import pytest

from sgl_spec.bench import pool


def _turn(conv, turn, position, em):
    return {"conversation": conv, "turn": turn, "position": position, "source": "this_turn",
            "exact_match": em, "prediction": f"answer {conv} {turn}"}


def _row(name, turns, agreement=None):
    by = {}
    for p in ("begin", "middle", "end"):
        ts = [t for t in turns if t["position"] == p]
        by[p] = {"n": len(ts), "exact_match": sum(t["exact_match"] for t in ts) / len(ts)}
    row = {"name": name, "turns": turns, "accuracy": {"by_position": by}}
    if agreement is not None:
        row["agreement"] = {"chat": {"turns": agreement}}
    return row


def _run(seed, ref_em, row_em, agreement):
    """One run: conversations c0..c2 of one turn at begin / middle / end."""
    pos = ("begin", "middle", "end")
    ref = _row("exact", [_turn(f"qa-{seed}-{i}", 0, pos[i], e) for i, e in enumerate(ref_em)])
    row = _row("sparse", [_turn(f"qa-{seed}-{i}", 0, pos[i], e) for i, e in enumerate(row_em)],
               agreement)
    return {"reference": "exact", "configs": [ref, row],
            "checks": {"within_points": {"sparse": 40}},
            "dataset": {"config": {"seed": seed}}, "meta": {"dataset_preset": "long-turns"}}


def _agree(seed, i, same_prompt=True, near_tie=None, margin=0.1):
    div = None if near_tie is None else {"near_tie": near_tie, "reference_margin": margin}
    return {"conversation": f"qa-{seed}-{i}", "turn": 1, "same_prompt": same_prompt,
            "divergence": div}


def test_pool_sums_questions_and_classifies_every_changed_answer():
    # seed 0: sparse loses begin at a near tie; seed 1: loses middle after its own history
    # changed, and wins end at a real difference
    r0 = _run(0, [1, 1, 0], [0, 1, 0], [_agree(0, 0, near_tie=True, margin=0.14)])
    r1 = _run(1, [1, 1, 0], [1, 0, 1], [_agree(1, 1, same_prompt=False, near_tie=True),
                                         _agree(1, 2, near_tie=False, margin=2.0)])
    out = pool.pool([("s0", r0), ("s1", r1)])
    assert out["questions_per_position"] == {"begin": 2, "middle": 2, "end": 2}
    assert out["seeds"] == [0, 1]
    r = out["rows"]["sparse"]
    assert {p: v["gap_points"] for p, v in r["by_position"].items()} == {
        "begin": -50.0, "middle": -50.0, "end": 50.0}
    assert r["by_position"]["begin"]["exact_match"] == 0.5
    assert [x["gap_points"] for x in r["runs"]] == [
        {"begin": -100.0, "middle": 0.0, "end": 0.0}, {"begin": 0.0, "middle": -100.0, "end": 100.0}]
    assert r["change_counts"] == {"lost_near_tie": 1, "lost_history": 1, "won_other": 1}
    assert [(c["conversation"], c["turn"], c["change"], c["how"]) for c in r["changes"]] == [
        ("qa-0-0", 1, "lost", "near_tie"), ("qa-1-1", 1, "lost", "history"),
        ("qa-1-2", 1, "won", "other")]
    assert r["changes"][0]["reference_margin"] == 0.14
    assert r["within_points"] == 40 and r["pass"] is False  # -50 at begin
    md = pool.markdown(out)
    assert "one question is 50.0 points" in md and "within 40: FAIL" in md
    assert "| sparse | 0.500 (-50.0) | 0.500 (-50.0) | 0.500 (+50.0) |" in md


def test_pool_refuses_runs_that_cannot_be_pooled():
    r0 = _run(0, [1, 1, 0], [1, 1, 0], [])
    with pytest.raises(ValueError, match="same dataset"):
        pool.pool([("a", r0), ("b", r0)])
    other = dict(_run(1, [1, 1, 0], [1, 1, 0], []), reference="stock")
    with pytest.raises(ValueError, match="reference row 'stock'"):
        pool.pool([("a", r0), ("b", other)])
    assert pool.pool([("a", r0)])["rows"]["sparse"]["pass"] is True
    missing = _run(1, [1, 1, 0], [1, 1, 0], [])
    missing["configs"] = missing["configs"][:1]
    assert pool.pool([("a", r0), ("b", missing)])["rows"]["sparse"] == {"missing_in": ["b"]}


def test_pool_cli_writes_json_and_table(tmp_path, capsys):
    dirs = []
    for seed, row_em in ((0, [0, 1, 0]), (1, [1, 1, 0])):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        agree = [_agree(seed, 0, near_tie=True)] if seed == 0 else []
        (d / "results.json").write_text(json.dumps(_run(seed, [1, 1, 0], row_em, agree)))
        dirs.append(str(d))
    assert pool.main([*dirs, "--out", str(tmp_path / "p")]) == 0
    out = json.loads((tmp_path / "p" / "pool.json").read_text())
    assert out["runs"] == ["s0", "s1"] and out["rows"]["sparse"]["by_position"]["begin"][
        "gap_points"] == -50.0
    assert (tmp_path / "p" / "pool.md").read_text() in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        pool.main([str(tmp_path / "nope"), "--out", str(tmp_path / "p")])
    assert exc.value.code == 2
