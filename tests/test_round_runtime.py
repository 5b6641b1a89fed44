"""Round mode's attention path without sglang: a question over stored rounds selects the
round its queries attend at L_w, loads the kept rounds' blocks into upper slots, and its
upper-layer attention (extend and decode) equals a float64 dense reference over exactly
those rounds and its own tokens; storing and releasing leave no slot held."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.extend import spans
from sgl_spec.rounds.history import RoundHistory, StoredRound
from sgl_spec.rounds.runtime import CapacityError, RoundRuntime
from sgl_spec.rounds.select import piece_peak, round_scores
from sgl_spec.tiers import blocks
from sgl_spec.tiers.pool import Tiers

LAYERS, SPLIT, HKV, HQ, D = 4, 2, 2, 4, 8
FULL, UPPER = 96, 48
ROUNDS = [(0, 0, 4), (1, 4, 10), (2, 10, 16), (3, 16, 22), (4, 22, 28), (5, 28, 34)]
PREFIX, NEW = 34, 6
SCALE = 1 / math.sqrt(D)


def _pool(upper=UPPER):
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(FULL if i < SPLIT else upper + 1, HKV, D, generator=g)
         for i in range(LAYERS)]
    v = [torch.randn_like(b) for b in k]
    return Tiers(SPLIT, k, v, FULL, upper)


def _history(g):
    """Stored rounds: each a block of random upper-layer KV; returns the history and
    the blocks' data by position ([L - SPLIT, 2, PREFIX, HKV, D])."""
    data = torch.randn(LAYERS - SPLIT, 2, PREFIX, HKV, D, generator=g)
    rounds = tuple(StoredRound(r, s, e, blocks.RoundBlock(data[:, :, s:e].clone()))
                   for r, s, e in ROUNDS)
    return RoundHistory(rounds), data


def _batch(mode, rid, row, seq, new, req_to_token, loc):
    return BatchView(mode, rids=(rid,), seq_lens=(seq,), pool_rows=(row,),
                     extend_lens=(new,) if mode == "extend" else (),
                     req_to_token=req_to_token, rows=torch.tensor([row]),
                     seq_lens_t=torch.tensor([seq]), input_ids=torch.zeros(new, dtype=torch.long),
                     out_cache_loc=loc)


def _reference(q, k, v):
    """float64 causal attention of the last q.shape[0] positions over k, v ([S, HKV, D])."""
    n, s = q.shape[0], k.shape[0]
    kh = k.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    vh = v.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    logits = q.double().transpose(0, 1) @ kh.transpose(1, 2) * SCALE
    mask = torch.arange(s)[None, :] > torch.arange(s - n, s)[:, None]
    logits.masked_fill_(mask, float("-inf"))
    return (torch.softmax(logits, -1) @ vh).transpose(0, 1)


def _check_decode(rt, dplan, tiers, loc, kept_kv, own_kv, g):
    """One decode step at every upper layer (the new token's KV written at ``loc``) equals
    the float64 reference over the kept rounds' KV, the request's own and the new token's
    (``kept_kv``, ``own_kv``: [L - SPLIT, 2, n, HKV, D])."""
    step = torch.randn(LAYERS - SPLIT, 2, 1, HKV, D, generator=g)
    for i in range(LAYERS - SPLIT):
        tiers.k_bufs[SPLIT + i][tiers.upper_rows(loc)] = step[i, 0]
        tiers.v_bufs[SPLIT + i][tiers.upper_rows(loc)] = step[i, 1]
        q = torch.randn(1, HQ, D, generator=g)
        out = torch.empty(1, HQ, D)
        rt.decode_upper(dplan, q, tiers.k_bufs[SPLIT + i], tiers.v_bufs[SPLIT + i], out, SCALE,
                        impl="torch", check=True)
        keys, vals = (torch.cat([kept_kv[i, j], own_kv[i, j], step[i, j]]) for j in (0, 1))
        torch.testing.assert_close(out.double(), _reference(q, keys, vals), atol=1e-5,
                                   rtol=1e-5)


def test_a_question_selects_its_round_and_attends_exactly_the_kept_rounds():
    g = torch.Generator().manual_seed(1)
    tiers = _pool()
    rt = RoundRuntime(tiers, "topk", recent=1, min_rounds=2)
    history, data = _history(g)
    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    slots = torch.randperm(FULL - 1, generator=g)[: PREFIX + NEW + 1] + 1
    req_to_token[2, : PREFIX + NEW + 1] = slots.int()
    rt.seed("q", history)
    batch = _batch("extend", "q", 2, PREFIX + NEW, NEW, req_to_token, slots[PREFIX:PREFIX + NEW])
    plan = rt.plan(batch)
    assert plan.select_idx == [0] and tiers.slots.used() == NEW
    # The question's queries at L_w point at round 3's keys.
    q_lw = torch.randn(NEW, HQ, D, generator=g) * 0.1
    k_lw = tiers.k_bufs[SPLIT - 1]
    target = torch.randn(HKV, D, generator=g)
    k_lw[slots[16:22]] = target * 4
    q_lw += target.repeat_interleave(HQ // HKV, 0)
    rt.select_rounds(plan, spans(batch), q_lw, k_lw, SCALE)
    st = rt.states["q"]
    kept_rounds = [history.rounds[i].round for i in st.kept]
    assert kept_rounds == [0, 3, 5]  # system prompt, the selected round, the last one
    assert st.kept_pos.tolist() == [*range(0, 4), *range(16, 22), *range(28, 34)]
    assert tiers.slots.used() == NEW + 16 and tiers.slots.check() == []
    assert rt.counts["blocks_loaded"] == 3 and rt.counts["tokens_loaded"] == 16
    # The pool's writes of the new tokens' upper KV, then the upper layers.
    own = torch.randn(LAYERS - SPLIT, 2, NEW, HKV, D, generator=g)
    for i in range(LAYERS - SPLIT):
        rows = tiers.upper_rows(slots[PREFIX:PREFIX + NEW])
        tiers.k_bufs[SPLIT + i][rows] = own[i, 0]
        tiers.v_bufs[SPLIT + i][rows] = own[i, 1]
    sp = spans(batch)[0]
    for i in range(LAYERS - SPLIT):
        q = torch.randn(NEW, HQ, D, generator=g)
        got = rt.extend_upper(plan, 0, sp, q, tiers.k_bufs[SPLIT + i], tiers.v_bufs[SPLIT + i],
                              SCALE)
        keys = torch.cat([data[i, 0, st.kept_pos], own[i, 0]])
        vals = torch.cat([data[i, 1, st.kept_pos], own[i, 1]])
        torch.testing.assert_close(got.double(), _reference(q, keys, vals), atol=1e-5,
                                   rtol=1e-5)
    # One decode step: the kept rounds, the own tokens and the new one.
    loc = slots[PREFIX + NEW : PREFIX + NEW + 1]
    dplan = rt.plan(_batch("decode", "q", 2, PREFIX + NEW + 1, 1, req_to_token, loc))
    _check_decode(rt, dplan, tiers, loc, data[:, :, st.kept_pos], own, g)
    # The turn ends: its own tokens become a block (one round without a format).
    stored = rt.store("q", list(range(PREFIX + NEW + 1)), PREFIX + NEW + 1, None)
    assert [(e, h.end) for e, h in stored] == [(PREFIX + NEW + 1, PREFIX + NEW + 1)]
    block = stored[0][1].rounds[-1].block
    torch.testing.assert_close(block.data[:, :, :NEW], own)
    assert stored[0][1].rounds[:-1] == history.rounds  # the blocks are shared, not copied
    rt.release("q")
    assert tiers.slots.used() == 0 and tiers.slots.check() == [] and rt.live_states == 0


def test_a_full_upper_tier_trims_the_least_important_rounds_then_refuses_by_name():
    g = torch.Generator().manual_seed(2)
    tiers = _pool(upper=20)
    rt = RoundRuntime(tiers, "adaptive", recent=1, min_rounds=8)  # 5 candidates < 8: all
    history, _ = _history(g)
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    req_to_token[0, : PREFIX + NEW] = torch.arange(1, PREFIX + NEW + 1).int()
    rt.seed("a", history)
    batch = _batch("extend", "a", 0, PREFIX + NEW, NEW, req_to_token,
                   req_to_token[0, PREFIX:PREFIX + NEW].long())
    plan = rt.plan(batch)
    rt.select_rounds(plan, spans(batch), torch.randn(NEW, HQ, D), tiers.k_bufs[SPLIT - 1],
                     SCALE)
    st = rt.states["a"]
    # 20 slots: its 6 new tokens, round 0 (4), the newest round (6); the 4 older left out
    assert [history.rounds[i].round for i in st.kept] == [0, 5]
    assert rt.counts["exact_selections"] == 1 and rt.counts["trimmed_rounds"] == 4
    assert tiers.slots.available() == 4 and tiers.slots.check() == []
    # Another request's 6 new tokens: the running one gives up its least important round.
    req_to_token[1, :6] = torch.arange(50, 56).int()
    rt.plan(_batch("extend", "b", 1, 6, 6, req_to_token, req_to_token[1, :6].long()))
    assert [history.rounds[i].round for i in st.kept] == [0]
    assert st.kept_pos.tolist() == [0, 1, 2, 3] and rt.counts["trimmed_rounds"] == 5
    # A request whose own tokens do not fit even then: refused, naming the flag.
    req_to_token[2, :16] = torch.arange(60, 76).int()
    with pytest.raises(CapacityError, match="--spec-round-upper-tokens"):
        rt.plan(_batch("extend", "c", 2, 16, 16, req_to_token, req_to_token[2, :16].long()))
    for rid in ("a", "b", "c"):
        rt.release(rid)
    assert tiers.slots.used() == 0 and tiers.slots.check() == [] and rt.live_states == 0


def test_rounds_no_selection_kept_for_n_questions_are_dropped_only_when_asked():
    """Sec. 3.4 (opt-in): with drop_after 2, rounds 1, 2 and 4, left by two questions in a
    row that select round 3 (and keep the last one, 5), are dropped: their blocks free
    their host rows and a third question neither scores nor loads them. Without it
    (drop_after 0) nothing is dropped."""
    g = torch.Generator().manual_seed(3)
    history, _ = _history(g)
    full = sum(r.block.nbytes for r in history.rounds)
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    req_to_token[:, :PREFIX] = torch.arange(1, PREFIX + 1).int()
    target = torch.randn(HKV, D, generator=g)

    def ask(rt, tiers, rid, row):
        new = torch.arange(40 + 8 * row, 40 + 8 * row + NEW)
        req_to_token[row, PREFIX:PREFIX + NEW] = new.int()
        rt.seed(rid, history)
        batch = _batch("extend", rid, row, PREFIX + NEW, NEW, req_to_token, new)
        plan = rt.plan(batch)
        k_lw = tiers.k_bufs[SPLIT - 1]
        k_lw[1:PREFIX + 1] = torch.randn(PREFIX, HKV, D, generator=g) * 0.1
        k_lw[17:23] = target * 4  # round 3's positions 16..21 (slots 17..22)
        q = torch.randn(NEW, HQ, D, generator=g) * 0.1 + target.repeat_interleave(HQ // HKV, 0)
        rt.select_rounds(plan, spans(batch), q, k_lw, SCALE)
        kept = [history.rounds[i].round for i in rt.states[rid].kept]
        rt.release(rid)
        return kept

    for drop_after, dropped in ((0, []), (2, [1, 2, 4])):
        for r in history.rounds:
            assert not r.block.dropped
        tiers = _pool()
        rt = RoundRuntime(tiers, "topk", recent=1, min_rounds=2, drop_after=drop_after)
        assert ask(rt, tiers, "a", 0) == [0, 3, 5] and ask(rt, tiers, "b", 1) == [0, 3, 5]
        assert [r.round for r in history.rounds if r.block.dropped] == dropped
        assert rt.counts["dropped_rounds"] == len(dropped)
        assert rt.totals()["host_bytes"] == 0  # the runtime stored none of these blocks
        row = (LAYERS - SPLIT) * 2 * HKV * D * 4  # float32 K and V of one token's layers
        left = sum(r.block.nbytes for r in history.rounds)
        assert left == full - row * sum(r.end - r.start for r in history.rounds
                                        if r.round in dropped)
        before = rt.counts["blocks_loaded"]
        assert ask(rt, tiers, "c", 2) == [0, 3, 5]
        assert rt.counts["blocks_loaded"] - before == 3  # none of the dropped ones
    with pytest.raises(ValueError, match="dropped"):
        blocks.load(history.rounds[1].block, tiers.k_bufs[SPLIT:], tiers.v_bufs[SPLIT:],
                    torch.arange(6))
    assert tiers.slots.used() == 0 and rt.live_states == 0


def test_a_checkpoint_that_points_a_request_at_the_tree_s_slots_moves_its_upper_slots():
    """Two requests compute the same new tokens; b's checkpoint finds a's in the tree, frees
    b's slots and points b's row at a's (sglang's insert). ``rekey`` moves b's holds
    there, so when a has gone and sglang hands b's freed slot to b's next token, nothing
    is still mapped (no stale slot, no upper KV overwritten) and b's decode reads the same
    tokens' KV; every slot comes back."""
    g = torch.Generator().manual_seed(4)
    tiers = _pool()
    rt = RoundRuntime(tiers, "topk", recent=1, min_rounds=8)  # 5 candidates: all kept
    history, data = _history(g)
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[:, :PREFIX] = torch.arange(1, PREFIX + 1).int()
    own = {0: torch.arange(40, 40 + NEW), 1: torch.arange(50, 50 + NEW)}
    new_kv = torch.randn(LAYERS - SPLIT, 2, NEW, HKV, D, generator=g)  # the same tokens
    for row, rid in ((0, "a"), (1, "b")):
        req_to_token[row, PREFIX:PREFIX + NEW] = own[row].int()
        rt.seed(rid, history)
        batch = _batch("extend", rid, row, PREFIX + NEW, NEW, req_to_token, own[row])
        plan = rt.plan(batch)
        rt.select_rounds(plan, spans(batch), torch.randn(NEW, HQ, D, generator=g),
                         tiers.k_bufs[SPLIT - 1], SCALE)
        for i in range(LAYERS - SPLIT):
            rows = tiers.upper_rows(own[row])
            tiers.k_bufs[SPLIT + i][rows] = new_kv[i, 0]
            tiers.v_bufs[SPLIT + i][rows] = new_kv[i, 1]
    # b's checkpoint: the tree holds these tokens in a's slots; b's are freed
    req_to_token[1, PREFIX:PREFIX + NEW] = own[0].int()
    rt.rekey("b", req_to_token[1], PREFIX + NEW)
    assert rt.counts["rekeyed_tokens"] == NEW and not bool(tiers.slots.mapped(own[1]).any())
    rt.release("a")
    loc = own[1][:1]  # b's next token gets one of its freed slots back
    dplan = rt.plan(_batch("decode", "b", 1, PREFIX + NEW + 1, 1, req_to_token, loc))
    assert rt.counts["stale_slots"] == 0
    _check_decode(rt, dplan, tiers, loc, data[:, :, rt.states["b"].kept_pos], new_kv, g)
    rt.release("b")
    assert tiers.slots.used() == 0 and tiers.slots.check() == [] and rt.live_states == 0


def test_qatt_is_the_softmax_peak_on_each_span():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(3, HQ, D, generator=g), torch.randn(10, HKV, D, generator=g)
    peak = piece_peak(q, k, [(0, 4), (4, 7), (7, 10)], SCALE)
    kh = k.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    logits = q.double().transpose(0, 1) @ kh.transpose(1, 2) * SCALE
    logits.masked_fill_(torch.arange(10)[None, :] > torch.arange(7, 10)[:, None], float("-inf"))
    p = torch.softmax(logits, -1)  # [Hq, 3, 10]
    want = torch.stack([p[..., 0:4].amax(-1), p[..., 4:7].amax(-1), p[..., 7:10].amax(-1)], -1)
    torch.testing.assert_close(peak.double(), want, atol=1e-5, rtol=1e-5)
    # rounds of pieces: per head and query the pieces' largest, the largest over queries,
    # summed over heads
    scores = round_scores(peak, [[0], [1, 2]])
    per = torch.stack([want[..., 0], want[..., 1:].amax(-1)], -1)
    torch.testing.assert_close(scores.double(), per.amax(1).sum(0), atol=1e-5, rtol=1e-5)


def test_a_long_rounds_diffuse_mass_does_not_outrank_a_looked_up_fact():
    """Hand-worked: one head, one query; a 6-key round holds 0.6 of the mass spread
    evenly (0.1 a key), a 2-key round 0.4 with 0.35 on one key (the fact). The mass ranks
    the long round first; the peak ranks the fact's round first."""
    p = torch.tensor([[[0.1] * 6 + [0.35, 0.05]]])  # [Hq 1, n 1, S 8]
    spans = [(0, 6), (6, 8)]
    mass = torch.stack([p[..., a:b].sum(-1) for a, b in spans], -1)
    assert mass.argmax() == 0
    keys = torch.log(p[0, 0])[:, None, None].repeat(1, HKV, D) / D  # q . k = log p per key
    q = torch.ones(1, 1, D).repeat(1, HQ, 1)
    peak = piece_peak(q[:, :1], keys[:, :1], spans, 1.0)  # one head over one KV head
    torch.testing.assert_close(peak[0, 0], torch.tensor([0.1, 0.35]), atol=1e-6, rtol=1e-5)
    assert round_scores(peak, [[0], [1]]).argmax() == 1


def test_one_query_that_looks_a_fact_up_decides_the_round():
    """Hand-worked: two heads, three question tokens; two of them attend round 0 a little
    and the third attends round 1 strongly. Summing over the queries ranks round 0 first;
    the largest per query ranks round 1 first."""
    mass = torch.tensor([[[0.3, 0.0], [0.3, 0.0], [0.0, 0.5]],
                         [[0.3, 0.0], [0.3, 0.0], [0.0, 0.5]]])  # [Hq 2, n 3, P 2]
    assert mass.sum((0, 1)).argmax() == 0  # Eq. 1's sum
    torch.testing.assert_close(round_scores(mass, [[0], [1]]), torch.tensor([0.6, 1.0]))

def test_loopserve_prefill_serves_the_layers_below_the_watershed():
    """``--spec-rounds --spec-prefill loopserve``: a long new turn's extend takes LoopServe's
    sparse path at the layers below the split (its lines offered to the cache after the
    last of them), round mode selects at the last one, and the upper layers attend the
    working set, unchanged by the prefill."""
    from sgl_spec.attention import build_core
    from sgl_spec.config import PrefillConfig, RoundConfig, SpecConfig
    from sgl_spec.sparse.policy import AttnShape

    g = torch.Generator().manual_seed(5)
    tiers = _pool()
    cfg = SpecConfig(prefill=PrefillConfig(mode="loopserve", min_tokens=4, max_density=1.0,
                                           skip_density=1.0),
                     rounds=RoundConfig(enable=True, min_rounds=2, watershed=SPLIT))
    core = build_core(cfg, AttnShape(LAYERS, HQ, HKV, D, torch.float32), "cpu", tiers=tiers)
    assert core.prefill.num_layers == SPLIT
    history, data = _history(g)
    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    slots = torch.randperm(FULL - 1, generator=g)[: PREFIX + NEW] + 1
    req_to_token[1, : PREFIX + NEW] = slots.int()
    core.rounds.seed("q", history)
    batch = _batch("extend", "q", 1, PREFIX + NEW, NEW, req_to_token, slots[PREFIX:])
    plan = core.plan(batch)
    assert list(plan.extend.turns) == [0] and plan.rounds.select_idx == [0]
    offered = []
    core.hub.offer_lines = lambda rid, lines: offered.append((rid, sorted(lines.layers)))
    for layer in range(LAYERS):
        k_buf, v_buf = tiers.k_bufs[layer], tiers.v_bufs[layer]
        rows = slots[PREFIX:] if layer < SPLIT else tiers.upper_rows(slots[PREFIX:])
        k_buf[rows] = torch.randn(NEW, HKV, D, generator=g)
        v_buf[rows] = torch.randn(NEW, HKV, D, generator=g)
        q = torch.randn(NEW, HQ, D, generator=g)
        out = core.run(plan, layer, q, k_buf, v_buf, torch.empty(NEW, HQ, D), SCALE)
        if layer < SPLIT:
            assert sorted(core.prefill.stats.layers) == list(range(layer + 1))
            continue
        st = core.rounds.states["q"]
        keys = torch.cat([data[layer - SPLIT, 0, st.kept_pos], k_buf[rows]])
        vals = torch.cat([data[layer - SPLIT, 1, st.kept_pos], v_buf[rows]])
        torch.testing.assert_close(out.double(), _reference(q, keys, vals), atol=1e-5,
                                   rtol=1e-5)
    assert core.prefill.stats.sparse_extends == 1 and sorted(core.prefill.stats.layers) == [0, 1]
    assert offered == [("q", [0, 1])]  # after layer SPLIT - 1, not after the last layer
    assert core.rounds.counts["selections"] == 1
    core.hub.release("q")
    assert tiers.slots.used() == 0 and core.rounds.live_states == 0
