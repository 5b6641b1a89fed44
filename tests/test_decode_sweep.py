"""decode_sweep's pure parts: plan validation from the CLI, ratios, the per-start spreads
and the report tables."""

from __future__ import annotations

import pytest

from sgl_spec.bench import decode_sweep as ds
from sgl_spec.bench import sweep


def _point(h, b, tok_s, late):
    return {"history": h, "batch": b, "tok_s_median": tok_s, "late_tok_s_median": late,
            "decode_steps": None}


def _res():
    configs = [
        {"name": "stock", "points": {"7168x1": _point(7168, 1, 4.0, 4.0)}},
        {"name": "sgl_spec exact", "points": {"7168x1": _point(7168, 1, 3.5, 3.6)}},
        {"name": ds.LOOPSERVE, "points": {"7168x1": _point(7168, 1, 12.0, 16.0)}},
    ]
    return {"meta": {"started": "now", "model": "m", "duration_s": 60,
                     "load_average_before": [0], "load_average_after": [0]},
            "plan": {"new_tokens": 256, "repeats": 2}, "configs": configs,
            "ratios": ds.ratios(configs), "late_ratios": ds.ratios(configs, "late_tok_s_median")}


def test_ratios_over_all_tokens_and_after_the_first_selection():
    res = _res()
    assert res["ratios"][f"{ds.LOOPSERVE} / stock"]["7168x1"] == pytest.approx(3.0)
    assert res["late_ratios"][f"{ds.LOOPSERVE} / stock"]["7168x1"] == pytest.approx(4.0)
    md = ds.markdown(res)
    assert "| 7168 | 1 | 4.00 | 3.50 | 12.00 | 3.000 |" in md
    assert "After loopserve's first reselection" in md and "| 4.000 |" in md


def test_bad_plan_values_are_clean_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        ds.main(["--out", "/tmp/x", "--histories", "8"])
    assert exc.value.code == 2 and "histories must be >= 16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ds.main(["--out", "/tmp/x", "--new-tokens", "1"])
    assert exc.value.code == 2 and "new_tokens must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ds.main(["--out", "/tmp/x", "--histories", "1024", "--batches", "1", "--new-tokens",
                 "8", "--model-path", "/nonexistent"])
    assert exc.value.code == 2 and "is not a directory" in capsys.readouterr().err


def test_rows_pick_a_subset_with_the_exact_reference(capsys):
    rows = sweep.select_rows(ds.CONFIGS, ["loopserve-prefill-a-0.97"], ds.KEEP)
    assert [c.name for c in rows] == [ds.EXACT, ds.PREFILL]
    with pytest.raises(SystemExit) as exc:
        ds.main(["--out", "/tmp/x", "--rows", "prefill"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "valid choices" in err and "loopserve-prefill-a-0.97" in err
    configs = [{"name": ds.EXACT, "points": {"4096x1": _point(4096, 1, 5.0, 5.0)}},
               {"name": ds.PREFILL, "points": {"4096x1": _point(4096, 1, 4.0, 4.0)}}]
    assert ds.ratios(configs) == {f"{ds.PREFILL} / {ds.EXACT}": {"4096x1": 0.8}}


def test_server_starts_pool_their_repeats():
    def run(rates):
        rounds = [{"requests": [{"ttft_s": 1.0}], "aggregate_tok_s": r,
                   "aggregate_late_tok_s": r} for r in rates]
        return {"name": "x", "log": "l", "peak_rss_bytes": 1, "points": {"4096x1": {
            "history": 4096, "batch": 1, "tok_s_median": sorted(rates)[1],
            "decode_steps": {"sparse": 0.0, "exact": 3.0},
            "passes": {"exact": [0.24, 3.0]}, "rounds": rounds}}}

    pooled = ds.pool_starts([run([1.0, 2.0, 3.0]), run([5.0, 6.0, 7.0])])
    p = pooled["points"]["4096x1"]
    assert p["tok_s_median"] == 4.0 and p["start_tok_s_medians"] == [2.0, 6.0]
    assert p["decode_steps"] == {"sparse": 0.0, "exact": 6.0} and len(p["rounds"]) == 6
    assert p["passes"] == {"exact": [pytest.approx(0.48), 6.0]}
    assert p["pass_ms"] == {"exact": pytest.approx(80.0)}
    ref = ds.pool_starts([run([1.0, 1.0, 1.0]), run([2.0, 2.0, 2.0])])
    configs = [{**ref, "name": ds.EXACT}, {**pooled, "name": ds.PREFILL}]
    res = {**_res(), "configs": configs, "ratios": ds.ratios(configs), "late_ratios": None,
           "start_ratios": {ds.EXACT: sweep.start_ratios(configs, ds.EXACT,
                                                         "start_tok_s_medians")}}
    # per start: 2.0 / 1.0 and 6.0 / 2.0 -> min / median / max
    md = ds.markdown(res)
    assert "| 4096 | 1 | 2.00 / 2.50 / 3.00 |" in md
    assert "## Decode pass time by path" in md
    assert f"| 4096 | 1 | {ds.PREFILL} | 80.0 (6) | - | - | 80.0 | - | - |" in md
    sparse = {**pooled["points"]["4096x1"], "passes": {"exact": [0.8, 10.0],
                                                       "sparse": [0.6, 10.0]}}
    lines = ds.pass_section([{"name": ds.LOOPSERVE, "points": {"4096x1": sparse}}])
    assert f"| 4096 | 1 | {ds.LOOPSERVE} | 80.0 (10) | 60.0 (10) | - | 70.0 | 0.750 | - |" \
        in lines
    assert "Decode pass time" not in ds.markdown(_res())  # no server reported passes
    with pytest.raises(SystemExit):
        ds.main(["--out", "/tmp/x", "--rounds", "0"])


def _start(name: str, rates: dict[tuple[int, int], float]) -> dict:
    """One server start of one row: per point, three timed rounds around ``rate``."""
    points = {}
    for (h, b), rate in rates.items():
        rounds = [{"requests": [{"ttft_s": 0.5}], "aggregate_tok_s": rate + d,
                   "aggregate_late_tok_s": rate + d} for d in (-0.1, 0.0, 0.1)]
        points[f"{h}x{b}"] = {"history": h, "batch": b, "tok_s_median": rate,
                              "decode_steps": None, "rounds": rounds}
    return {"name": name, "log": "l", "peak_rss_bytes": 1, "points": points}


def test_rounds_show_the_spread_against_stock_and_the_short_history():
    """The acceptance reads: exact >= 2.5x stock at 7k, loopserve B=1024 >= 4x stock at
    7k and >= 0.6x its own 512-history tok/s, each with the spread over server starts."""
    stock = [{(512, 1): 10.0, (7168, 1): 4.0}, {(512, 1): 11.0, (7168, 1): 3.0},
             {(512, 1): 12.0, (7168, 1): 5.0}]
    exact = [{(512, 1): 10.0, (7168, 1): 12.0}, {(512, 1): 11.0, (7168, 1): 9.0},
             {(512, 1): 12.0, (7168, 1): 10.0}]
    loop = [{(512, 1): 20.0, (7168, 1): 16.0}, {(512, 1): 20.0, (7168, 1): 14.0},
            {(512, 1): 20.0, (7168, 1): 20.0}]
    runs = {name: [_start(name, r) for r in starts]
            for name, starts in ((ds.STOCK, stock), (ds.EXACT, exact), (ds.LOOPSERVE, loop))}
    plan = ds.SweepPlan(histories=(512, 7168), batches=(1,), new_tokens=256, repeats=3,
                        starts=3)
    meta = {"started": "now", "model": "m", "duration_s": 60, "load_average_before": [0],
            "load_average_after": [0]}
    res = ds.results(meta, plan, runs)
    vs_stock = res["start_ratios"][ds.STOCK]
    assert vs_stock[ds.EXACT]["7168x1"] == (2.0, 3.0, 3.0)  # 12/4, 9/3, 10/5
    assert vs_stock[ds.LOOPSERVE]["7168x1"] == pytest.approx((4.0, 4.0, 14 / 3))
    assert res["history_ratios"][ds.LOOPSERVE]["7168x1"] == (0.7, 0.8, 1.0)
    assert res["history_ratios"][ds.LOOPSERVE]["512x1"] == (1.0, 1.0, 1.0)
    md = ds.markdown(res)
    assert "## Per server start: tok/s / `stock`" in md
    assert "| history | batch | sgl_spec exact | loopserve B=1024 |" in md
    assert "| 7168 | 1 | 2.00 / 3.00 / 3.00 | 4.00 / 4.00 / 4.67 |" in md
    assert "| 512 | 1 | 1.00 / 1.00 / 1.00 | 1.67 / 1.82 / 2.00 |" in md
    assert "## Per server start: tok/s / the same row at the shortest history" in md
    # stock 4/10, 3/11, 5/12; exact 12/10, 9/11, 10/12; loopserve 16/20, 14/20, 20/20
    assert "| 7168 | 1 | 0.27 / 0.40 / 0.42 | 0.82 / 0.83 / 1.20 | 0.70 / 0.80 / 1.00 |" in md
    # pooled medians over all 9 timed rounds of a point
    assert res["configs"][0]["points"]["7168x1"]["tok_s_median"] == 4.0
    assert "| 7168 | 1 | 4.00 | 10.00 | 16.00 | 4.000 | 1.600 | 2.500 |" in md


def test_a_512_token_history_and_the_rows_parse(capsys):
    """The acceptance command's flags are accepted (it stops only at the model path)."""
    with pytest.raises(SystemExit) as exc:
        ds.main(["--out", "/tmp/x", "--rows", "stock", "loopserve-B-1024", "--histories", "512",
                 "7168", "--batches", "1", "--new-tokens", "256", "--repeats", "2",
                 "--rounds", "3", "--model-path", "/nonexistent"])
    assert exc.value.code == 2 and "is not a directory" in capsys.readouterr().err
    rows = sweep.select_rows(ds.CONFIGS, ["stock", "loopserve-B-1024"], ds.KEEP)
    assert [c.name for c in rows] == [ds.STOCK, ds.EXACT, ds.LOOPSERVE]
    assert [c.slug for c in ds.CONFIGS] == ["stock", "sgl_spec-exact", "loopserve-B-1024",
                                          "loopserve-B-1024-seeded",
                                          "loopserve-prefill-a-0.97", "snapkv-B-1024",
                                          "streaming-B-1024", "specontext-B-1024",
                                          "specontext-B-1024-thread"]
