"""LoopServe sparse prefill: the extend path, the lines kept across turns through the
request hub, seeded selection (no server)."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.attention import prefill as prefill_mod
from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.core import AttentionCore
from sgl_spec.attention.decode import Decoder
from sgl_spec.attention.prefill import SparsePrefill
from sgl_spec.config import PrefillConfig
from sgl_spec.kernels.vslash import SelectConfig, make_lines, select_lines, vslash_attention
from sgl_spec.kernels.vslash.reference import vslash_attention_ref
from sgl_spec.requests import Lines, RequestHub
from sgl_spec.sparse import AttnShape
from tests.test_vslash_kernels import PLANT_CFG, PLANT_HIST, PLANT_N, PLANT_S, PLANT_V, planted_qk

SCALE = 0.25
SELECT = SelectConfig(alpha=0.9, local=4, sink=2, last_q=8, strided_q=8)
HEADS, KV_HEADS, DIM = 6, 2, 16


def prefill(min_tokens=16, num_layers=1, hub=None, **cfg) -> SparsePrefill:
    return SparsePrefill(PrefillConfig(mode="loopserve", min_tokens=min_tokens, **cfg),
                         num_layers, hub=hub if hub is not None else RequestHub(),
                         select=SELECT)


class Batch:
    """An extend pass over a scattered pool: request i has prefix_lens[i] cached tokens
    and new_lens[i] new ones (its queries)."""

    def __init__(self, prefix_lens, new_lens, dtype=torch.float32, rids=None):
        gen = torch.Generator().manual_seed(sum(prefix_lens) * 31 + sum(new_lens))
        self.seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        pool = sum(self.seq_lens) + 5
        self.k = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
        self.v = torch.randn(pool, KV_HEADS, DIM, generator=gen).to(dtype)
        perm = torch.randperm(pool, generator=gen)
        self.r2t = torch.zeros(len(self.seq_lens) + 1, max(self.seq_lens) + 2, dtype=torch.int32)
        used = 0
        for i, s in enumerate(self.seq_lens):
            self.r2t[i + 1, :s] = perm[used : used + s].to(torch.int32)
            used += s
        self.q = torch.randn(sum(new_lens), HEADS, DIM, generator=gen).to(dtype)
        self.new_lens = list(new_lens)
        self.rids = tuple(rids or (f"r{i}" for i in range(len(new_lens))))

    def view(self) -> BatchView:
        rows = tuple(range(1, len(self.seq_lens) + 1))
        return BatchView("extend", self.rids, tuple(self.seq_lens), rows, tuple(self.new_lens),
                         req_to_token=self.r2t, rows=torch.tensor(rows),
                         seq_lens_t=torch.tensor(self.seq_lens))

    def slots(self, i: int) -> torch.Tensor:
        return self.r2t[i + 1, : self.seq_lens[i]].long()


def extend(sp: SparsePrefill | None, batch: Batch, layers: int = 1) -> torch.Tensor:
    """Run the pass through the core (exact decode, ``sp`` or exact prefill)."""
    core = AttentionCore(Decoder(AttnShape(layers, HEADS, KV_HEADS, DIM)), sp)
    plan = core.plan(batch.view())
    for layer in range(layers):
        out = torch.full_like(batch.q, float("nan"))  # poisoned: all must be written
        core.run(plan, layer, batch.q, batch.k, batch.v, out, SCALE)
    return out


class _Recorder(SparsePrefill):
    """Keeps every layer's lines so a test can rebuild the reference."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list = []

    def extend(self, turn, layer, q, k, v, history_len, scale, exact=None):
        out = super().extend(turn, layer, q, k, v, history_len, scale, exact)
        self.seen.append((turn.rid, select_lines(q, k, history_len, self.select, scale)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_extend_equals_dense_reference_on_its_lines(dtype):
    # Request 0: 40 new over a 30-token prefix (sparse); request 1: 5 new (exact).
    batch = Batch([30, 10], [40, 5], dtype=dtype)
    sp = _Recorder(PrefillConfig(mode="loopserve", min_tokens=16, max_density=1.0), 1,
                   hub=RequestHub(), select=SELECT)
    got = extend(sp, batch)
    assert not torch.isnan(got).any()
    assert (sp.stats.sparse_extends, sp.stats.exact_extends) == (1, 1)
    [(rid, lines)] = sp.seen
    assert rid == "r0"
    k, v = batch.k[batch.slots(0)], batch.v[batch.slots(0)]
    want = vslash_attention_ref(batch.q[:40], k, v, lines, 30, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:40].float(), want.float(), rtol=tol, atol=tol)
    dense = extend(None, batch)  # the short request took the exact call
    assert torch.equal(got[40:], dense[40:])
    st = sp.stats.layers[0]
    assert st.extends == 1 and 0 < st.density / st.extends <= 1


def test_below_min_tokens_is_bit_identical_to_exact():
    batch = Batch([12, 0, 3], [7, 9, 20], dtype=torch.bfloat16)
    sp = prefill(min_tokens=21)
    assert torch.equal(extend(sp, batch), extend(None, batch))
    assert (sp.stats.sparse_extends, sp.stats.exact_extends) == (0, 3)
    assert not sp.stats.layers


@pytest.mark.parametrize("prefix", [0, 10], ids=["fresh", "over-a-short-prefix"])
def test_positions_below_min_tokens_attend_densely_in_a_sparse_extend(prefix):
    """The KV a sparse extend writes for positions < min_tokens is what dense attention
    writes (the radix cache shares it with short prompts, which are served exactly:
    issue 48); the rows from min_tokens on attend the lines selected from them alone."""
    batch = Batch([prefix], [40 - prefix], dtype=torch.bfloat16)
    sp = _Recorder(PrefillConfig(mode="loopserve", min_tokens=16, max_density=1.0), 1,
                   hub=RequestHub(), select=SELECT)
    got = extend(sp, batch)
    head = 16 - prefix
    assert torch.equal(got[:head], extend(None, batch)[:head])
    assert sp.stats.sparse_extends == 1
    k, v = batch.k[batch.slots(0)], batch.v[batch.slots(0)]
    lines = select_lines(batch.q[head:], k, 16, SELECT, SCALE)
    want = vslash_attention_ref(batch.q[head:], k, v, lines, 16, SCALE)
    torch.testing.assert_close(got[head:].float(), want.float(), rtol=2e-2, atol=2e-2)
    # A prompt of exactly min_tokens has no row past it: the exact path, not counted sparse.
    whole = Batch([0], [16], dtype=torch.bfloat16)
    sp = prefill(min_tokens=16, max_density=1.0)
    assert torch.equal(extend(sp, whole), extend(None, whole))
    assert (sp.stats.sparse_extends, sp.stats.exact_extends) == (0, 1)


def _count_selections(monkeypatch) -> list:
    """Patch the prefill's select_lines to record each call; returns the record."""
    calls = []
    monkeypatch.setattr(prefill_mod, "select_lines",
                        lambda *a, **k: calls.append(1) or select_lines(*a, **k))
    return calls


def test_too_dense_layers_make_the_dense_call_and_skip_selection_until_reprobe(monkeypatch):
    batch = Batch([30], [40])
    dense = extend(None, batch)
    calls = _count_selections(monkeypatch)
    ended = []  # observe_extend calls: every extend ends, skipped last layer or not

    class Metrics:
        def observe_pass(self, sparse, exact):
            pass

        def observe_extend(self, density, select_s, seeded):
            ended.append(density)

    sp = prefill(max_density=1e-6, skip_density=1e-6)
    sp.metrics = Metrics()
    for _ in range(prefill_mod.REPROBE_EVERY + 1):
        # Over a cached prefix: the fused history + causal split, dense attention.
        torch.testing.assert_close(extend(sp, batch), dense, rtol=1e-4, atol=1e-5)
    # Selected once, found too dense, skipped 7 extends, re-selected at the 8th extend after.
    assert len(calls) == 2
    st = sp.stats.layers[0]
    assert st.dense == prefill_mod.REPROBE_EVERY + 1 and st.extends == 2
    assert len(ended) == prefill_mod.REPROBE_EVERY + 1
    fresh = Batch([0], [40])  # a fresh prompt: exact mode's very call
    assert torch.equal(extend(sp, fresh), extend(None, fresh))


def test_layers_above_skip_density_attend_their_lines_then_skip_selection(monkeypatch):
    """Selection paid: lines up to max_density; the next extends skip selection."""
    batch = Batch([30], [40])
    dense = extend(None, batch)
    calls = _count_selections(monkeypatch)
    sp = prefill(max_density=1.0, skip_density=1e-6)
    first = extend(sp, batch)
    k, v = batch.k[batch.slots(0)], batch.v[batch.slots(0)]
    lines = select_lines(batch.q, k, 30, SELECT, SCALE)
    want = vslash_attention_ref(batch.q, k, v, lines, 30, SCALE)
    torch.testing.assert_close(first, want.to(first.dtype), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, dense, rtol=1e-4, atol=1e-5)  # the lines, not dense
    torch.testing.assert_close(extend(sp, batch), dense, rtol=1e-4, atol=1e-5)
    assert len(calls) == 1 and sp.stats.layers[0].dense == 1
    sp_keep = prefill(max_density=1.0, skip_density=1.0)
    for _ in range(2):
        torch.testing.assert_close(extend(sp_keep, batch), first)
    assert len(calls) == 3  # skip_density 1: every extend selects


def test_lines_are_offered_after_the_last_layer_and_seed_the_next_turn():
    """Turn 1 (40 tokens) offers its lines once its last layer ran; the cache keeps
    them and seeds turn 2 (the same 40 cached + 30 new) with them; a release drops
    everything kept for the request."""
    hub = RequestHub()
    turn1 = Batch([0], [40], rids=["a"])
    sp = prefill(num_layers=2, hub=hub, max_density=1.0, skip_density=1.0)
    core = AttentionCore(Decoder(AttnShape(2, HEADS, KV_HEADS, DIM)), sp)
    plan = core.plan(turn1.view())
    out = torch.empty_like(turn1.q)
    core.run(plan, 0, turn1.q, turn1.k, turn1.v, out, SCALE)
    assert hub.take_lines("a", 40) is None  # not offered before the last layer
    core.run(plan, 1, turn1.q, turn1.k, turn1.v, out, SCALE)
    assert hub.take_lines("a", 39) is None  # the tree does not hold its tokens yet
    lines = hub.take_lines("a", 40)
    assert lines.end == 40 and sorted(lines.layers) == [0, 1]
    assert hub.take_lines("a", 40) is None  # taken once
    hub.set_seeds("b", lines)  # the cache: turn 2 ("b") continues turn 1's node
    turn2 = Batch([40], [30], rids=["b"])
    assert hub.seeds("b", 39) is None  # not over a prefix holding them; and read once
    hub.set_seeds("b", lines)
    assert hub.seeds("b", 40) is lines and hub.seeds("b", 40) is None
    hub.set_seeds("b", lines)
    extend(sp, turn2, layers=2)
    assert sp.stats.layers[0].seeded == 1 and sp.stats.layers[1].seeded == 1
    assert hub.take_lines("b", 70).end == 70
    assert len(hub) == 0  # turn 2's seeds were read, its lines taken
    hub.offer_lines("c", Lines(5, {}))
    hub.set_seeds("d", Lines(3, {}))
    assert len(hub) == 2
    hub.release("c"), hub.release("d")
    assert len(hub) == 0
    no_reuse = prefill(num_layers=2, hub=hub, reuse=False)
    hub.set_seeds("b", lines)
    extend(no_reuse, turn2, layers=2)
    assert no_reuse.stats.layers[0].seeded == 0 and hub.take_lines("b", 70) is None


def test_seeds_and_offers_are_bounded(monkeypatch):
    from sgl_spec import requests as mod

    monkeypatch.setattr(mod, "MAX_KEPT", 2)
    hub = RequestHub()
    for rid in "abc":  # "a" was matched in the queue and never released
        hub.set_seeds(rid, Lines(1, {}))
    assert len(hub) == 2 and hub.seeds("a", 5) is None and hub.seeds("c", 5) is not None
    hub.seeds("b", 5)
    for rid in "xyz":  # no tagged tree takes them (--disable-radix-cache)
        hub.offer_lines(rid, Lines(1, {}))
    assert len(hub) == 2 and hub.take_lines("x", 5) is None
    assert hub.take_lines("z", 5) is not None


def test_unread_seeds_expire_and_live_counts_every_structure():
    """A request matched in the queue and aborted there is never released: its seeds go
    after SEED_TTL passes; a request re-matched in the round of its extend keeps them."""
    from sgl_spec.requests import SEED_TTL

    hub, states = RequestHub(), {"r1": 0, "r2": 0}
    hub.add_live_source("decode_states", lambda: len(states))
    hub.set_seeds("aborted", Lines(1, {}))
    hub.offer_lines("r1", Lines(1, {}))
    assert hub.live() == {"prefill_lines_offered": 1, "prefill_seeds": 1, "decode_states": 2}
    for _ in range(SEED_TTL):
        hub.tick()
    hub.set_seeds("waiting", Lines(1, {}))  # matched again just before its extend
    hub.tick()
    assert hub.live()["prefill_seeds"] == 1 and hub.seeds("waiting", 5) is not None
    hub.release("r1")
    states.clear()
    assert hub.live() == {"prefill_lines_offered": 0, "prefill_seeds": 0, "decode_states": 0}
    assert len(hub) == 0


def test_release_listeners_are_called_once_each():
    hub, seen = RequestHub(), []
    hub.add_release_listener(seen.append)
    hub.add_release_listener(seen.append)  # idempotent
    hub.release("x")
    hub.remove_release_listener(seen.append)
    hub.release("y")
    assert seen == ["x"]


@pytest.fixture(scope="module")
def planted():
    return planted_qk(PLANT_N, PLANT_HIST, 9, 3, 64, PLANT_V, PLANT_S)


def test_good_seeds_are_kept_and_useless_seeds_rejected(planted):
    q, k = planted
    cfg = SelectConfig(alpha=0.955, **PLANT_CFG)
    plain = select_lines(q, k, PLANT_HIST, cfg)
    # Background columns carry below-uniform mass. (A useless slash is hard to
    # plant here: every offset crosses a planted column in some sampled row, where
    # the planted lines meet, and so does every new-token column.)
    useless = make_lines([[5, 6, 7, 60, 61]] * 3, [[]] * 3)
    seeded = select_lines(q, k, PLANT_HIST, cfg, seeds=useless)
    for h in range(3):  # below-uniform seeds are not taken: same selection
        assert torch.equal(seeded.vertical[h], plain.vertical[h])
        assert torch.equal(seeded.slash[h], plain.slash[h])
    good = make_lines([PLANT_V] * 3, [PLANT_S] * 3)
    seeded = select_lines(q, k, PLANT_HIST, cfg, seeds=good)
    assert (seeded.sampled_coverage >= 0.955 - 1e-6).all()
    for h in range(3):
        assert set(PLANT_V) <= set(seeded.vertical[h].tolist())
        assert set(PLANT_S) <= set(seeded.slash[h].tolist())
    with pytest.raises(ValueError, match="line heads"):
        select_lines(q, k, PLANT_HIST, cfg, seeds=make_lines([[1]], [[0]]))


def test_sparse_output_matches_vslash_with_selected_lines(planted):
    from sgl_spec.attention.prefill import Turn

    q, k = planted
    v = torch.randn_like(k)
    select = SelectConfig(alpha=0.955, **PLANT_CFG)
    sp = SparsePrefill(PrefillConfig(mode="loopserve", min_tokens=1), 1, hub=RequestHub(),
                       select=select)
    got = sp.extend(Turn("r", PLANT_HIST + PLANT_N, None, False), 0, q, k, v, PLANT_HIST, None,
                    exact=lambda: pytest.fail("the planted lines are sparse: no dense call"))
    lines = select_lines(q, k, PLANT_HIST, select)
    torch.testing.assert_close(got, vslash_attention(q, k, v, lines, PLANT_HIST))


def test_prefill_metrics_count_paths_density_and_seeds():
    from prometheus_client import REGISTRY

    from sgl_spec.attention.metrics import PrefillMetrics

    sp = prefill()
    sp.metrics = PrefillMetrics()
    batch = Batch([0, 0, 0], [40, 5, 3])
    extend(sp, batch)
    value = REGISTRY.get_sample_value
    assert value("sgl_spec:sparse_prefill_extends_total", {"path": "sparse"}) == 1
    assert value("sgl_spec:sparse_prefill_extends_total", {"path": "exact"}) == 2
    assert value("sgl_spec:sparse_prefill_density_count") == 1
    assert 0 < value("sgl_spec:sparse_prefill_density_sum") <= 1
    assert value("sgl_spec:sparse_prefill_select_seconds_total") > 0
    assert value("sgl_spec:sparse_prefill_seeded_extends_total") == 0


# --- the harness rows of sparse prefill (bench configs) ---


def test_sparse_prefill_config_set_rows():
    import os

    from sgl_spec.bench import configset

    cs = configset.load(os.path.join(configset.CONFIG_DIR, "sparse-prefill.toml"))
    names = [c.name for c in cs.configs]
    assert names == ["sgl_spec exact", "loopserve-prefill a=0.955", "loopserve-prefill a=0.97",
                     "loopserve-prefill a=0.98",
                     "loopserve-prefill a=0.98 + loopserve decode B=1024"]
    assert [c.reference for c in cs.configs] == [True, False, False, False, False]
    from sgl_spec.launch_server import split_argv

    cfg, rest = split_argv(list(cs.configs[4].flags))
    assert rest == [] and (cfg.prefill.mode, cfg.prefill.alpha, cfg.decode.mode,
                           cfg.decode.budget) == ("loopserve", 0.98, "loopserve", 1024)
    # The re-check set: two of the same rows (same flags, same plan).
    check = configset.load(os.path.join(configset.CONFIG_DIR, "sparse-prefill-check.toml"))
    full = {c.name: c for c in cs.configs}
    assert [c.name for c in check.configs] == ["sgl_spec exact", "loopserve-prefill a=0.97"]
    assert all(c.flags == full[c.name].flags and c.reference == full[c.name].reference
               for c in check.configs)
    assert check.plan == cs.plan
