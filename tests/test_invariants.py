"""The KV-slot ownership check (``sgl_spec.cache.invariants``) on hand-made pools."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.cache.invariants import Owner, slot_violations

N = 16  # slots 1..16


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def clean():
    """Slots 1-4 in the tree, a request sharing 1-2 and owning 5-7, the rest free."""
    req = Owner("r", t(1, 2), t(5, 6, 7))
    return t(*range(8, 17)), t(1, 2, 3, 4), [req]


def test_a_partition_of_the_pool_holds():
    free, tree, owners = clean()
    assert slot_violations(N, free, tree, owners) == []
    assert slot_violations(N, t(*range(1, 17)), t(), []) == []


@pytest.mark.parametrize(
    "free, tree, owners, expected",
    [
        pytest.param(t(3, *range(8, 17)), t(1, 2, 3, 4), None,
                     ["1 free slot(s) still in the radix tree: [3]"], id="free-and-cached"),
        pytest.param(t(6, *range(8, 17)), t(1, 2, 3, 4), None,
                     ["request r: 1 of its own slot(s) are also free: [6]"], id="own-and-free"),
        pytest.param(t(*range(8, 17)), t(1, 2, 3, 4, 5), None,
                     ["request r: 1 of its own slot(s) are also tree: [5]"], id="own-and-cached"),
        pytest.param(t(1, *range(8, 17)), t(2, 3, 4), None,
                     ["request r: 1 slot(s) of its cached prefix are no longer in the radix "
                      "tree: [1]"], id="prefix-freed"),
        pytest.param(t(*range(9, 17)), t(1, 2, 3, 4), None,
                     ["1 slot(s) owned by nobody (leaked): [8]"], id="leak"),
        pytest.param(t(8, 8, *range(9, 17)), t(1, 2, 3, 4), None,
                     ["1 slot(s) twice in the free list: [8]"], id="double-free"),
        pytest.param(t(*range(8, 17)), t(1, 2, 3, 4),
                     [Owner("r", t(1, 2), t(5, 6, 7)), Owner("s", t(), t(7))],
                     ["1 slot(s) owned by two requests: [7]"], id="two-requests"),
    ],
)
def test_each_broken_ownership_is_named(free, tree, owners, expected):
    _, _, default = clean()
    assert slot_violations(N, free, tree, default if owners is None else owners) == expected


def test_a_freed_prefix_that_is_still_cached_names_both_owners():
    # The wrong answer of issue 48's shape: a cached prefix whose slots went back to the
    # allocator while the tree still holds them.
    free, tree, owners = t(1, 2, *range(8, 17)), t(1, 2, 3, 4), [Owner("r", t(), t(5, 6, 7))]
    found = slot_violations(N, free, tree, owners)
    assert found == ["2 free slot(s) still in the radix tree: [1, 2]"]


def test_an_idle_hub_drops_what_no_request_can_read():
    """Offers and seeds of requests that left without a release (aborted in the queue)
    go when the scheduler is idle; live counts then read 0 (the idle invariant)."""
    from sgl_spec.requests import Lines, RequestHub

    hub = RequestHub()
    hub.offer_lines("aborted-in-queue", Lines(8, {}))
    hub.set_seeds("matched-then-aborted", Lines(4, {}))
    assert hub.live()["prefill_lines_offered"] == 1 and hub.live()["prefill_seeds"] == 1
    hub.idle()
    assert not any(hub.live().values()) and len(hub) == 0
