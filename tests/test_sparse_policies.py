"""Selection policies (sgl_spec.sparse): registry, config, scoring, selections, the
slot table and state lifetime. Each policy is driven the way the decoder drives it:
``step`` per request, then per layer ``observe`` / ``reselect`` / ``selection`` on
batched rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _sparse import decode_step
from sgl_spec.config import DecodeConfig
from sgl_spec.kernels.sparse_decode import DecodeSubsets, sparse_decode
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference
from sgl_spec.sparse import (
    AttnShape,
    Kind,
    RowStep,
    SelectionPolicy,
    SlotTable,
    available_policies,
    get_policy,
    register_policy,
    Scratch,
    score_history,
    select_topk,
)
from sgl_spec.sparse.scoring import look_ahead
from sgl_spec.sparse import policy as policy_mod
from sgl_spec.sparse.slots import BufferSpec

SHAPE = AttnShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)
CFG = DecodeConfig(budget=8, sink=2, window=4, nd=16, first_select_step=16, min_context=32)
SEEDED = dataclasses.replace(CFG, mode="loopserve", prompt_seed=True)
POLICIES = ("streaming", "snapkv", "loopserve", "specontext")


def unit_dirs(seed: int) -> torch.Tensor:  # [Hkv, D] one unit direction per KV head
    d = torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(seed))
    return d / d.norm(dim=-1, keepdim=True)


def noise_keys(n: int, seed: int) -> torch.Tensor:  # [n, Hkv, D], small
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(n, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)


def aligned_query(dirs: torch.Tensor, seed: int, strength: float = 4.0) -> torch.Tensor:
    """[Hq, D]: every query head of KV head h points along dirs[h], plus noise."""
    g = torch.Generator().manual_seed(seed)
    group = SHAPE.num_q_heads // SHAPE.num_kv_heads
    q = strength * dirs.repeat_interleave(group, 0)
    return q + 0.1 * torch.randn(q.shape, generator=g)


def assert_valid_selection(sel: torch.Tensor, row: RowStep, seq_len: int, cfg=CFG) -> None:
    assert sel.dtype == torch.int64 and sel.shape[0] == SHAPE.num_kv_heads
    assert sel.shape[1] == cfg.budget
    for r in sel.tolist():
        assert len(set(r)) == len(r), "duplicates"
        assert r == sorted(r)
        assert all(min(cfg.sink, seq_len) <= p < row.recent_start for p in r)
    assert 0 <= row.recent_start < seq_len


# ------------------------------------------------------------------ registry


def test_registry_lists_builtin_policies():
    from sgl_spec.config import MODES

    assert available_policies() == POLICIES
    assert MODES == ("exact", *POLICIES)  # the flag's choices: exact is no policy
    for name in POLICIES:
        pol = get_policy(name, CFG, SHAPE)
        assert isinstance(pol, SelectionPolicy) and pol.name == name
        assert pol.live_states == 0


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="'h2o' is unknown; valid: streaming, snapkv, loopserve"):
        get_policy("h2o", CFG, SHAPE)


def test_register_rejects_duplicates_and_accepts_new(monkeypatch):
    monkeypatch.setattr(policy_mod, "_REGISTRY", dict(policy_mod._REGISTRY))
    with pytest.raises(ValueError, match="'loopserve' is already registered"):
        register_policy("loopserve", lambda c, s, d: None)

    class Custom(SelectionPolicy):
        name = "custom"

        def _on_step(self, st):
            return RowStep(Kind.EXACT)

    register_policy("custom", Custom)
    assert "custom" in available_policies()
    assert isinstance(get_policy("custom", CFG, SHAPE), Custom)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "field, value, flag, lo",
    [
        ("budget", 0, "--spec-budget", 1),
        ("sink", -1, "--spec-sink", 0),
        ("window", 0, "--spec-window", 1),
        ("nd", 0, "--spec-nd", 1),
        ("min_context", -5, "--spec-min-context", 0),
        ("first_select_step", -1, "first_select_step", 0),
        ("budget", 1.5, "--spec-budget", 1),
        ("nd", True, "--spec-nd", 1),
    ],
    ids=lambda v: str(v),
)
def test_config_validation_names_flag_and_range(field, value, flag, lo):
    with pytest.raises(ValueError) as err:
        DecodeConfig(**{field: value})
    assert str(err.value) == f"{flag} {value!r} is invalid; valid range: integers >= {lo}"


def test_config_defaults_and_frozen():
    p = DecodeConfig()
    assert (p.mode, p.budget, p.sink, p.window, p.nd, p.first_select_step, p.min_context) == (
        "exact", 1024, 4, 64, 16, 16, 2048,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 5


@pytest.mark.parametrize(
    "seq_len, exact",
    [(31, True), (32, True), (8 + 2 + 4, True), (33, False), (1000, False)],
    ids=["below-min", "covered-by-budget", "tiny", "just-sparse", "long"],
)
def test_use_exact(seq_len, exact):
    p = dataclasses.replace(CFG, min_context=20, budget=26)  # 26 + 2 + 4 = 32
    assert p.use_exact(seq_len) is exact


# ------------------------------------------------------------------ scoring


def naive_scores(q, k, scale, q_pos=None):
    """Per query, per query head: softmax over the (causal) history; sum per KV head."""
    n, hq, _ = q.shape
    big_n, hkv, _ = k.shape
    g = hq // hkv
    out = torch.zeros(hkv, big_n, dtype=torch.float64)
    for i in range(n):
        visible = big_n if q_pos is None else int(q_pos[i]) + 1
        for head in range(hq):
            h = head // g
            logits = (k[:visible, h].double() @ q[i, head].double()) * scale
            out[h, :visible] += torch.softmax(logits, dim=0)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full-history", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)], ids=["mha", "gqa3", "gqa3-9heads"])
def test_score_history_equals_naive_softmax(heads, causal):
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, hq, 8, generator=g)
    k = torch.randn(40, hkv, 8, generator=g)
    q_pos = torch.tensor([20, 31, 35, 38, 39]) if causal else None
    got = score_history(q[None], k[None], 8**-0.5, None if q_pos is None else q_pos[None])[0]
    assert got.shape == (hkv, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_scores(q, k, 8**-0.5, q_pos), rtol=1e-5, atol=1e-6)
    # Each query head contributes total mass 1.
    torch.testing.assert_close(got.sum(), torch.tensor(5.0 * hq))


def test_score_history_batches_ragged_rows_and_unused_queries():
    """Rows of different histories (padded keys) and ring entries not yet filled
    (position -1): each row scores as if alone, unused queries add nothing."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k = torch.randn(2, 50, 2, 8, generator=g)
    q_pos = torch.tensor([[20, 25, 29, -1], [40, 45, 48, 49]])
    lens = torch.tensor([30, 50])
    k[0, 30:] = float("nan")  # padding is never read into a score
    got = score_history(q, k, 8**-0.5, q_pos, lens)
    assert got.shape == (2, 2, 50) and not torch.isnan(got).any()
    want0 = naive_scores(q[0, :3], k[0, :30], 8**-0.5, q_pos[0, :3])
    torch.testing.assert_close(got[0, :, :30].double(), want0, rtol=1e-5, atol=1e-6)
    assert (got[0, :, 30:] == 0).all()
    want1 = naive_scores(q[1], k[1], 8**-0.5, q_pos[1])
    torch.testing.assert_close(got[1].double(), want1, rtol=1e-5, atol=1e-6)


def test_score_history_reuses_one_scratch_across_shapes():
    """LoopServe and SnapKV score every layer into the same buffers (``Scratch``): a call
    after a larger or a smaller one scores as a fresh call does, and the buffers grow to
    the largest call and stay."""
    g = torch.Generator().manual_seed(5)
    scratch = Scratch()
    calls = [(2, 60, 4), (1, 30, 3), (3, 90, 2), (1, 30, 3)]  # rows, keys, queries
    for rows, n_keys, n_q in calls:
        q = torch.randn(rows, n_q, 6, 8, generator=g)
        k = torch.randn(rows, n_keys, 2, 8, generator=g).bfloat16()
        q_pos = torch.arange(n_keys - n_q, n_keys).expand(rows, -1)
        got = score_history(q, k, 8**-0.5, q_pos, scratch=scratch)
        torch.testing.assert_close(got, score_history(q, k, 8**-0.5, q_pos))
    assert scratch.nbytes == 3 * 2 * 90 * 8 * 4 + 3 * 2 * 2 * 3 * 90 * 4  # keys + probs


def test_score_history_bf16_keys_close_to_fp32():
    # 16-bit keys (a 16-bit matmul on a GPU, fp32 on a CPU): scores stay within 2% of fp32,
    # and the top positions are the same.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(16, 9, 64, generator=g)
    k = torch.randn(2000, 3, 64, generator=g)
    u = q.reshape(16, 3, 3, 64).mean((0, 2))  # [Hkv, D] the group's mean query
    k[[100, 700, 1500]] = 12 * u / u.norm(dim=-1, keepdim=True)  # planted keys
    q_pos = torch.arange(1984, 2000)[None]
    ref = score_history(q[None], k[None], 64**-0.5, q_pos)[0]
    got = score_history(q[None].bfloat16(), k[None].bfloat16(), 64**-0.5, q_pos)[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.mean().item())
    assert got.topk(3).indices.sort().values.tolist() == [[100, 700, 1500]] * 3


def test_select_topk_excludes_sink_and_window_per_row():
    scores = torch.arange(20.0).repeat(2, 2, 1)  # highest at the end: inside the window
    sel = select_topk(scores, 5, lo=torch.tensor([2, 0]), hi=torch.tensor([15, 8]))
    assert sel.tolist() == [[[10, 11, 12, 13, 14]] * 2, [[3, 4, 5, 6, 7]] * 2]
    with pytest.raises(ValueError, match="needs >= 5 candidates"):
        select_topk(scores, 5, lo=torch.tensor([2, 2]), hi=torch.tensor([6, 15]))


# ------------------------------------------------------------------ slot table


def test_slot_table_reuses_slots_and_grows_keeping_rows():
    t = SlotTable(2, {"x": BufferSpec((3,), torch.int64, -1)}, capacity=2)
    a, b = t.acquire("a"), t.acquire("b")
    assert (a, b) == (0, 1) and len(t) == 2
    t.write("x", 1, torch.tensor([a, b]), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    c = t.acquire("c")  # full: doubles, rows kept
    assert t.capacity == 4 and c == 2
    assert t.rows("x", 1, torch.tensor([b, a])).tolist() == [[4, 5, 6], [1, 2, 3]]
    assert t.rows("x", 0, torch.tensor([c])).tolist() == [[-1, -1, -1]]
    assert t.release("a") and not t.release("a")
    assert t.acquire("d") == a  # freed slots are reused
    with pytest.raises(ValueError, match="already holds slot"):
        t.acquire("d")


def test_slot_table_grows_by_at_most_grow_bytes_and_cuts_trailing_free_slots(monkeypatch):
    from sgl_spec.sparse import slots as slots_mod

    spec = {"k": BufferSpec((4, 8), torch.float32), "sel": BufferSpec((4,), torch.int64, -1, 1)}
    t = SlotTable(3, spec, capacity=4)
    assert t.slot_bytes == 3 * 4 * 8 * 4 + 4 * 8  # k in 3 layers, sel in one
    monkeypatch.setattr(slots_mod, "GROW_BYTES", 3 * t.slot_bytes)  # 3 slots a step
    rids = [f"r{i}" for i in range(11)]
    for i, rid in enumerate(rids):
        assert t.acquire(rid) == i
        t.write("k", 2, torch.tensor([i]), torch.full((1, 4, 8), float(i)))
    assert t.capacity == 13  # 4 -> 7 -> 10 -> 13, not 4 -> 8 -> 16
    for rid in rids[5:]:
        t.release(rid)  # 5 live of 13: trailing slots cut to the live ones + one step
    assert t.capacity == 8 and len(t) == 5
    assert t.rows("k", 2, torch.arange(5))[:, 0, 0].tolist() == [0, 1, 2, 3, 4]  # kept
    assert [t.acquire(r) for r in ("x", "y", "z")] == [5, 6, 7]  # lowest free first
    assert t.acquire("w") == 8 and t.capacity == 11
    for rid in [*rids[:5], "x", "y", "z", "w"]:
        t.release(rid)
    assert t.capacity == 4 and len(t) == 0  # never below the initial capacity


def test_slot_table_with_small_rows_doubles_and_never_shrinks():
    t = SlotTable(2, {"x": BufferSpec((3,), torch.int64, -1)}, capacity=2)
    for i in range(5):
        t.acquire(str(i))
    assert t.capacity == 8
    for i in range(5):
        t.release(str(i))
    assert t.capacity == 8


# ------------------------------------------------------------------ streaming


def test_streaming_is_sink_plus_recent_window():
    pol = get_policy("streaming", CFG, SHAPE)
    pol.start("short", 10)
    assert pol.step("short", 11).kind == Kind.EXACT
    pol.start("long", 100)
    for seq_len in (101, 102):
        row = pol.step("long", seq_len)
        assert row == RowStep(Kind.SPARSE, seq_len - CFG.window)
        assert pol.width == 0
        assert pol.selection(1, torch.tensor([0])).shape == (1, SHAPE.num_kv_heads, 0)
    pol.release("short"), pol.release("long")
    assert pol.live_states == 0


# ------------------------------------------------------------------ snapkv


@pytest.mark.parametrize("pool_kind", ["avg", "max", "none"])
def test_snapkv_selects_planted_key_outside_sink_and_window(pool_kind):
    from sgl_spec.sparse.snapkv import SnapKVPolicy

    n, w = 120, CFG.window
    dirs = unit_dirs(1)
    pol = SnapKVPolicy(CFG, SHAPE, pool_kind=pool_kind)
    pol.start("r", n)
    k = noise_keys(n, 2)
    planted = 57
    k[planted] = 3.0 * dirs
    k[0] = 3.0 * dirs  # in the sink: attended anyway, never selected
    k[n - 2] = 3.0 * dirs  # in the window: likewise
    q_obs = torch.stack([aligned_query(dirs, s) for s in range(w)])  # [w, Hq, D]
    for layer in range(SHAPE.num_layers):
        pol.prefill_layer("r", layer, q_obs, k)
    row, sels = decode_step(pol, "r", n + 1, lambda layer: q_obs[-1], None)
    assert row == RowStep(Kind.SPARSE, n - w) and len(sels) == SHAPE.num_layers
    for sel in sels:
        assert_valid_selection(sel, row, n + 1)
        assert (sel == planted).any(dim=1).all(), sel
    # The selection stays fixed while the window grows with generated tokens.
    row2, again = decode_step(pol, "r", n + 2, lambda layer: q_obs[-1], None)
    assert row2.recent_start == row.recent_start and torch.equal(again[0], sels[0])
    pol.release("r")
    assert pol.live_states == 0


def test_snapkv_short_prompt_is_exact_and_unscored_prompts_fail_loudly():
    pol = get_policy("snapkv", CFG, SHAPE)
    pol.start("r", 20)
    pol.prefill_layer("r", 0, torch.zeros(4, 6, 16), torch.zeros(20, 2, 16))
    assert pol.step("r", 21).kind == Kind.EXACT
    pol.start("long", 100)  # never scored: decoding it would attend garbage
    with pytest.raises(RuntimeError, match="scored 0 of 2 layers"):
        pol.step("long", 101)


# ------------------------------------------------------------------ loopserve


def run_loopserve(pol, rid, prompt_len, steps, keys_of, q_of):
    """Drive ``steps`` decode steps; returns [(step, RowStep, [selection per layer])]."""
    log = []
    pol.start(rid, prompt_len)
    for s in range(steps):
        seq_len = prompt_len + 1 + s
        row, sels = decode_step(pol, rid, seq_len, lambda layer: q_of(s, layer),
                                lambda layer: keys_of(seq_len, layer))
        log.append((s, row, sels))
    return log


def test_loopserve_reselects_at_16_32_48():
    pol = get_policy("loopserve", CFG, SHAPE)
    keys = noise_keys(200, 3)
    log = run_loopserve(
        pol, "r", 100, 60,
        keys_of=lambda n, layer: keys[:n],
        q_of=lambda s, layer: aligned_query(unit_dirs(s), s),
    )
    assert [s for s, row, _ in log if row.reselect] == [16, 32, 48]
    for s, row, sels in log:
        seq_len = 100 + 1 + s
        if s < 16:
            assert row.kind == Kind.OBSERVE and row.observe == s % CFG.nd and not sels
            continue
        last_sel = 16 + (s - 16) // 16 * 16
        assert row.kind == Kind.SPARSE and row.recent_start == 100 + 1 + last_sel - CFG.window
        for sel in sels:
            assert_valid_selection(sel, row, seq_len)
    assert pol.release("r") and pol.live_states == 0


def test_loopserve_selects_planted_keys_per_layer():
    pol = get_policy("loopserve", CFG, SHAPE)
    dirs = unit_dirs(7)
    keys = [noise_keys(300, 10 + layer) for layer in range(SHAPE.num_layers)]
    planted = [40, 81]  # one per layer
    for layer, p in enumerate(planted):
        keys[layer][p] = 3.0 * dirs
    log = run_loopserve(
        pol, "r", 200, 17,
        keys_of=lambda n, layer: keys[layer][:n],
        q_of=lambda s, layer: aligned_query(dirs, 100 * layer + s),
    )
    _, row, sels = log[16]
    assert row.reselect
    for layer, p in enumerate(planted):
        other = planted[1 - layer]
        assert (sels[layer] == p).any(dim=1).all()
        assert not (sels[layer] == other).any()
    pol.release("r")


def test_loopserve_lookahead_keeps_what_follows_an_attended_key():
    """--spec-lookahead W: the positions after a key the ring attends are selected with
    it (what the answer reads next), where LoopServe's own score keeps the key alone."""
    dirs = unit_dirs(7)
    keys = noise_keys(300, 11)
    keys[90] = 4.0 * dirs
    got = {}
    for width in (0, 6):
        cfg = dataclasses.replace(CFG, mode="loopserve", lookahead=width)
        pol = get_policy("loopserve", cfg, SHAPE)
        log = run_loopserve(pol, "r", 200, 17, keys_of=lambda n, layer: keys[:n],
                            q_of=lambda s, layer: aligned_query(dirs, s, strength=6.0))
        sel = log[16][2][0]  # [Hkv, B] at the first selection, layer 0
        assert_valid_selection(sel, log[16][1], 217)
        got[width] = [bool((sel == p).any(dim=1).all()) for p in range(90, 97)]
        pol.release("r")
    assert got[0][0] and not all(got[0][1:])
    assert all(got[6])


def test_loopserve_selection_sees_the_current_query():
    """Only the query of the selecting step points at the planted key."""
    pol = get_policy("loopserve", CFG, SHAPE)
    dirs = unit_dirs(5)
    keys = noise_keys(300, 6)
    keys[123] = 4.0 * dirs
    g = torch.Generator().manual_seed(0)
    log = run_loopserve(
        pol, "r", 200, 17,
        keys_of=lambda n, layer: keys[:n],
        q_of=lambda s, layer: aligned_query(dirs, s, strength=6.0) if s == 16
        else 0.1 * torch.randn(SHAPE.num_q_heads, SHAPE.head_dim, generator=g),
    )
    assert (log[16][2][0] == 123).any(dim=1).all()
    pol.release("r")


def test_loopserve_reused_slot_ignores_the_previous_owners_ring():
    """A request whose ring is not full yet at its first selection (nd > steps taken)
    scores with its own queries only, not stale ones a released request left."""
    cfg = dataclasses.replace(CFG, nd=32, first_select_step=16)
    pol = get_policy("loopserve", cfg, SHAPE)
    dirs = unit_dirs(9)
    keys = noise_keys(300, 11)
    keys[77] = 4.0 * dirs
    run_loopserve(pol, "old", 200, 31, lambda n, layer: keys[:n],
                  lambda s, layer: aligned_query(dirs, s, strength=8.0))  # ring full of dirs
    pol.release("old")
    g = torch.Generator().manual_seed(1)
    log = run_loopserve(pol, "new", 200, 17, lambda n, layer: keys[:n],
                        lambda s, layer: 0.1 * torch.randn(SHAPE.num_q_heads, SHAPE.head_dim,
                                                           generator=g))
    assert pol.state("new").slot == 0  # the old request's slot
    assert not (log[16][2][0] == 77).any(dim=1).all()
    pol.release("new")


def test_loopserve_prompt_seed_attends_the_prompts_selection_from_step_0():
    """Seeded at prefill (its last queries per layer), a long prompt's steps before
    the first selection attend what those queries select, as reselect scores; the
    decoded queries then reselect at first_select_step as before."""
    pol = get_policy("loopserve", SEEDED, SHAPE)
    assert pol.scores_prompt() and pol.prefill_window == CFG.window
    dirs = unit_dirs(3)
    keys = [noise_keys(300, 20 + layer) for layer in range(SHAPE.num_layers)]
    for layer, p in enumerate((30, 57)):
        keys[layer][p] = 3.0 * dirs
    n = 200
    pol.start("r", n)
    prompt_q = [torch.stack([aligned_query(dirs, 50 + i) for i in range(CFG.nd)])
                for _ in range(SHAPE.num_layers)]
    for layer in range(SHAPE.num_layers):
        pol.prefill_layer("r", layer, prompt_q[layer], keys[layer][:n])
    lo, hi = torch.tensor([CFG.sink]), torch.tensor([n - CFG.window])
    log = []
    for s in range(20):
        seq_len = n + 1 + s
        log.append(decode_step(pol, "r", seq_len, lambda layer, s=s: aligned_query(dirs, s),
                               lambda layer, m=seq_len: keys[layer][:m]))
    for s, (row, sels) in enumerate(log):
        assert row.kind == Kind.SPARSE and row.observe == s % CFG.nd
        assert row.reselect == (s == 16)
    for layer, p in enumerate((30, 57)):
        mass = score_history(prompt_q[layer][None], keys[layer][:n][None], SHAPE.sm_scale,
                             torch.arange(n - CFG.nd, n)[None])
        want = select_topk(look_ahead(mass, CFG.lookahead, lo), CFG.budget, lo, hi,
                           first_of_ties=True)[0]
        assert torch.equal(log[0][1][layer], want) and (want == p).any(dim=1).all()
        assert log[0][0].recent_start == n - CFG.window
    assert pol.release("r") and pol.live_states == 0


def test_loopserve_prompt_seed_off_or_short_prompt_keeps_the_dense_start():
    assert not get_policy("loopserve", CFG, SHAPE).scores_prompt()  # off by default
    pol = get_policy("loopserve", SEEDED, SHAPE)
    pol.start("short", 20)  # < min_context: nothing to select from
    for layer in range(SHAPE.num_layers):
        pol.prefill_layer("short", layer, torch.randn(CFG.nd, 6, 16), noise_keys(20, layer))
    row, sels = decode_step(pol, "short", 21, lambda layer: torch.randn(6, 16), None)
    assert row.kind == Kind.OBSERVE and not sels  # dense until a selection from decode
    with pytest.raises(ValueError, match="do not fit prompt_len"):
        pol.prefill_layer("short", 0, torch.randn(21, 6, 16), noise_keys(20, 0))
    with pytest.raises(ValueError, match="--spec-prompt-seed 'yes' is invalid"):
        dataclasses.replace(SEEDED, prompt_seed="yes")
    with pytest.raises(ValueError, match="read only with --spec-mode loopserve"):
        DecodeConfig(mode="snapkv", prompt_seed=True)


def test_loopserve_short_history_stays_exact():
    pol = get_policy("loopserve", CFG, SHAPE)
    log = run_loopserve(
        pol, "r", 5, 40,
        keys_of=lambda n, layer: noise_keys(n, 0),
        q_of=lambda s, layer: torch.zeros(SHAPE.num_q_heads, SHAPE.head_dim),
    )
    # 5 + 1 + 16 = 22 < min_context 32 at step 16: dense; at step 32 (38) it selects.
    # Steps whose query no sparse selection will score need no per-layer work at all.
    assert [s for s, row, _ in log if row.reselect] == [32]
    kinds = [row.kind for _, row, _ in log]
    assert kinds[:11] == [Kind.EXACT] * 11  # 5 + 1 + s + 15 < 32
    assert set(kinds[11:32]) == {Kind.OBSERVE} and set(kinds[32:]) == {Kind.SPARSE}
    pol.release("r")


# ------------------------------------------------------------------ lifetime


@pytest.mark.parametrize("name", POLICIES)
def test_state_lifetime(name):
    pol = get_policy(name, CFG, SHAPE)
    for i in range(3):
        pol.start(f"r{i}", 50)
    assert pol.live_states == 3 and len(pol.slots) == 3
    with pytest.raises(ValueError, match="already has a live"):
        pol.start("r1", 50)
    assert pol.release("r1") is True
    assert pol.release("r1") is False
    with pytest.raises(KeyError, match="no live"):
        pol.step("r1", 51)
    pol.release("r0"), pol.release("r2")
    assert pol.live_states == 0 and len(pol.slots) == 0


# ------------------------------------------------------------------ policy -> kernel


def test_loopserve_selections_feed_the_kernel():
    """Batched selections satisfy the kernel's contract (the reference asserts it)."""
    pol = get_policy("loopserve", CFG, SHAPE)
    hkv, d = SHAPE.num_kv_heads, SHAPE.head_dim
    prompts = {"a": 150, "b": 90}
    keys = {rid: noise_keys(n + 20, 20 + n) for rid, n in prompts.items()}
    rows = {}
    for rid, n in prompts.items():
        log = run_loopserve(
            pol, rid, n, 17,
            keys_of=lambda m, layer, rid=rid: keys[rid][:m],
            q_of=lambda s, layer: aligned_query(unit_dirs(s), s),
        )
        rows[rid] = log[16][1]
    rids = list(prompts)
    seq_lens = torch.tensor([prompts[r] + 17 for r in rids])
    # Pool: request b's position p lives in slot offset_b + p.
    offsets = [0, 200]
    k_buf = torch.full((400, hkv, d), float("nan"))
    v_buf = torch.full((400, hkv, d), float("nan"))
    req_to_token = torch.zeros(2, 256, dtype=torch.int32)
    for b, rid in enumerate(rids):
        n = int(seq_lens[b])
        k_buf[offsets[b] : offsets[b] + n] = keys[rid][:n]
        v_buf[offsets[b] : offsets[b] + n] = torch.randn(n, hkv, d)
        req_to_token[b, :n] = torch.arange(offsets[b], offsets[b] + n)
    slots = torch.tensor([pol.state(r).slot for r in rids])
    sub = DecodeSubsets(req_to_token, torch.tensor([0, 1]), seq_lens, pol.selection(0, slots),
                        torch.full((2, hkv), CFG.budget),
                        torch.tensor([rows[r].recent_start for r in rids]), CFG.sink)
    q = torch.randn(2, SHAPE.num_q_heads, d)
    ref = sparse_decode_reference(q, k_buf, v_buf, sub, scale=SHAPE.sm_scale)
    out = sparse_decode(q, k_buf, v_buf, sub, scale=SHAPE.sm_scale)  # head_dim 16: torch
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for rid in rids:
        pol.release(rid)
    assert pol.live_states == 0


@pytest.mark.parametrize("mode, choice, drops", [
    ("specontext", "auto", True), ("specontext", "keep", False), ("specontext", "drop", True),
    ("loopserve", "auto", False), ("loopserve", "drop", True), ("snapkv", "auto", False),
    ("streaming", "drop", True), ("exact", "auto", False), ("exact", "keep", False),
])
def test_sparse_kv_cache_auto_drops_for_specontext_only(mode, choice, drops):
    assert DecodeConfig(mode=mode, sparse_kv_cache=choice).drops_sparse_kv is drops


def test_sparse_kv_cache_rejects_drop_under_exact_and_unknown_choices():
    with pytest.raises(ValueError, match="drop needs a sparse --spec-mode.*auto / keep"):
        DecodeConfig(mode="exact", sparse_kv_cache="drop")
    with pytest.raises(ValueError, match="auto, keep, drop|'auto', 'keep', 'drop'"):
        DecodeConfig(mode="specontext", sparse_kv_cache="never")


def test_decoder_marks_where_sparse_steps_began_writing_kv_and_frees_the_mark():
    """--spec-sparse-kv-cache drop: the decoder keeps, per request, the first position
    whose KV a sparse step wrote (a step of seq_len n writes position n - 1); LoopServe's
    first 16 steps are exact. Freed on release, like the policy state; untracked: None."""
    from sgl_spec.attention.batch import BatchView
    from sgl_spec.attention.decode import Decoder

    req_to_token = torch.arange(4 * 128, dtype=torch.int32).view(4, 128)

    def step(dec, rids, seq):
        rows = list(range(len(rids)))
        dec.plan(BatchView("decode", tuple(rids), tuple(seq), tuple(rows), (), True,
                           req_to_token, torch.tensor(rows), torch.tensor(seq)))

    untracked = Decoder(SHAPE, get_policy("loopserve", CFG, SHAPE))
    step(untracked, ["a"], [60])
    assert untracked.sparse_kv_from("a") is None and not untracked.tracks_sparse_kv

    dec = Decoder(SHAPE, get_policy("loopserve", CFG, SHAPE), track_sparse_kv=True)
    # "a": a 40-token prompt (sparse from its 17th step); "b": 10 tokens, a history
    # under min_context 32 at every step (exact).
    for k in range(20):
        step(dec, ["a", "b"], [41 + k, 11 + k])
        assert dec.sparse_kv_from("a") == (None if k < 16 else 40 + 16)
        assert dec.sparse_kv_from("b") is None
    dec.release("a")
    assert dec.sparse_kv_from("a") is None and dec.live_states == 1
    dec.release("b")
    assert dec._sparse_from == {} and dec.live_states == 0
