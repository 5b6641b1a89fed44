"""SpeContext's Algorithms 1-2 (``sgl_spec.tiers.offload``) against a hand-worked case,
and Equation 7 at every threshold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_spec.tiers.offload import Placement, Shape, host_layers, on_host, thresholds

# 4 layers, one KV head of dim 1 in fp16: a token's K and V at a layer are 4 bytes (the
# paper's 4HD); 2 requests; weights 100 bytes (130 with the runtime's 30%); 1090 bytes:
# 960 for KV. Budget 5 rows per offloaded layer.
SHAPE = Shape(layers=4, kv_heads=1, head_dim=1, element_bytes=2)


def test_thresholds_by_hand():
    # S_i = (960 - i * 5 * 8) // ((4 - i + 1) * 8), 8 = 2 requests x 4 bytes
    assert thresholds(1090, 100, 2, 5, SHAPE) == [24, 28, 36, 52, 100]
    # Algorithm 2: at 30 tokens S >= S_0 = 24 and S >= S_1 = 28, not S_2 = 36: the last
    # two layers are on the host, the last offloaded first
    limits = thresholds(1090, 100, 2, 5, SHAPE)
    assert on_host(30, limits) == 2 and host_layers(30, limits) == [3, 2]
    assert host_layers(10, limits) == [] and host_layers(24, limits) == [3]
    assert host_layers(10_000, limits) == [3, 2, 1, 0]  # every layer, the head stays


def test_bad_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="do not fit"):
        thresholds(100, 100, 2, 5, SHAPE)
    with pytest.raises(ValueError, match="requests >= 1"):
        thresholds(1090, 100, 0, 5, SHAPE)


def _bytes(shape: Shape, weights: int, requests: int, budget: int, i: int, s: int) -> float:
    """Equation 7: the device bytes with the last i layers offloaded at length s."""
    resident = shape.layers - i + shape.head_layers + shape.alpha
    return 1.3 * weights + requests * shape.row_bytes * (resident * s + i * budget)


@given(layers=st.integers(1, 40), heads=st.integers(1, 8), dim=st.sampled_from([1, 64, 128]),
       requests=st.integers(1, 16), budget=st.integers(0, 2048),
       memory=st.integers(10**6, 10**11), weights=st.integers(0, 10**8))
def test_each_threshold_is_the_longest_length_that_fits(layers, heads, dim, requests, budget,
                                                        memory, weights):
    shape = Shape(layers, heads, dim, 2)
    if memory < 1.3 * weights:
        return
    limits = thresholds(memory, weights, requests, budget, shape)
    for i, s in enumerate(limits):
        if s >= 0:
            assert _bytes(shape, weights, requests, budget, i, s) <= memory
        assert _bytes(shape, weights, requests, budget, i, s + 1) > memory
    # offloading more never leaves fewer layers on the host as the length grows
    lengths = sorted({max(0, s) for s in limits} | {0, 10**9})
    counts = [on_host(n, limits) for n in lengths]
    assert counts == sorted(counts)


# ---- Algorithm 2 on a server's pool: grow, finish, abort, retraction --------------------
def test_placement_by_hand():
    from sgl_spec.tiers.offload import Move, Placement

    # the hand-worked case over a pool: 2 running requests, budget 5 rows each -> the
    # pool's limits for one "request" of 10 buffer rows: (960 - i*10*4) // ((5 - i)*4)
    p = Placement(1090, 100, 5, SHAPE)
    assert p.limits(2) == [48, 57, 73, 105, 200]
    assert p.update(40, 2) == Move([], []) and p.host() == [] and p.device() == [0, 1, 2, 3]
    assert p.update(60, 2) == Move([3, 2], [])  # past S_0 = 48 and S_1 = 57
    assert p.host() == [3, 2] and p.device() == [0, 1]
    assert p.update(30, 1) == Move([], [])  # a request finished: nothing comes back
    assert p.update(0, 0) == Move([], [2, 3]) and p.host() == []  # the pool drained
    with pytest.raises(ValueError, match=">= 0"):
        p.update(-1, 0)


@given(layers=st.integers(1, 12), budget=st.integers(0, 64),
       events=st.lists(st.tuples(st.sampled_from(["grow", "finish", "abort", "retract"]),
                                 st.integers(0, 7), st.integers(1, 400)), max_size=60))
def test_every_layer_is_on_exactly_one_tier_across_grow_finish_abort_retraction(
        layers, budget, events):
    from sgl_spec.tiers.offload import Placement

    shape = Shape(layers, 1, 1, 2)  # 4 bytes a token and layer
    memory = 130 + 4 * (layers + 1) * 300  # 300 tokens fit with every layer resident
    p = Placement(memory, 100, budget, shape)
    reqs: dict[int, int] = {}  # request -> tokens in the pool
    host: set[int] = set()
    for what, rid, n in events:
        if what == "grow":
            reqs[rid] = reqs.get(rid, 0) + n
        else:  # finish, abort and retraction all free the request's tokens
            reqs.pop(rid, None)
        tokens, before = sum(reqs.values()), len(host)
        move = p.update(tokens, len(reqs))
        assert not set(move.offload) & host and set(move.reload) <= host
        host = (host | set(move.offload)) - set(move.reload)
        assert host == set(p.host()) and set(p.device()) | host == set(range(layers))
        assert not set(p.device()) & host
        assert sorted(host) == list(range(layers - len(host), layers))  # the last ones
        if tokens:
            assert len(host) >= before  # nothing comes back while tokens are in use
            target = on_host(tokens, p.limits(len(reqs)))
            assert len(host) >= target  # never fewer on the host than Algorithm 2 asks
            if len(host) == target < layers:  # Equation 7 holds at its placement
                assert _bytes(shape, 100, 1, budget * max(1, len(reqs)), target,
                              tokens) <= memory
        else:
            assert host == set()


def test_placement_reserve_comes_out_of_the_budget():
    """Bytes held whatever the placement (the staging rows) shrink every threshold."""
    p = Placement(1090, 100, 5, SHAPE)
    assert p.limits(2) == thresholds(1090, 100, 1, 10, SHAPE)  # 2 x 5 rows per layer
    assert p.limits(2, reserved=80) == thresholds(1010, 100, 1, 10, SHAPE)
    assert p.limits(2, reserved=10_000) == [0] * 5  # nothing fits: every layer leaves
    assert p.update(1, 2, reserved=10_000).offload == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="reserved"):
        p.update(1, 2, reserved=-1)
