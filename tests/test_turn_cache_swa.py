"""Sliding-window (FULL + SWA) caches: stock's and sgl_spec's turn-tagged one, side by side.

The tagged core cuts stock's nodes at turn boundaries (soft cuts). sglang's SWA
component steps per node (tombstone an internal node's window KV, refresh and lock
whole nodes up to the window, free a released leaf's window KV); sgl_spec's
(``integration/swa.py``) steps per stock node, so under LRU the window KV freed,
the match lengths and the nodes' values equal stock's.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _turn_cache import ASSISTANT, FMT, IM_END, IM_START, NL, Request, match, turn
from sgl_spec.config import CacheConfig, SpecConfig
from sgl_spec.integration.standalone import EvictParams, InsertParams, build_swa_cache
from sgl_spec.integration.standalone import radix_key as key

WINDOW = 4
POOL = 300


def build(kind: str, size: int = POOL, window: int = WINDOW, eviction: str = "lru"):
    return build_swa_cache(kind, size, window, FMT, SpecConfig(cache=CacheConfig(eviction=eviction)))


def stock_nodes(cache) -> list[tuple]:
    """Every stock node as (its path's tokens, length, Full KV on device, SWA KV on
    device); a tagged tree's soft pieces are joined into the stock node they are,
    asserting the pieces agree on what is on the device."""
    core = cache.tree_core
    out, stack = [], [(c, ()) for c in core.root_node.children.values()]
    while stack:
        node, path = stack.pop()
        unit = [node]
        while len(unit[-1].children) == 1:
            (c,) = unit[-1].children.values()
            if not getattr(c, "spec", None) or not c.spec.soft:
                break
            unit.append(c)
        full = {p.component_data[0].value is not None for p in unit}
        swa = {p.component_data[1].value is not None for p in unit}
        assert len(full) == 1 and len(swa) == 1, ("pieces disagree", [p.id for p in unit])
        tokens = tuple(t for p in unit for t in p.key.token_ids)
        path = path + tokens
        out.append((path, len(tokens), full.pop(), swa.pop()))
        stack.extend((c, path) for c in unit[-1].children.values())
    return sorted(out)


def sizes(cache) -> tuple[int, ...]:
    return (cache.full_evictable_size(), cache.protected_size(), cache.swa_evictable_size(),
            cache.swa_protected_size())


CONV = (turn("system", [20, 21, 22]) + turn("user", [30, 31, 32, 33, 34])
        + turn("assistant", [40, 41, 42, 43]) + turn("user", [50, 51, 52]))


def test_swa_eviction_tombstones_the_whole_stock_node():
    """Issue 18 item 7: stock's SWA walk tombstones its 31-token internal node in one
    step; per piece, the tagged core tombstoned only the 8-token system turn (then
    10, then 9), so SWA tokens evicted per call were 8/10/9 where stock's were 31/4/0,
    and the second call left stock with no device match (0) but sgl_spec with 35."""
    got = []
    for kind in ("stock", "tagged"):
        cache, alloc = build(kind)
        cache.insert(InsertParams(key=key(CONV), value=alloc.alloc(len(CONV))))
        assert len(cache.tree_core.root_node.children) == 1
        steps = []
        for n in (1, 3, 5):
            r = cache.evict(EvictParams(swa_num_tokens=n))
            steps.append((r.num_tokens_evicted, r.swa_num_tokens_evicted, match(cache, CONV)[0],
                          sizes(cache), stock_nodes(cache)))
        got.append(steps)
    stock, tagged = got
    assert [s[:3] for s in stock] == [(0, 31, 35), (4, 4, 0), (0, 0, 0)]
    assert tagged == stock
    cache, _ = build("tagged")  # the tagged tree really is cut: 8 | 10 | 9 | 4 + 4
    cache.insert(InsertParams(key=key(CONV), value=cache.token_to_kv_pool_allocator.alloc(35)))
    node, lens = cache.tree_core.root_node, []
    while node.children:
        (node,) = node.children.values()
        lens.append((len(node.key), node.spec.soft))
    assert lens == [(8, False), (10, True), (9, True), (4, True), (4, False)]


def test_released_window_lock_protects_what_stock_does():
    """Decoding past the window releases the prefix's SWA lock early (``release_swa``):
    the window lock, taken over stock's nodes, leaves the same SWA KV protected."""
    prompt = CONV[:27] + [IM_START, ASSISTANT, NL]
    got = []
    for kind in ("stock", "tagged"):
        cache, alloc = build(kind)
        cache.insert(InsertParams(key=key(prompt), value=alloc.alloc(len(prompt))))
        n, m = match(cache, prompt)
        lock = cache.lock(m.last_device_node)
        held = sizes(cache)
        cache.release_swa(lock)
        released = sizes(cache), stock_nodes(cache)
        cache.unlock(lock)
        got.append((n, held, released, sizes(cache), match(cache, prompt)[0]))
    assert got[0] == got[1]
    assert got[0][0] == len(prompt) and got[0][2][0][3] == 0  # no SWA KV left protected


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 3), st.integers(0, 2),
                  st.integers(1, 12), st.integers(1, 10), st.booleans(), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 40), st.integers(1, 40)),
        st.tuples(st.just("match"), st.integers(0, 3), st.floats(0, 1)),
        st.tuples(st.just("close"),),
    ),
    min_size=4,
    max_size=25,
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=OPS, window=st.sampled_from([4, 16]))
def test_swa_lru_matches_stock_step_by_step(ops, window):
    """Random conversations (branching, held open, their SWA lock released early as
    decode does, evictions by Full and by SWA pressure): every match, evicted count,
    size and stock node (pieces joined) equal stock's after each step."""
    caches = [build("stock", 160, window), build("tagged", 160, window)]
    convs: list[list[int]] = []
    opened: list[list[Request]] = []
    for op in ops:
        if op[0] == "turn":
            _, ci, fork, n_user, n_out, release, keep_open = op
            if ci >= len(convs):
                convs.append(turn("system", [20 + ci % 2, 21]))
                ci = len(convs) - 1
            hist = convs[ci]
            if fork:  # branch off an earlier point of the conversation
                hist = hist[: max(1, len(hist) - 9 * fork)]
                convs.append(hist)
                ci = len(convs) - 1
            prompt = hist + turn("user", [30 + (ci * 7 + i) % 50 for i in range(n_user)])
            prompt += [IM_START, ASSISTANT, NL]
            output = [100 + (len(hist) + i) % 50 for i in range(n_out)] + [IM_END]
            convs[ci] = prompt + output + [NL]
            reqs = [Request(c, a, prompt, output) for c, a in caches]
            results = [r.start() for r in reqs]
            assert results[0] == results[1]
            if results[0] is None:
                continue
            if release:
                for r in reqs:
                    r.cache.release_swa(r.lock)
            if keep_open and len(opened) < 2:
                opened.append(reqs)
            else:
                assert reqs[0].finish() == reqs[1].finish()
        elif op[0] == "evict":
            got = [c.evict(EvictParams(num_tokens=op[1], swa_num_tokens=op[2]))
                   for c, _ in caches]
            assert got[0] == got[1]
        elif op[0] == "match" and convs:
            tokens = convs[op[1] % len(convs)]
            cut = int(len(tokens) * op[2])
            assert match(caches[0][0], tokens[:cut])[0] == match(caches[1][0], tokens[:cut])[0]
        elif op[0] == "close" and opened:
            reqs = opened.pop(0)
            assert reqs[0].finish() == reqs[1].finish()
        assert sizes(caches[0][0]) == sizes(caches[1][0])
        assert stock_nodes(caches[0][0]) == stock_nodes(caches[1][0])
        caches[1][0].tree_core.sanity_check([], [])
    while opened:
        reqs = opened.pop()
        assert reqs[0].finish() == reqs[1].finish()
    assert sizes(caches[0][0]) == sizes(caches[1][0])
    assert caches[1][0].protected_size() == 0


def test_turn_eviction_still_frees_dead_reasoning_first():
    """--spec-cache-eviction turn on a sliding-window tree: Full pressure frees a dead
    reasoning branch whole (11 tokens), SWA pressure tombstones window KV, and the live
    conversation's prompt still matches."""
    from _turn_cache import END_THINK, THINK

    cache, alloc = build("tagged", eviction="turn")
    hist = turn("system", [20, 21])
    for r in range(3):
        prompt = hist + turn("user", [30 + r, 31 + r, 32 + r]) + [IM_START, ASSISTANT, NL]
        answer = [100 + r, 101 + r]
        req = Request(cache, alloc, prompt, [THINK, *range(200, 206), END_THINK, *answer, IM_END])
        assert req.start() is not None
        req.finish()
        hist = prompt + answer + [IM_END, NL]  # the template drops the reasoning
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 11
    assert cache.tree_core.freed_by_rule["dead_reasoning"] == 11
    before = cache.swa_evictable_size()
    swa = cache.evict(EvictParams(swa_num_tokens=8)).swa_num_tokens_evicted
    # One step: the oldest stock node's window KV (18 tokens), Full KV kept.
    assert (before, swa, cache.swa_evictable_size()) == (70, 18, 52)
    assert cache.full_evictable_size() == 70
    cache.tree_core.sanity_check([], [])
    assert match(cache, hist[:-4])[0] == 48
