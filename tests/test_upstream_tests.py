"""The upstream-test runner's verdict: which sgl_spec failures count against it."""

from __future__ import annotations

from sgl_spec.integration import upstream_tests as up

ROW = "test_radix_cache_unit.TestRadixCache::test_all_values_flatten"


def test_failure_shared_with_the_compiled_core_is_inherited_not_sgl_spec_only():
    # spec-lru runs sglang's compiled core: failing there as stock-rust does is stock's.
    results = {ROW: {"stock-python": "passed", "stock-rust": "failed",
                     "spec-lru": "failed", "tagged-lru": "passed"}}
    assert up.unexplained(results) == []
    assert up.inherited(results) == [(ROW, "spec-lru")]


def test_tagged_failure_where_stock_python_passes_is_sgl_spec_only():
    results = {ROW: {"stock-python": "passed", "stock-rust": "failed",
                     "tagged-lru": "passed", "tagged-turn": "error"}}
    assert up.unexplained(results) == [(ROW, "tagged-turn")]


def test_failure_on_the_baseline_counts_for_nobody():
    results = {ROW: {"stock-python": "failed", "tagged-turn": "failed"}}
    assert up.unexplained(results) == [] and up.inherited(results) == []


def test_table_totals_count_each_outcome():
    results = {"a": {"stock-python": "passed", "tagged-turn": "failed"},
               "b": {"stock-python": "passed", "tagged-turn": "skipped"}}
    last = up.table(results, ["stock-python", "tagged-turn"]).splitlines()[-1]
    assert last == "| **pass/fail/error/skip** | 2/0/0/0 | 0/1/0/1 |"
