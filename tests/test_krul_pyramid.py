"""The recompute/load pyramid never leaves a layer's hidden state or a row missing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_spec.krul.pyramid import (RestoreCost, choose_share, missing, pyramid,
                                   restore_lengths, times)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), L=st.integers(1, 40), share=st.floats(0, 1),
       prefix=st.integers(0, 5000), data=st.data())
def test_no_hidden_state_or_row_is_missing(n, L, share, prefix, data):
    prefix = min(prefix, n)
    # a path whose nodes were compressed at different shares: per-layer max of pyramids
    others = data.draw(st.lists(st.floats(0, 1), max_size=3))
    unstored = [max(us) for us in zip(*(pyramid(n, L, s) for s in [share, *others]))]
    R = restore_lengths(unstored, prefix, n)
    assert all(a >= b for a, b in zip(R, R[1:]))              # Eq. 4: non-increasing
    assert missing(R, unstored, prefix, n) == []


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5, 0.8, 1.0])
def test_pyramid_shape_and_volume(share):
    n, L = 4096, 30
    U = pyramid(n, L, share)
    assert all(a >= b for a, b in zip(U, U[1:])) and 0 <= U[-1] and U[0] <= n
    assert sum(U) == pytest.approx(share * n * L, rel=0.01, abs=n)
    if 0 < share <= 0.5:
        assert U[0] == pytest.approx(2 * share * n, rel=0.05)    # a linear pyramid


def test_missing_reports_each_kind_of_gap():
    assert missing([10, 20], [10, 20], 0, 30) == [(1, 10)]      # hidden state missing
    assert missing([10, 5], [10, 8], 0, 30) == [(1, 5)]         # unstored rows not recomputed
    assert missing([10, 8], [10, 8], 8, 30) == []               # ... unless on the device
    assert missing([10, 5], [10, 5], 8, 30) == [(1, 5)]         # R below the device prefix


def test_choose_share_balances_the_two_pipelines():
    n, w = 4096, [1.0] * 24
    # loading is free: recompute nothing (HiCache's host tier on this machine)
    assert choose_share(RestoreCost(recompute_s=1e-3 / 24, load_s=0.0), n, w) == 0.0
    # loading a row costs as much as recomputing it: about half of each, and both
    # pipelines end together
    cost = RestoreCost(recompute_s=1e-5, load_s=1e-5)
    s = choose_share(cost, n, w)
    assert 0.4 <= s <= 0.6
    tc, tl = times(cost, n, pyramid(n, 24, s), w)
    assert abs(tc - tl) / max(tc, tl) < 0.1
    with pytest.raises(ValueError, match="recompute_s > 0"):
        RestoreCost(0.0, 1.0)
