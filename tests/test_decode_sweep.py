"""decode_sweep's pure parts: plan validation from the CLI, ratios and the report tables."""

from __future__ import annotations

import pytest

from sgl_spec.bench import decode_sweep as ds


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
    assert "After loopserve's first selection" in md and "| 4.000 |" in md


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
    rows = ds.configset.select_rows(ds.CONFIGS, ["loopserve-prefill-a-0.97"], ds.EXACT)
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
            "decode_steps": {"sparse": 0.0, "exact": 3.0}, "rounds": rounds}}}

    pooled = ds.pool_starts([run([1.0, 2.0, 3.0]), run([5.0, 6.0, 7.0])])
    p = pooled["points"]["4096x1"]
    assert p["tok_s_median"] == 4.0 and p["start_tok_s_medians"] == [2.0, 6.0]
    assert p["decode_steps"] == {"sparse": 0.0, "exact": 6.0} and len(p["rounds"]) == 6
    ref = ds.pool_starts([run([1.0, 1.0, 1.0]), run([2.0, 2.0, 2.0])])
    configs = [{**ref, "name": ds.EXACT}, {**pooled, "name": ds.PREFILL}]
    res = {**_res(), "configs": configs, "ratios": ds.ratios(configs), "late_ratios": None}
    assert "| 4096 | 1 | 2.00 / 3.00 |" in ds.markdown(res)
    with pytest.raises(SystemExit):
        ds.main(["--out", "/tmp/x", "--rounds", "0"])
