"""Selection policies (sgl_spec.sparse): registry, params, selections, state lifetime."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgl_spec.kernels.sparse_decode import sparse_decode
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference
from sgl_spec.sparse import (
    AttnShape,
    SelectionPolicy,
    SparseParams,
    Subset,
    available_policies,
    get_policy,
    pack_subsets,
    register_policy,
    score_history,
    select_topk,
    use_exact,
)
from sgl_spec.sparse import policy as policy_mod

SHAPE = AttnShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)
PARAMS = SparseParams(budget=8, sink=2, window=4, nd=16, first_select_step=16, min_context=32)


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


def assert_valid_selection(sub: Subset, seq_len: int, params: SparseParams) -> None:
    sel = sub.sel_idx
    assert sel.dtype == torch.int64 and sel.shape[0] == SHAPE.num_kv_heads
    assert sel.shape[1] <= params.budget
    for row in sel.tolist():
        assert len(set(row)) == len(row), "duplicates"
        assert row == sorted(row)
        assert all(min(params.sink, seq_len) <= p < sub.recent_start for p in row)
    assert 0 <= sub.recent_start < seq_len


# ------------------------------------------------------------------ registry


def test_registry_lists_builtin_policies():
    assert set(available_policies()) >= {"exact", "streaming", "snapkv", "loopserve"}
    for name in ("exact", "streaming", "snapkv", "loopserve"):
        pol = get_policy(name, PARAMS, SHAPE)
        assert isinstance(pol, SelectionPolicy) and pol.name == name
        assert pol.live_states == 0


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="'h2o' is unknown; valid: exact, streaming, snapkv, loopserve"):
        get_policy("h2o", PARAMS, SHAPE)


def test_register_rejects_duplicates_and_accepts_new(monkeypatch):
    monkeypatch.setattr(policy_mod, "_REGISTRY", dict(policy_mod._REGISTRY))
    with pytest.raises(ValueError, match="'exact' is already registered"):
        register_policy("exact", lambda p, s: None)

    class Custom(SelectionPolicy):
        name = "custom"

        def decode_layer(self, rid, layer, q, k=None):
            raise NotImplementedError

    register_policy("custom", Custom)
    assert "custom" in available_policies()
    assert isinstance(get_policy("custom", PARAMS, SHAPE), Custom)


# ------------------------------------------------------------------ params


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
def test_params_validation_names_flag_and_range(field, value, flag, lo):
    with pytest.raises(ValueError) as err:
        SparseParams(**{field: value})
    assert str(err.value) == f"{flag} {value!r} is invalid; valid range: integers >= {lo}"


def test_params_defaults_and_frozen():
    p = SparseParams()
    assert (p.budget, p.sink, p.window, p.nd, p.first_select_step, p.min_context) == (
        1024, 4, 64, 16, 16, 2048,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 5


@pytest.mark.parametrize(
    "seq_len, exact",
    [(31, True), (32, True), (8 + 2 + 4, True), (33, False), (1000, False)],
    ids=["below-min", "covered-by-budget", "tiny", "just-sparse", "long"],
)
def test_use_exact(seq_len, exact):
    p = dataclasses.replace(PARAMS, min_context=20, budget=26)  # 26 + 2 + 4 = 32
    assert use_exact(seq_len, p) is exact


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
    got = score_history(q, k, 8**-0.5, q_pos)
    assert got.shape == (hkv, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_scores(q, k, 8**-0.5, q_pos), rtol=1e-5, atol=1e-6)
    # Each query head contributes total mass 1.
    torch.testing.assert_close(got.sum(), torch.tensor(5.0 * hq))


def test_score_history_bf16_keys_close_to_fp32():
    # 16-bit keys take a 16-bit matmul: scores stay within 2% of the fp32 ones,
    # and the top positions are the same.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(16, 9, 64, generator=g)
    k = torch.randn(2000, 3, 64, generator=g)
    u = q.reshape(16, 3, 3, 64).mean((0, 2))  # [Hkv, D] the group's mean query
    k[[100, 700, 1500]] = 12 * u / u.norm(dim=-1, keepdim=True)  # planted keys
    q_pos = torch.arange(1984, 2000)
    ref = score_history(q, k, 64**-0.5, q_pos)
    got = score_history(q.bfloat16(), k.bfloat16(), 64**-0.5, q_pos)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.mean().item())
    assert got.topk(3).indices.sort().values.tolist() == [[100, 700, 1500]] * 3


def test_select_topk_excludes_sink_and_window():
    scores = torch.arange(20.0).repeat(2, 1)  # highest at the end: inside the window
    sel = select_topk(scores, budget=5, lo=2, hi=15)
    assert sel.tolist() == [[10, 11, 12, 13, 14]] * 2
    assert select_topk(scores, budget=50, lo=2, hi=6).tolist() == [[2, 3, 4, 5]] * 2
    assert select_topk(scores, budget=5, lo=6, hi=6).shape == (2, 0)


# ------------------------------------------------------------------ exact / streaming


def test_exact_is_always_dense():
    pol = get_policy("exact", PARAMS, SHAPE)
    pol.start("r", 5000)
    assert pol.step("r", 5001) is False
    sub = pol.decode_layer("r", 0, torch.zeros(SHAPE.num_q_heads, SHAPE.head_dim))
    assert sub.dense and sub.sel_idx.shape == (SHAPE.num_kv_heads, 0)
    assert pol.release("r") and pol.live_states == 0


def test_streaming_is_sink_plus_recent_window():
    pol = get_policy("streaming", PARAMS, SHAPE)
    q = torch.zeros(SHAPE.num_q_heads, SHAPE.head_dim)
    pol.start("short", 10)
    pol.step("short", 11)
    assert pol.decode_layer("short", 0, q).dense
    pol.start("long", 100)
    for seq_len in (101, 102):
        assert pol.step("long", seq_len) is False
        sub = pol.decode_layer("long", 1, q)
        assert sub.recent_start == seq_len - PARAMS.window
        assert sub.sel_idx.shape == (SHAPE.num_kv_heads, 0) and not sub.dense
    pol.release("short"), pol.release("long")
    assert pol.live_states == 0


# ------------------------------------------------------------------ snapkv


@pytest.mark.parametrize("pool_kind", ["avg", "max", "none"])
def test_snapkv_selects_planted_key_outside_sink_and_window(pool_kind):
    from sgl_spec.sparse.snapkv import SnapKVPolicy

    n, w = 120, PARAMS.window
    dirs = unit_dirs(1)
    pol = SnapKVPolicy(PARAMS, SHAPE, pool_kind=pool_kind)
    pol.start("r", n)
    k = noise_keys(n, 2)
    planted = 57
    k[planted] = 3.0 * dirs
    k[0] = 3.0 * dirs  # in the sink: attended anyway, never selected
    k[n - 2] = 3.0 * dirs  # in the window: likewise
    q_obs = torch.stack([aligned_query(dirs, s) for s in range(w)])  # [w, Hq, D]
    for layer in range(SHAPE.num_layers):
        pol.prefill_layer("r", layer, q_obs, k)
    assert pol.step("r", n + 1) is False
    sub = pol.decode_layer("r", 0, q_obs[-1])
    assert sub.recent_start == n - w
    assert_valid_selection(sub, n + 1, PARAMS)
    assert sub.sel_idx.shape == (SHAPE.num_kv_heads, PARAMS.budget)
    assert (sub.sel_idx == planted).any(dim=1).all(), sub.sel_idx
    # The selection stays fixed while the window grows with generated tokens.
    pol.step("r", n + 2)
    again = pol.decode_layer("r", 0, q_obs[-1])
    assert again.recent_start == sub.recent_start and torch.equal(again.sel_idx, sub.sel_idx)
    pol.release("r")
    assert pol.live_states == 0


def test_snapkv_short_prompt_is_dense():
    pol = get_policy("snapkv", PARAMS, SHAPE)
    pol.start("r", 20)
    pol.prefill_layer("r", 0, torch.zeros(4, 6, 16), torch.zeros(20, 2, 16))
    pol.step("r", 21)
    assert pol.decode_layer("r", 0, torch.zeros(6, 16)).dense


# ------------------------------------------------------------------ loopserve


def run_loopserve(pol, rid, prompt_len, steps, keys_of, q_of):
    """Drive ``steps`` decode steps; returns [(step, reselected, [Subset per layer])]."""
    log = []
    pol.start(rid, prompt_len)
    for s in range(steps):
        seq_len = prompt_len + 1 + s
        reselect = pol.step(rid, seq_len)
        subs = [
            pol.decode_layer(rid, layer, q_of(s, layer), keys_of(seq_len, layer) if reselect else None)
            for layer in range(SHAPE.num_layers)
        ]
        log.append((s, reselect, subs))
    return log


def test_loopserve_reselects_at_16_32_48():
    pol = get_policy("loopserve", PARAMS, SHAPE)
    keys = noise_keys(200, 3)
    log = run_loopserve(
        pol, "r", 100, 60,
        keys_of=lambda n, layer: keys[:n],
        q_of=lambda s, layer: aligned_query(unit_dirs(s), s),
    )
    assert [s for s, re, _ in log if re] == [16, 32, 48]
    for s, _, subs in log:
        seq_len = 100 + 1 + s
        for sub in subs:
            if s < 16:
                assert sub.dense
                continue
            last_sel = 16 + (s - 16) // 16 * 16
            assert sub.recent_start == 100 + 1 + last_sel - PARAMS.window
            assert sub.sel_idx.shape == (SHAPE.num_kv_heads, PARAMS.budget)
            assert_valid_selection(sub, seq_len, PARAMS)
    assert pol.release("r") and pol.live_states == 0


def test_loopserve_selects_planted_keys_per_layer():
    pol = get_policy("loopserve", PARAMS, SHAPE)
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
    _, reselected, subs = log[16]
    assert reselected
    for layer, p in enumerate(planted):
        other = planted[1 - layer]
        assert (subs[layer].sel_idx == p).any(dim=1).all()
        assert not (subs[layer].sel_idx == other).any()
    pol.release("r")


def test_loopserve_selection_sees_the_current_query():
    """Only the query of the selecting step points at the planted key."""
    pol = get_policy("loopserve", PARAMS, SHAPE)
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
    assert (log[16][2][0].sel_idx == 123).any(dim=1).all()
    pol.release("r")


def test_loopserve_short_history_stays_dense():
    pol = get_policy("loopserve", PARAMS, SHAPE)
    log = run_loopserve(
        pol, "r", 5, 40,
        keys_of=lambda n, layer: noise_keys(n, 0),
        q_of=lambda s, layer: torch.zeros(SHAPE.num_q_heads, SHAPE.head_dim),
    )
    # 5 + 1 + 16 = 22 < min_context 32 at step 16: dense; at step 32 (38) it selects.
    assert [s for s, re, _ in log if re] == [32]
    assert all(sub.dense for s, _, subs in log if s < 32 for sub in subs)
    assert not log[32][2][0].dense
    pol.release("r")


def test_loopserve_needs_keys_when_reselecting():
    pol = get_policy("loopserve", PARAMS, SHAPE)
    pol.start("r", 100)
    for s in range(16):
        pol.step("r", 101 + s)
    assert pol.step("r", 117) is True
    with pytest.raises(ValueError, match="needs k"):
        pol.decode_layer("r", 0, torch.zeros(6, 16))
    pol.release("r")


# ------------------------------------------------------------------ lifetime


@pytest.mark.parametrize("name", ["exact", "streaming", "snapkv", "loopserve"])
def test_state_lifetime(name):
    pol = get_policy(name, PARAMS, SHAPE)
    for i in range(3):
        pol.start(f"r{i}", 50)
    assert pol.live_states == 3
    with pytest.raises(ValueError, match="already has a live"):
        pol.start("r1", 50)
    assert pol.release("r1") is True
    assert pol.release("r1") is False
    with pytest.raises(KeyError, match="no live"):
        pol.step("r1", 51)
    pol.release("r0"), pol.release("r2")
    assert pol.live_states == 0


# ------------------------------------------------------------------ policy -> kernel


def test_loopserve_subsets_feed_the_kernel():
    """Packed policy subsets satisfy the kernel's contract (the reference asserts it)."""
    pol = get_policy("loopserve", PARAMS, SHAPE)
    hkv, d = SHAPE.num_kv_heads, SHAPE.head_dim
    prompts = {"a": 150, "b": 90}
    keys = {rid: noise_keys(n + 20, 20 + n) for rid, n in prompts.items()}
    subs = {}
    for rid, n in prompts.items():
        log = run_loopserve(
            pol, rid, n, 17,
            keys_of=lambda m, layer, rid=rid: keys[rid][:m],
            q_of=lambda s, layer: aligned_query(unit_dirs(s), s),
        )
        subs[rid] = log[16][2][0]
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
    packed = pack_subsets([subs[r] for r in rids], hkv, "cpu")
    assert packed.sel_len.tolist() == [[PARAMS.budget] * hkv] * 2
    args = (
        torch.randn(2, SHAPE.num_q_heads, d), k_buf, v_buf, req_to_token,
        torch.tensor([0, 1]), seq_lens, *packed,
    )
    ref = sparse_decode_reference(*args, sink=PARAMS.sink, scale=SHAPE.sm_scale)
    out = sparse_decode(*args, sink=PARAMS.sink, scale=SHAPE.sm_scale, impl="torch")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for rid in rids:
        pol.release(rid)
    assert pol.live_states == 0
