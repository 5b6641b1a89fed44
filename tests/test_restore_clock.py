"""The host-tier restore stage's clock (``sgl_spec.tiers.restore_clock``)."""

from __future__ import annotations

import pytest

from sgl_spec.tiers.restore_clock import FIGURES, RestoreClock, delta


def test_clock_counts_admitted_refused_and_failed_loads_and_their_time():
    clock = RestoreClock()
    before = clock.totals()
    with clock.admitting() as ok:
        ok[0] = True
    with clock.admitting() as ok:
        ok[0] = False
    with pytest.raises(RuntimeError):  # a load-back that raises counts as refused
        with clock.admitting():
            raise RuntimeError("boom")
    with clock.transferring(4096):
        pass
    after = clock.totals()
    stage = delta(after, before)
    assert (stage["loads"], stage["refused"], stage["tokens"]) == (1, 2, 4096)
    assert stage["admit_seconds"] > 0 and stage["transfer_seconds"] > 0
    assert stage["seconds"] == pytest.approx(stage["admit_seconds"] + stage["transfer_seconds"])
    assert set(FIGURES) <= set(after)


def test_delta_is_none_without_a_hierarchical_cache():
    assert delta(None, RestoreClock().totals()) is None
    assert delta(RestoreClock().totals(), None) is None


def test_a_pipelined_restore_counts_the_time_its_two_parts_ran_at_once():
    clock = RestoreClock()
    clock.pipeline(0.4, 0.5, 0.6)   # pre-pass 0.4 s and copy 0.5 s within 0.6 s
    clock.pipeline(0.2, 0.1, 0.35)  # slower than serial (other work between): no overlap
    clock.pipeline(0.3, 0.2, None)  # serial: nothing ran at once
    t = clock.totals()
    assert t["recompute_seconds"] == pytest.approx(0.9)
    assert t["load_seconds"] == pytest.approx(0.8)
    assert t["overlap_seconds"] == pytest.approx(0.3)
