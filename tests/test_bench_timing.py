"""The timing helper every benchmark uses (``sgl_spec.bench.timing``), on a fake clock;
the markdown cells every report uses (``sgl_spec.bench.render``)."""

from __future__ import annotations

import pytest

from sgl_spec.bench import cli, render, timing


def test_median_s_warms_up_then_takes_the_median(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # three timed calls: 1, 3 and 2 s
    monkeypatch.setattr(timing, "clock", lambda: next(clock))
    calls = []
    assert timing.median_s(lambda: calls.append(1), repeats=3, warmup=2) == 2.0
    assert len(calls) == 5  # 2 untimed + 3 timed
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        timing.median_s(lambda: None, repeats=0)
    # sync runs after every call, warm-ups included, inside the timed span
    clock = iter([0.0, 4.0])
    order = []
    assert timing.median_s(lambda: order.append("call"), repeats=1, warmup=1,
                           sync=lambda: order.append("sync")) == 4.0
    assert order == ["call", "sync", "call", "sync"]


def test_timed_and_stopwatch(monkeypatch):
    clock = iter([5.0, 7.5, 100.0, 100.25])
    monkeypatch.setattr(timing, "clock", lambda: next(clock))
    assert timing.timed(lambda: "value") == ("value", 2.5)
    watch = timing.Stopwatch()
    assert watch.elapsed() == 0.25


def test_spreads_skip_missing_values():
    assert timing.spread([3.0, None, 1.0, 2.0]) == timing.Spread(1.0, 2.0, 3.0)
    assert timing.spread([None]) is None
    assert timing.median([None, 4.0, 2.0]) == 3.0 and timing.median([]) is None
    # per start: 4/2, 9/3 (6/0 and None/1 have no ratio)
    assert timing.ratio_spread([4.0, 9.0, 6.0, None], [2.0, 3.0, 0.0, 1.0]) == (2.0, 2.5, 3.0)


def test_interleaved_runs_every_key_once_per_round():
    order = []
    got = timing.interleaved(["a", "b"], 3, lambda k, i: order.append((k, i)) or f"{k}{i}")
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert got == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved(["a"], 0, lambda k, i: None)


def test_render_cells_and_table():
    assert render.num(0.3571, 1e3, 1) == "357.1" and render.num(None) == "n/a"
    assert render.ratio(0.10204) == "0.102x" and render.ratio(1.0) == "1x"
    assert render.spread_cell(timing.Spread(1.9, 2.1, 2.4)) == "1.90 / 2.10 / 2.40"
    assert render.spread_cell(None) == "n/a"
    assert render.table(["row", "tok/s"], [["stock", "3.67"]]) == [
        "| row | tok/s |", "|---|---|", "| stock | 3.67 |"]


def test_cli_common_flags_and_results(tmp_path):
    ap = cli.parser("prog", "What it does.\n\nMore.")
    cli.add_common(ap, out_required=False, out_default="results/x", quick="small",
                   repeats=cli.REPEATS_HELP, repeats_default=3, rounds=cli.ROUNDS_HELP,
                   threads="torch threads")
    assert ap.description == "What it does."
    args = ap.parse_args(["--rounds", "2"])
    assert (args.out, args.quick, args.repeats, args.rounds, args.threads,
            args.model_path) == ("results/x", False, 3, 2, 0, None)
    paths = cli.write_results(str(tmp_path / "o"), {"a": 1}, "# table\n")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["results.json", "results.md"]
    assert (tmp_path / "o" / "results.md").read_text() == "# table\n"
