"""Krul's estimator in the attention path (sgl_spec.attention.observe): the rows it
observes, folded on its worker or in line, equal the statistics of the same rows
computed from scratch; its per-request state is seeded, shared and freed; the tree
walk that gives a node its conversations' statistics."""

from types import SimpleNamespace

import pytest
import torch

from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.observe import KrulObserver, ObserveConfig, prefill_positions
from sgl_spec.krul.similarity import (Similarity, attention_rows, attention_rows_ref,
                                      ir_mass, reference_distances)

L, HQ, HKV, D = 4, 6, 2, 16


def test_grouped_rows_equal_the_repeated_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, HQ, D, generator=g).bfloat16()
    k = torch.randn(50, HKV, D, generator=g).bfloat16()
    pos = torch.tensor([4, 30, 49])
    torch.testing.assert_close(attention_rows(q, k, pos, 0.3),
                               attention_rows_ref(q, k, pos, 0.3), rtol=1e-5, atol=1e-6)
    assert float(attention_rows(q, k, pos)[0, :, 5:].abs().sum()) == 0.0   # causal


def test_prefill_positions_are_the_last_half_and_a_seeded_draw():
    pos = prefill_positions("r1", 100, 40, 8)
    assert pos == sorted(set(pos)) and len(pos) == 8
    assert pos[-4:] == [136, 137, 138, 139] and all(100 <= p < 140 for p in pos)
    assert pos == prefill_positions("r1", 100, 40, 8)
    assert prefill_positions("r1", 0, 3, 8) == [0, 1, 2]         # fewer tokens than rows
    assert prefill_positions("r1", 7, 1, 8) == [7]


class Pool:
    """Four layers of a KV pool, with two requests' rows in req_to_token."""

    def __init__(self, n_slots=200, seed=1, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(L, n_slots, HKV, D, generator=g).to(device)
        perm = torch.randperm(n_slots, generator=g)
        self.req_to_token = torch.stack([perm[:100], perm[100:]]).int().to(device)


def passes(pool, g):
    """An extend of two requests (one over a 20-token prefix), then decode steps."""
    device = pool.k.device

    def dev(seq):
        return dict(seq_lens=seq, pool_rows=(0, 1), req_to_token=pool.req_to_token,
                    rows=torch.tensor([0, 1], device=device),
                    seq_lens_t=torch.tensor(seq, device=device))

    out = [BatchView("extend", rids=("a", "b"), extend_lens=(30, 25), **dev((30, 45)))]
    for n in (47, 48, 63, 64):
        out.append(BatchView("decode", rids=("a", "b"), **dev((n - 15, n))))
    return [(b, torch.randn(sum(b.extend_lens) if b.mode == "extend" else b.size, HQ, D,
                            generator=g).to(device)) for b in out]


def play(obs: KrulObserver, pool: Pool, seed=2):
    """Runs the passes through ``obs``; returns, per rid, the rows it should have seen."""
    g = torch.Generator().manual_seed(seed)
    expect = {"a": [[] for _ in range(L)], "b": [[] for _ in range(L)]}
    for batch, q in passes(pool, g):
        plan = obs.plan(batch)
        if plan is None:
            continue
        for layer in range(L):
            def keys(i, layer=layer, batch=batch):
                return pool.k[layer].index_select(0, batch.req_to_token[i, :batch.seq_lens[i]].long())
            obs.run(plan, layer, q, pool.k[layer], 0.25, keys)
            for ob in plan.items:
                k = keys(ob.index)
                rows = attention_rows_ref(q[ob.q_idx.to(q.device)], k, ob.q_pos.to(q.device),
                                          0.25)
                expect[ob.rid][layer].append((rows.cpu(), ob.q_pos.cpu()))
    if obs.folder is not None:
        obs.folder.drain()
    return expect


def reference(rows_per_layer) -> tuple[torch.Tensor, torch.Tensor]:
    """cdist of the layers' concatenated rows and the mean I-R mass."""
    maps = [torch.cat([r.reshape(-1) for r, _ in layer]) for layer in rows_per_layer]
    count = sum(r.shape[0] * r.shape[1] for r, _ in rows_per_layer[0])
    flat = torch.stack(maps).double()
    dist = torch.cdist(flat, flat) / count ** 0.5
    ir = torch.stack([sum(ir_mass(r, p).double().sum() for r, p in layer) / count
                      for layer in rows_per_layer])
    return dist, ir


@pytest.mark.parametrize("cfg", [ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1, worker=True),
                                 ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1, worker=False),
                                 ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1, worker=True,
                                               max_queued_bytes=0)],
                         ids=["worker", "inline", "over-the-bound"])
def test_observed_statistics_equal_the_rows_computed_from_scratch(cfg):
    pool = Pool()
    obs = KrulObserver(L, cfg)
    expect = play(obs, pool)
    for rid in ("a", "b"):
        sim = obs.stats(rid)
        dist, ir = reference(expect[rid])
        # the Gram is folded in float32 (a row has m x Hq x n values)
        torch.testing.assert_close(sim.distances(), dist, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(sim.ir_share(), ir, rtol=1e-5, atol=1e-7)
    # each: an extend (4 rows) and the decode steps at lengths 32, 48 (a) and 48, 64 (b)
    assert obs.stats("a").observed() == obs.stats("b").observed() == (4 + 2) * HQ
    assert obs.rows == {"prefill": 8 * HQ, "decode": 4 * HQ}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_rows_are_computed_on_the_gpu_and_folded_by_the_worker():
    """As served beside a GPU model: the rows come from CUDA tensors, the prefill folds
    go to the worker thread (the default there), and the statistics are the same."""
    pool = Pool(device="cuda")
    obs = KrulObserver(L, ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1), device="cuda")
    assert obs.folder is not None
    expect = play(obs, pool)
    for rid in ("a", "b"):
        dist, ir = reference(expect[rid])
        torch.testing.assert_close(obs.stats(rid).distances(), dist, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(obs.stats(rid).ir_share(), ir, rtol=1e-5, atol=1e-7)
    assert obs.folder.seconds > 0 and obs.folder.queued_bytes == 0


def test_an_extend_observes_one_row_per_tokens_per_row_new_tokens():
    """A short follow-up over a long history observes no row (its accumulator still
    carries the conversation's sums); a 600-token turn 4; a long prefill its 8."""
    obs = KrulObserver(L, ObserveConfig(worker=False))
    r2t = torch.arange(5000).int()[None]

    def rows_of(history, new):
        b = BatchView("extend", rids=("a",), extend_lens=(new,), seq_lens=(history + new,),
                      pool_rows=(0,), req_to_token=r2t, rows=torch.tensor([0]),
                      seq_lens_t=torch.tensor([history + new]))
        plan = obs.plan(b)
        return 0 if plan is None else len(plan.items[0].q_pos)

    assert rows_of(4096, 30) == 0 and obs.stats("a") is not None
    assert rows_of(4096, 128) == 1 and rows_of(0, 600) == 4 and rows_of(0, 4096) == 8
    with pytest.raises(ValueError, match="must be positive"):
        ObserveConfig(tokens_per_row=0)


def test_state_is_seeded_shared_and_freed():
    pool = Pool()
    obs = KrulObserver(L, ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1, worker=False))
    earlier = Similarity(L)
    earlier.gram += 1.0
    earlier.rows += 7
    obs.seed("a", earlier)                   # the conversation's earlier turns
    assert obs.live_states == 1
    play(obs, pool)
    a = obs.stats("a")
    assert a is obs.stats("a")               # shared, not a copy (the tree's payload)
    assert float(a.rows[0]) == 7 + 6 * HQ and float(earlier.rows[0]) == 7   # seed copied
    obs.seed("a", earlier)                   # a match of a request already observed
    assert obs.stats("a") is a
    obs.release("a")
    obs.release("b")
    obs.seed("c", earlier)
    obs.release("c")                         # matched, then aborted
    assert obs.live_states == 0 and obs.stats("a") is None
    assert float(a.rows[0]) == 7 + 6 * HQ    # the payload keeps its sums


def test_the_same_rows_with_the_core_in_the_middle():
    """AttentionCore.plan/run hand the observer every layer of an exact pass."""
    from sgl_spec.attention.core import AttentionCore
    from sgl_spec.attention.decode import Decoder
    from sgl_spec.sparse.policy import AttnShape

    pool = Pool()
    shape = AttnShape(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                      kv_dtype=torch.float32)
    cfg = ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1, worker=False)
    obs = KrulObserver(L, cfg)
    core = AttentionCore(Decoder(shape, None), observer=obs)
    direct = KrulObserver(L, cfg)
    play(direct, pool)
    g = torch.Generator().manual_seed(2)
    v = torch.randn_like(pool.k)
    for batch, q in passes(pool, g):
        plan = core.plan(batch)
        for layer in range(L):
            core.run(plan, layer, q, pool.k[layer], v[layer], torch.empty_like(q), 0.25)
    for rid in ("a", "b"):
        torch.testing.assert_close(obs.stats(rid).gram, direct.stats(rid).gram)


def node(parent=None, stats=None, key_len=4):
    n = SimpleNamespace(children={}, parent=parent, key=[0] * key_len,
                        spec=SimpleNamespace(payloads=None))
    if stats is not None:
        n.spec.payloads = {"krul_stats": (key_len, stats)}
    if parent is not None:
        parent.children[len(parent.children)] = n
    return n


def sim_of(value: float) -> Similarity:
    s = Similarity(2)
    s.gram += value
    s.rows += 1
    return s


def test_a_node_reads_the_deepest_statistics_of_each_branch_below_it():
    from sgl_spec.integration.tiers.krul import conversation_stats

    root = node()
    doc = node(root)                                  # a shared document
    t1 = node(doc, sim_of(1.0))                       # conversation A, turn 1
    node(t1, sim_of(3.0))                             # ... turn 2 (sums include turn 1's)
    node(doc, sim_of(10.0))                           # conversation B
    assert float(conversation_stats(doc).gram[0, 0]) == 13.0
    assert float(conversation_stats(t1).gram[0, 0]) == 3.0
    lone = node(t1)                                   # nothing below: the deepest above
    assert float(conversation_stats(lone).gram[0, 0]) == 1.0
    assert conversation_stats(node(node())) is None


def test_reference_distances_of_observed_rows():
    """The estimator's distance is the cdist of the flattened maps (krul.similarity)."""
    g = torch.Generator().manual_seed(3)
    maps = [torch.softmax(torch.randn(2, HQ, 9, generator=g), -1) for _ in range(3)]
    sim = Similarity(3)
    with sim.step() as st:
        for layer, m in enumerate(maps):
            st.add(layer, m, torch.tensor([8, 8]))
    torch.testing.assert_close(sim.distances(), reference_distances(maps), rtol=1e-4, atol=1e-6)


def test_folds_run_in_line_on_a_cpu_host_and_on_a_worker_beside_a_gpu():
    assert KrulObserver(L).folder is None
    assert KrulObserver(L, device="cuda").folder is not None   # no GPU needed to build it
    assert KrulObserver(L, ObserveConfig(worker=True)).folder is not None
    with pytest.raises(ValueError, match="positive"):
        ObserveConfig(prefill_rows=0)


def test_a_one_token_extend_counts_as_a_decode_step():
    """A mixed batch's decode rows arrive as one-token extends: every decode_every-th only."""
    pool = Pool()
    obs = KrulObserver(L, ObserveConfig(prefill_rows=4, decode_every=16, tokens_per_row=1))
    kw = dict(pool_rows=(0, 1), req_to_token=pool.req_to_token, rows=torch.tensor([0, 1]))
    plan = obs.plan(BatchView("extend", rids=("a", "b"), seq_lens=(33, 48), extend_lens=(1, 1),
                              seq_lens_t=torch.tensor([33, 48]), **kw))
    assert [ob.rid for ob in plan.items] == ["b"] and plan.items[0].q_pos.tolist() == [47]
    assert int(plan.items[0].q_idx) == 1                   # b's row of the pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_read_in_place_equal_the_gathered_reference(dtype):
    """On a CPU host the observed rows come from the C++ kernel reading keys in place (the
    default model's 9 query / 3 KV heads x 64): causal extend rows and a decode row equal
    the float64 rows over the gathered keys, zero past each position."""
    from sgl_spec.attention.observe import Observed, _rows_in_place
    from sgl_spec.kernels.sparse_decode.cpu_impl import load_kernel

    if load_kernel() is None:
        pytest.skip("the C++ decode kernel does not build here")
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, n = 9, 3, 64, 300
    k_buf = torch.randn(512, hkv, d, generator=g).to(dtype)
    req_to_token = torch.zeros(3, 400, dtype=torch.int32)
    req_to_token[2, :n] = torch.randperm(512, generator=g)[:n].int()
    keys = k_buf[req_to_token[2, :n].long()]
    for pos in (torch.tensor([7, 150, 298, 299]), torch.tensor([299])):
        q = torch.randn(len(pos), hq, d, generator=g).bfloat16()
        ob = Observed("r", 0, torch.arange(len(pos)), pos, False, False, None, 2, n)
        got = _rows_in_place(q, k_buf, req_to_token, ob, 0.125)
        assert got is not None and got.shape == (len(pos), hq, n)
        torch.testing.assert_close(got, attention_rows_ref(q, keys, pos, 0.125),
                                   rtol=1e-4, atol=1e-6)
        assert float(got[0, :, int(pos[0]) + 1:].abs().sum()) == 0.0
    ob = Observed("r", 0, torch.arange(1), torch.tensor([5]), True, False, None, 2, n)
    assert _rows_in_place(q[:1], k_buf, None, ob, 0.125) is None   # no pool rows: gather
