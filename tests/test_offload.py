"""SpeContext's Algorithms 1-2 (``sgl_spec.tiers.offload``) against a hand-worked case,
and Equation 7 at every threshold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_spec.tiers.offload import Shape, host_layers, on_host, thresholds

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
