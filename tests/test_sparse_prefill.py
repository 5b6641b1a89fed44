"""LoopServe sparse prefill: backend extend, line store, seeded selection (no server)."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.attention.backend import SpecAttnBackend
from sgl_spec.attention.line_store import LineStore, fingerprint
from sgl_spec.attention.sparse_prefill import SparsePrefill
from sgl_spec.kernels.vslash import SelectConfig, make_lines, select_lines, vslash_attention
from sgl_spec.kernels.vslash.reference import vslash_attention_ref
from tests.test_attention_exact import _make_batch
from tests.test_vslash_kernels import PLANT_CFG, PLANT_HIST, PLANT_N, PLANT_S, PLANT_V, planted_qk

SCALE = 0.25
CFG = SelectConfig(alpha=0.9, local=4, sink=2, last_q=8, strided_q=8)


def _backend(prefill: SparsePrefill | None, layer: int | None = 0) -> SpecAttnBackend:
    b = object.__new__(SpecAttnBackend)  # the extend path reads no other state
    b.sparse_prefill = prefill
    b._prefill_layer = layer
    return b


def _extend(backend, batch) -> torch.Tensor:
    out = torch.full_like(batch["query"], float("nan"))  # poisoned: all must be written
    args = dict(batch)
    q = args.pop("query")
    backend._run_sdpa_forward_extend(
        q, out, args["k_cache"], args["v_cache"], args["req_to_token"],
        args["req_pool_indices"], args["seq_lens"], args["extend_prefix_lens"],
        args["extend_seq_lens"], None, scaling=SCALE, enable_gqa=True, causal=True,
    )
    return out


class _Recorder(SparsePrefill):
    """Keeps every layer's lines so a test can rebuild the reference."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list = []

    def extend(self, layer, index, slots, q, k, v, history_len, scale, key_cache, exact=None):
        out = super().extend(layer, index, slots, q, k, v, history_len, scale, key_cache, exact)
        self.seen.append((index, select_lines(q, k, history_len, self.select, scale)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_extend_equals_dense_reference_on_its_lines(dtype):
    # Request 0: 40 new over a 30-token prefix (sparse); request 1: 5 new (exact).
    batch = _make_batch([30, 10], [40, 5], heads=6, kv_heads=2, dim=16, dtype=dtype)
    sp = _Recorder(CFG, min_tokens=16, num_layers=1, max_density=1.0)
    sp.begin_pass([40, 5])
    got = _extend(_backend(sp), batch)
    assert not torch.isnan(got).any()
    assert (sp.stats.sparse_extends, sp.stats.exact_extends) == (1, 1)
    [(index, lines)] = sp.seen
    assert index == 0
    slots = batch["req_to_token"][1, :70]
    k, v = batch["k_cache"][slots], batch["v_cache"][slots]
    want = vslash_attention_ref(batch["query"][:40], k, v, lines, 30, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:40].float(), want.float(), rtol=tol, atol=tol)
    dense = _extend(_backend(None), batch)  # the short request took the exact call
    assert torch.equal(got[40:], dense[40:])
    st = sp.stats.layers[0]
    assert st.extends == 1 and 0 < st.density / st.extends <= 1


def test_below_min_tokens_is_bit_identical_to_exact():
    batch = _make_batch([12, 0, 3], [7, 9, 20], dtype=torch.bfloat16)
    sp = SparsePrefill(CFG, min_tokens=21, num_layers=1)
    sp.begin_pass([7, 9, 20])
    assert torch.equal(_extend(_backend(sp), batch), _extend(_backend(None), batch))
    assert (sp.stats.sparse_extends, sp.stats.exact_extends) == (0, 3)
    assert not sp.stats.layers


def _count_selections(monkeypatch) -> list:
    """Patch the prefill's select_lines to record each call; returns the record."""
    from sgl_spec.attention import sparse_prefill as mod

    calls = []
    monkeypatch.setattr(mod, "select_lines",
                        lambda *a, **k: calls.append(1) or select_lines(*a, **k))
    return calls


def test_too_dense_layers_make_the_dense_call_and_skip_selection_until_reprobe(monkeypatch):
    from sgl_spec.attention import sparse_prefill as mod

    batch = _make_batch([30], [40], heads=6, kv_heads=2, dim=16)
    dense = _extend(_backend(None), batch)
    calls = _count_selections(monkeypatch)
    ended = []  # observe_extend calls: every extend ends, skipped last layer or not

    class Metrics:
        def observe_pass(self, sparse, exact):
            pass

        def observe_extend(self, density, select_s, seeded):
            ended.append(density)

    sp = SparsePrefill(CFG, min_tokens=16, num_layers=1, max_density=1e-6, skip_density=1e-6,
                       metrics=Metrics())
    for _ in range(mod.REPROBE_EVERY + 1):
        sp.begin_pass([40])
        # Over a cached prefix: the fused history + causal split, dense attention.
        torch.testing.assert_close(_extend(_backend(sp), batch), dense, rtol=1e-4, atol=1e-5)
    # Selected once, found too dense, skipped 7 extends, re-selected at the 8th extend after.
    assert len(calls) == 2
    st = sp.stats.layers[0]
    assert st.dense == mod.REPROBE_EVERY + 1 and st.extends == 2
    assert len(ended) == mod.REPROBE_EVERY + 1
    fresh = _make_batch([0], [40], heads=6, kv_heads=2, dim=16)
    sp.begin_pass([40])  # a fresh prompt: exact mode's very call
    assert torch.equal(_extend(_backend(sp), fresh), _extend(_backend(None), fresh))
    with pytest.raises(ValueError, match="max_density"):
        SparsePrefill(CFG, min_tokens=1, num_layers=1, max_density=0)
    with pytest.raises(ValueError, match="skip_density"):
        SparsePrefill(CFG, min_tokens=1, num_layers=1, skip_density=1.5)


def test_layers_above_skip_density_attend_their_lines_then_skip_selection(monkeypatch):
    """Selection paid: lines up to max_density; the next extends skip selection."""
    batch = _make_batch([30], [40], heads=6, kv_heads=2, dim=16)
    dense = _extend(_backend(None), batch)
    calls = _count_selections(monkeypatch)
    sp = SparsePrefill(CFG, min_tokens=16, num_layers=1, max_density=1.0, skip_density=1e-6)
    sp.begin_pass([40])
    first = _extend(_backend(sp), batch)
    slots = batch["req_to_token"][batch["req_pool_indices"][0], :70]
    k, v = batch["k_cache"][slots], batch["v_cache"][slots]
    lines = select_lines(batch["query"], k, 30, CFG, SCALE)
    want = vslash_attention_ref(batch["query"], k, v, lines, 30, SCALE)
    torch.testing.assert_close(first, want.to(first.dtype), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first, dense, rtol=1e-4, atol=1e-5)  # the lines, not dense
    sp.begin_pass([40])
    torch.testing.assert_close(_extend(_backend(sp), batch), dense, rtol=1e-4, atol=1e-5)
    assert len(calls) == 1 and sp.stats.layers[0].dense == 1
    sp_keep = SparsePrefill(CFG, min_tokens=16, num_layers=1, max_density=1.0, skip_density=1.0)
    for _ in range(2):
        sp_keep.begin_pass([40])
        torch.testing.assert_close(_extend(_backend(sp_keep), batch), first)
    assert len(calls) == 3  # skip_density 1: every extend selects


def test_no_layer_id_means_exact():
    batch = _make_batch([0], [40])
    sp = SparsePrefill(CFG, min_tokens=1, num_layers=1)
    assert torch.equal(_extend(_backend(sp, layer=None), batch), _extend(_backend(None), batch))


def _slots_and_keys(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(n + 10, 2, 4, generator=g).to(torch.bfloat16)
    slots = torch.randperm(n + 10, generator=g)[:n].to(torch.int32)
    return slots, key_cache


def _lines(tag: int):
    return {0: make_lines([[0, tag]], [[0]])}


def test_line_store_finds_the_longest_stored_prefix():
    slots, kc = _slots_and_keys(50)
    store = LineStore(capacity=4)
    store.put(fingerprint(slots, 20, kc), _lines(1))
    store.put(fingerprint(slots, 30, kc), _lines(2))
    assert store.lookup(slots, 29, kc)[0].vertical[0].tolist() == [0, 1]
    assert store.lookup(slots, 45, kc)[0].vertical[0].tolist() == [0, 2]
    assert store.lookup(slots, 19, kc) is None
    # Same slots, different key content (a freed and reallocated slot run): no match.
    other = kc.clone()
    other[slots[25:30].long()] += 1
    assert store.lookup(slots, 45, other)[0].vertical[0].tolist() == [0, 1]
    assert (store.hits, store.misses) == (3, 1)


def test_line_store_is_bounded_lru():
    store = LineStore(capacity=2)
    seqs = [_slots_and_keys(40, seed=s) for s in range(3)]
    for i, (slots, kc) in enumerate(seqs):
        store.put(fingerprint(slots, 40, kc), _lines(i + 1))
    assert len(store) == 2
    assert store.lookup(*seqs[0][:1], 40, seqs[0][1]) is None  # evicted first
    assert store.lookup(seqs[2][0], 40, seqs[2][1]) is not None
    assert store.nbytes() > 0
    store.clear()
    assert len(store) == 0 and store.lookup(seqs[2][0], 40, seqs[2][1]) is None
    with pytest.raises(ValueError, match="capacity"):
        LineStore(capacity=0)


def test_sparse_prefill_stores_after_last_layer_and_seeds_the_next_turn():
    # Turn 1: 40 tokens, no prefix; turn 2: the same 40 cached + 30 new.
    batch = _make_batch([0], [70], heads=6, kv_heads=2, dim=16)
    slots = batch["req_to_token"][1, :70]
    kc, vc, q = batch["k_cache"], batch["v_cache"], batch["query"]
    store = LineStore()
    sp = SparsePrefill(CFG, min_tokens=16, num_layers=2, store=store)
    sp.begin_pass([40])
    for layer in (0, 1):
        sp.extend(layer, 0, slots[:40], q[:40], kc[slots[:40]], vc[slots[:40]], 0, SCALE, kc)
    assert len(store) == 1
    sp.begin_pass([30])
    for layer in (0, 1):
        sp.extend(layer, 0, slots, q[40:], kc[slots], vc[slots], 40, SCALE, kc)
    assert store.hits == 1 and sp.stats.layers[1].seeded == 1
    assert len(store) == 2  # turn 2 stored too
    no_reuse = SparsePrefill(CFG, min_tokens=16, num_layers=2)
    no_reuse.begin_pass([30])
    no_reuse.extend(0, 0, slots, q[40:], kc[slots], vc[slots], 40, SCALE, kc)
    assert no_reuse.stats.layers[0].seeded == 0


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
    q, k = planted
    v = torch.randn_like(k)
    sp = SparsePrefill(SelectConfig(alpha=0.955, **PLANT_CFG), min_tokens=1, num_layers=1)
    slots = torch.arange(PLANT_HIST + PLANT_N, dtype=torch.int32)
    got = sp.extend(0, 0, slots, q, k, v, PLANT_HIST, None, k)
    lines = select_lines(q, k, PLANT_HIST, sp.select)
    torch.testing.assert_close(got, vslash_attention(q, k, v, lines, PLANT_HIST))


# --- the harness rows of sparse prefill (bench configs) and its /metrics counters ---


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
    assert rest == [] and (cfg.prefill, cfg.prefill_alpha, cfg.mode, cfg.budget) == (
        "loopserve", 0.98, "loopserve", 1024)
    # The re-check set: two of the same rows (same flags, same plan).
    check = configset.load(os.path.join(configset.CONFIG_DIR, "sparse-prefill-check.toml"))
    full = {c.name: c for c in cs.configs}
    assert [c.name for c in check.configs] == ["sgl_spec exact", "loopserve-prefill a=0.97"]
    assert all(c.flags == full[c.name].flags and c.reference == full[c.name].reference
               for c in check.configs)
    assert check.plan == cs.plan


def test_prefill_metrics_count_paths_density_and_seeds():
    from prometheus_client import REGISTRY

    from sgl_spec.attention.metrics import PrefillMetrics

    m = PrefillMetrics()
    sp = SparsePrefill(CFG, min_tokens=16, num_layers=1, metrics=m, store=LineStore())
    sp.begin_pass([40, 5, 3])
    batch = _make_batch([0], [40], heads=6, kv_heads=2, dim=16)
    slots = batch["req_to_token"][1, :40]
    kc = batch["k_cache"]
    sp.extend(0, 0, slots, batch["query"], kc[slots], batch["v_cache"][slots], 0, SCALE, kc)
    value = REGISTRY.get_sample_value
    assert value("sgl_spec:sparse_prefill_extends_total", {"path": "sparse"}) == 1
    assert value("sgl_spec:sparse_prefill_extends_total", {"path": "exact"}) == 2
    assert value("sgl_spec:sparse_prefill_density_count") == 1
    assert 0 < value("sgl_spec:sparse_prefill_density_sum") <= 1
    assert value("sgl_spec:sparse_prefill_select_seconds_total") > 0
    assert value("sgl_spec:sparse_prefill_seeded_extends_total") == 0
