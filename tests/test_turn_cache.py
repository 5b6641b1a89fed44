"""The turn-aware radix cache, driven without a server.

Property-based: random multi-turn workloads (shared system prompts, branching
conversations, reasoning spans, evictions under a small pool, requests held open
across others) run through stock sglang's UnifiedRadixCache (its default Rust
tree core and its Python one), sgl_spec's cache with default flags (the compiled
core) and its turn-tagged core, side by side. Under LRU, every match length and
evicted-token count must be identical, the turn invariants must hold after every
operation, and the summary the compiled core derives on demand must equal the
tagged core's.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _turn_cache import (
    ASSISTANT, END_THINK, FMT, IM_END, IM_START, NL, THINK, Request, build, evict,
    match, turn,
)
from _turn_cache import write_back as policy
from sgl_spec.cache.segment import segment
from sgl_spec.integration.tree_core import is_closed

POOL = 420


def render(history: list[tuple[str, list[int], list[int] | None]]) -> list[int]:
    """The chat template: earlier assistant turns lose their reasoning."""
    out = turn("system", [20 + history[0][1][0], 21]) if history else []
    for role, content, _reasoning in history[1:]:
        out += turn(role, content)
    return out


def check_turn_invariants(cache) -> None:
    """No node spans two turns; tags equal a fresh segmentation of every leaf path;
    device sizes sum to the cache's evictable + protected sizes."""
    core = cache.tree_core
    core.sanity_check([], [])
    total = 0
    stack = [(core.root_node, [])]
    while stack:
        node, path = stack.pop()
        if node is not core.root_node:
            path = path + [node]
            total += 0 if node.evicted else len(node.key)  # host-only: not on the device
        if not node.children and path:
            tokens = [t for n in path for t in n.key.token_ids]
            spans = segment(tokens, FMT)
            pos = 0
            for n in path:
                end = pos + len(n.key)
                inside = [s for s in spans if s.start < end and s.end > pos]
                assert len(inside) == 1, f"node {n.id} [{pos},{end}) spans {inside}"
                s = inside[0]
                partial = tuple(tokens[s.start:end])
                if s.tag.role is None and s.end == len(tokens) and any(
                    p[: len(partial)] == partial and len(p) > len(partial)
                    for _, p in FMT.openers
                ):
                    # The path ends inside an opener (its continuation was evicted):
                    # the node keeps the role of the turn it was cut from.
                    role = n.spec.tag.role
                    assert FMT.opener_len(role) and dict(FMT.openers)[role][
                        : len(partial)] == partial
                    bump = 1 if role == "user" else 0
                    assert n.spec.tag == s.tag._replace(role=role, round=s.tag.round + bump)
                else:
                    assert n.spec.tag == s.tag, (n.id, n.spec.tag, s.tag)
                assert is_closed(n) == (s.closed_at is not None and end >= s.closed_at)
                pos = end
        stack.extend((c, path) for c in node.children.values())
    assert total == cache.evictable_size() + cache.protected_size()


def branch_view(summary: dict) -> list:
    """A summary's branches without access times or node ids, in a stable order."""
    out = []
    for b in summary["branches"]:
        rounds = [(r["round"], r["tokens"], r["device_tokens"],
                   [(t["role"], t["tokens"], t["reasoning_tokens"]) for t in r["turns"]])
                  for r in b["rounds"]]
        out.append((b["tokens"], b["exclusive_tokens"], rounds))
    return sorted(out)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("turn"), st.integers(0, 5), st.integers(0, 3),
                  st.integers(1, 40), st.integers(1, 30), st.booleans(), st.booleans()),
        st.tuples(st.just("evict"), st.integers(1, 200)),
        st.tuples(st.just("match"), st.integers(0, 5), st.floats(0, 1)),
        st.tuples(st.just("close"),),
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=OPS)
def test_lru_matches_stock_step_by_step(ops):
    _play(ops, write_back=False)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=OPS)
def test_write_back_matches_stock_step_by_step(ops):
    """HiCache's write-back policy: a victim is backed up, then demoted. sgl_spec's
    turn pieces of one stock node leave the device in the same step as stock's node
    (issue 18: only the lowest piece did, 6 tokens evicted where stock evicted 21)."""
    _play(ops, write_back=True)


def test_write_back_demotes_the_whole_node_as_stock_does():
    prompt = turn("system", [20, 21]) + turn("user", [30, 31, 32]) + [IM_START, ASSISTANT, NL]
    full = prompt + [100, 101, 102]
    got = []
    for cache, alloc in (build("stock", 200, tree_core="python"), build("tagged", 200)):
        policy(cache)
        req = Request(cache, alloc, prompt, [100, 101, 102])
        req.start()
        req.finish()
        got.append((evict(cache, 1), match(cache, full)[0]))
    assert got[0] == got[1] == (len(full), 0)


def _play(ops, write_back: bool) -> None:
    post_cut = build("tagged", POOL)
    post_cut[0].tree_core.precuts = False  # cut after the insert (the SWA/paged path)
    caches = [build("stock", POOL), build("stock", POOL, tree_core="python"),
              build("tagged", POOL), post_cut, build("spec", POOL)]
    if write_back:
        for cache, _ in caches:
            policy(cache)
    convs: list[list] = []
    opened: list[list[Request]] = []
    for op in ops:
        if op[0] == "turn":
            _, ci, fork, n_user, n_out, reasoning, keep_open = op
            if ci >= len(convs):
                convs.append([("system", [ci % 2], None)])  # two shared system prompts
                ci = len(convs) - 1
            hist = convs[ci]
            if fork and len(hist) > 2 * fork:  # branch off an earlier round
                hist = hist[: len(hist) - 2 * fork]
                convs.append(hist)
            user = [30 + (ci * 7 + i) % 60 for i in range(n_user)]
            prompt = render(hist + [("user", user, None)]) + [IM_START, ASSISTANT, NL]
            answer = [100 + (len(hist) + i) % 50 for i in range(n_out)]
            think = [200 + i % 30 for i in range(n_out)] if reasoning else None
            output = ([THINK, *think, END_THINK] if think else []) + answer + [IM_END]
            hist.extend([("user", user, None), ("assistant", answer, think)])
            reqs = [Request(c, a, prompt, output) for c, a in caches]
            results = [r.start() for r in reqs]
            assert len(set(results)) == 1, results
            if results[0] is None:
                continue
            if keep_open and len(opened) < 2:
                opened.append(reqs)
            else:
                assert len({r.finish() for r in reqs}) == 1
        elif op[0] == "evict":
            got = [evict(c, op[1]) for c, _ in caches]
            assert len(set(got)) == 1, got
        elif op[0] == "match" and convs:
            hist = convs[op[1] % len(convs)]
            tokens = render(hist)
            cut = int(len(tokens) * op[2])
            got = [match(c, tokens[:cut])[0] for c, _ in caches]
            assert len(set(got)) == 1, got
        elif op[0] == "close" and opened:
            assert len({r.finish() for r in opened.pop(0)}) == 1
        sizes = [(c.evictable_size(), c.protected_size()) for c, _ in caches]
        assert len(set(sizes)) == 1, sizes
        check_turn_invariants(caches[2][0])
        check_turn_invariants(caches[3][0])
        tagged, compiled = caches[2][0].summary(), caches[4][0].summary()
        assert compiled["tree_core"] == "compiled" and tagged["tree_core"] == "tagged"
        if write_back:  # the compiled core's view walks device slots only
            assert compiled["totals"]["by_tier"]["device"] == tagged["totals"]["by_tier"]["device"]
            continue
        assert compiled["totals"]["by_role"] == tagged["totals"]["by_role"]
        assert compiled["totals"]["by_tier"] == tagged["totals"]["by_tier"]
        if tagged["num_branches"] <= 64:  # all branches listed
            assert branch_view(compiled) == branch_view(tagged)
    while opened:
        assert len({r.finish() for r in opened.pop()}) == 1
    for cache, _ in caches:
        assert cache.protected_size() == 0  # lock counts balanced
    for cache, _ in caches[2:4]:
        stack = list(cache.tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            assert node.component_data[0].lock_ref == 0
            stack.extend(node.children.values())


# ---- turn-aware eviction ------------------------------------------------------


def _chat(cache, alloc, sys_id: int, rounds: int, think: bool, base: int):
    """Play ``rounds`` rounds of one conversation; each answer carries a reasoning
    span the template drops from the next prompt (a dead branch per round)."""
    hist = [("system", [sys_id], None)]
    dead = 0
    for r in range(rounds):
        user = [base + r, base + r + 1, base + r + 2]
        prompt = render(hist + [("user", user, None)]) + [IM_START, ASSISTANT, NL]
        answer = [base + 40 + r, base + 41 + r]
        reasoning = [base + 80 + i for i in range(6)] if think else None
        output = ([THINK, *reasoning, END_THINK] if think else []) + answer + [IM_END]
        req = Request(cache, alloc, prompt, output)
        assert req.start() is not None
        req.finish()
        hist += [("user", user, None), ("assistant", answer, reasoning)]
        if think:
            dead += 8 + 3  # [THINK, 6 reasoning tokens, END_THINK] + answer + IM_END
    return hist, dead


def test_turn_eviction_frees_dead_reasoning_first():
    cache, alloc = build("spec", 2000, eviction="turn")
    _chat(cache, alloc, 0, rounds=1, think=False, base=300)  # an older, idle chat
    _, dead = _chat(cache, alloc, 1, rounds=4, think=True, base=20)
    s = cache.summary()
    # Rounds 1-3 were re-rendered without their reasoning; round 4's will be.
    assert sum(1 for b in s["branches"] if b["dead_reasoning"]) == 4
    freed = evict(cache, 1)
    assert freed == 11  # one whole dead branch, not the idle chat
    assert cache.tree_core.freed_by_rule["dead_reasoning"] == 11
    freed = evict(cache, dead - 11)
    assert cache.tree_core.freed_by_rule == {
        "dead_reasoning": dead, "inactive_conversation": 0, "lru": 0}
    # Next: the least recently active conversation (the idle one), not the live one.
    before = cache.summary()["totals"]["by_tier"]["device"]
    evict(cache, 1)
    after = cache.summary()
    assert after["freed_tokens_by_rule"]["inactive_conversation"] == before - after[
        "totals"]["by_tier"]["device"]
    live = max(after["branches"], key=lambda b: b["tokens"])
    assert [r["round"] for r in live["rounds"]] == [0, 1, 2, 3, 4]


def test_turn_eviction_never_evicts_locked_nodes():
    cache, alloc = build("spec", 2000, eviction="turn")
    hist, _ = _chat(cache, alloc, 0, rounds=2, think=True, base=20)
    tokens = render(hist)
    matched, m = match(cache, tokens)
    lock = cache.lock(m.last_device_node)
    protected = cache.protected_size()
    assert protected == matched > 0
    evict(cache, 10_000)
    assert match(cache, tokens)[0] == matched  # the locked path survived
    assert cache.evictable_size() == 0
    cache.unlock(lock)
    assert cache.protected_size() == 0
    evict(cache, 10_000)
    assert cache.evictable_size() == 0 and match(cache, tokens)[0] == 0


def test_turn_eviction_keeps_sglangs_priority_first():
    """--radix-eviction-policy priority: the low-priority request is evicted first, as
    stock does, although under turn eviction it is the more recent conversation."""
    from sgl_spec.integration.standalone import InsertParams, radix_key

    kept = []
    for kind, eviction in (("stock", "lru"), ("spec", "turn")):
        cache, alloc = build(kind, 200, tree_core="python" if kind == "stock" else None,
                             eviction=eviction, policy="priority")
        high = turn("system", [20, 21]) + turn("user", [30, 31, 32])
        low = turn("system", [22, 23]) + turn("user", [40, 41, 42])
        for tokens, priority in ((high, 10), (low, 0)):  # the low one is newer
            cache.insert(InsertParams(key=radix_key(tokens), value=alloc.alloc(len(tokens)),
                                      priority=priority))
        evict(cache, 2)
        kept.append((match(cache, high)[0], match(cache, low)[0]))
    # (turn eviction frees a turn at a time, stock a whole node: only what goes differs)
    assert all(h == len(high) and lo < len(low) for h, lo in kept), kept


@pytest.mark.parametrize("kind", ["tagged", "spec"])
def test_lru_policy_counts_everything_as_lru(kind):
    cache, alloc = build(kind, 2000)
    _chat(cache, alloc, 0, rounds=3, think=True, base=20)
    total = cache.evictable_size()
    assert evict(cache, 10_000) == total
    freed = cache.summary()["freed_tokens_by_rule"]
    assert freed["lru"] == total and sum(freed.values()) == total


def test_cache_eviction_flag_rejects_unknown_policies(capsys):
    from sgl_spec.config import CacheConfig
    from sgl_spec.launch_server import split_argv

    with pytest.raises(ValueError, match="--spec-cache-eviction 'fifo'.*lru, turn"):
        CacheConfig(eviction="fifo")
    with pytest.raises(SystemExit) as exc:
        split_argv(["--spec-cache-eviction", "fifo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--spec-cache-eviction" in err and "'lru'" in err and "'turn'" in err
    cfg, rest = split_argv(["--spec-cache-eviction", "turn", "--tp-size", "1"])
    assert cfg.cache.eviction == "turn" and rest == ["--tp-size", "1"]
    assert cfg.tagged_cache  # turn eviction reads tags: the tagged core


def test_the_tagged_core_says_it_ignores_sglangs_tree_core_env(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    with caplog.at_level("WARNING"):
        cache, _ = build("tagged", 64)
    assert cache.summary()["tree_core"] == "tagged"
    assert "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python is ignored" in caplog.text


def test_a_checkpoint_keeps_only_dense_kv_under_drop():
    """--spec-sparse-kv-cache: with no mark source (keep, or exact mode) a finished
    request's checkpoint keeps all it is given; under drop it stops where the request's
    sparse steps began writing KV, never below what the tree already holds."""
    from types import SimpleNamespace

    from sgl_spec.integration.radix import SpecRadixCache

    req = SimpleNamespace(rid="a", kv=SimpleNamespace(cache_protected_len=100))
    end = SpecRadixCache.dense_kv_end
    assert end(req, 180, None) == 180                # keep: the answer's KV too
    marks = {"a": 140}                               # prompt 124 + LoopServe's 16 exact steps
    assert end(req, 180, marks.get) == 140 and end(req, 130, marks.get) == 130
    marks["a"] = 90
    assert end(req, 180, marks.get) == 100           # the tree's own prefix stays
    del marks["a"]
    assert end(req, 180, marks.get) == 180           # a request that decoded exactly
