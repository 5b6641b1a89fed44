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
