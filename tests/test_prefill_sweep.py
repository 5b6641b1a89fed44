"""prefill_sweep's pure parts: the /metrics counters, ratios, rows, rounds and tables."""

from __future__ import annotations

import pytest

from sgl_spec.bench import prefill_sweep as sweep


def test_prefill_sweep_ratios_markdown_and_metrics_parsing():
    text = ('# HELP x\nsgl_spec:sparse_prefill_extends_total{path="sparse"} 3.0\n'
            'sgl_spec:sparse_prefill_extends_total{path="exact"} 2.0\n'
            'sgl_spec:decode_steps_total{path="sparse"} 9.0\n')
    assert sweep.parse_extends(text) == {"sparse": 3.0, "exact": 2.0}
    pts = lambda a, b, sp: {"1024": {"ttft_median_s": a, "extends": {"sparse": 0}},  # noqa: E731
                            "4096": {"ttft_median_s": b, "extends": {"sparse": sp}}}
    configs = [{"name": sweep.STOCK, "points": pts(2.0, 8.0, 0)},
               {"name": sweep.REFERENCE, "points": pts(1.0, 4.0, 0)},
               {"name": "loopserve-prefill a=0.955", "points": pts(1.0, 2.0, 3)}]
    r = sweep.ratios(configs, sweep.REFERENCE)
    assert r == {sweep.STOCK: {"1024": 2.0, "4096": 2.0},
                 "loopserve-prefill a=0.955": {"1024": 1.0, "4096": 0.5}}
    assert sweep.ratios(configs, "missing") == {}
    res = {"configs": configs, "plan": {"lengths": [1024, 4096]},
           "ratios": {b: sweep.ratios(configs, b) for b in sweep.BASELINES}}
    assert res["ratios"][sweep.STOCK]["loopserve-prefill a=0.955"] == {"1024": 0.5, "4096": 0.25}
    assert res["ratios"][sweep.REFERENCE]["loopserve-prefill a=0.955"]["4096"] == 0.5
    md = sweep.markdown(res)
    assert "| loopserve-prefill a=0.955 | 1.000 | 2.000* |" in md
    assert "## TTFT ratio vs stock" in md and "## TTFT ratio vs sgl_spec exact" in md
    assert "| loopserve-prefill a=0.955 | 0.50 | 0.25 |" in md  # vs stock
    assert "| loopserve-prefill a=0.955 | 1.00 | 0.50 |" in md  # vs sgl_spec exact
    assert "a fresh prompt" in md
    md = sweep.markdown({"configs": configs, "ratios": {},
                         "plan": {"lengths": [1024, 4096], "history": 2048}})
    assert "a new turn over 2048 cached tokens" in md
    assert sweep.SweepPlan.preset(quick=True).lengths == (1024, 4096)
    assert sweep.SweepPlan.preset(False, history=512).history == 512
    with pytest.raises(ValueError, match="repeats"):
        sweep.SweepPlan(repeats=0)
    with pytest.raises(ValueError, match="history"):
        sweep.SweepPlan(history=-1)


def test_prefill_sweep_rows_and_rounds():
    rows = sweep.select_rows(["loopserve-prefill-a-0.98"])
    assert [c.name for c in rows] == [sweep.STOCK, sweep.REFERENCE, "loopserve-prefill a=0.98"]
    assert sweep.select_rows(None) == sweep.CONFIGS
    with pytest.raises(ValueError, match="valid choices: .*loopserve-prefill-a-0.97"):
        sweep.select_rows(["a=0.98"])
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        sweep.SweepPlan(rounds=0)

    def run(ttfts, sparse):
        reqs = [{"ttft_s": t, "cached_tokens": 1024} for t in ttfts]
        return {"name": "x", "peak_rss_bytes": 5, "log": "l", "points": {"1024": {
            "tokens": 1024, "ttft_median_s": sorted(ttfts)[1], "cached_tokens_max": 1024,
            "extends": {"sparse": sparse}, "requests": reqs}}}

    pooled = sweep.pool_rounds([run([1.0, 2.0, 3.0], 1), run([4.0, 5.0, 6.0], 2)])
    p = pooled["points"]["1024"]
    assert p["ttft_median_s"] == 3.5 and p["round_medians_s"] == [2.0, 5.0]
    assert p["extends"] == {"sparse": 3.0} and len(p["requests"]) == 6
    named = lambda name, *starts: [{**r, "name": name} for r in starts]  # noqa: E731
    runs = {sweep.STOCK: named(sweep.STOCK, run([2.0, 2.0, 2.0], 0), run([4.0, 4.0, 4.0], 0)),
            sweep.REFERENCE: named(sweep.REFERENCE, run([1.0, 1.0, 1.0], 0),
                                   run([2.0, 2.0, 2.0], 0)),
            "loopserve-prefill a=0.98": named("loopserve-prefill a=0.98",
                                              run([1.0, 2.0, 3.0], 1), run([4.0, 5.0, 6.0], 2))}
    res = sweep.results({}, sweep.SweepPlan(lengths=(1024,), rounds=2), runs)
    assert res["configs"][2]["points"]["1024"]["ttft_median_s"] == 3.5
    spreads = res["round_ratios"][sweep.REFERENCE]
    assert spreads["loopserve-prefill a=0.98"] == {"1024": (2.0, 2.25, 2.5)}
    assert res["round_ratios"][sweep.STOCK]["loopserve-prefill a=0.98"] == {
        "1024": (1.0, 1.125, 1.25)}
    md = sweep.markdown(res)
    assert "| loopserve-prefill a=0.98 | 2.00 / 2.25 / 2.50 |" in md  # 2/1, 5/2
    assert "| loopserve-prefill a=0.98 | 1.00 / 1.12 / 1.25 |" in md  # 2/2, 5/4
