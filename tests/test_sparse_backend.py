"""Sparse decode in the serving path: the Decoder's plan/run on a fake KV pool (no
server), the integration's ForwardBatch view, and real servers in loopserve mode.

Fake pools scatter each request's positions over random slots and NaN-poison every
slot no request owns, so reading outside a request's history gives NaN.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from _aborts import abort_streams, live_requests, wait_until_freed
from _sparse import SHAPE, FakePool, decode_step
from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.core import AttentionCore
from sgl_spec.attention.decode import Decoder
from sgl_spec.bench.server import SPEC
from sgl_spec.config import DecodeConfig
from sgl_spec.kernels.sparse_decode import DecodeSubsets
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference
from sgl_spec.sparse import Kind, get_policy

CFG = DecodeConfig(budget=8, sink=2, window=4, nd=4, first_select_step=4, min_context=32)
SCALE = SHAPE.sm_scale


def decoder(name: str, cfg: DecodeConfig = CFG, **kw) -> Decoder:
    return Decoder(SHAPE, get_policy(name, cfg, SHAPE), **kw)


def view(pool: FakePool, rids, rows, mode="decode", extend_lens=(), final=True) -> BatchView:
    seq = [pool.lens[r] for r in rows]
    return BatchView(mode, tuple(rids), tuple(seq), tuple(rows), tuple(extend_lens), final,
                     pool.req_to_token, torch.tensor(rows), torch.tensor(seq))


def run_layer(dec, plan, pool, q, layer):
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    dec.run(plan, layer, q, pool.k[layer], pool.v[layer], out, SCALE)
    return out


def full_attention(pool, layer, row, q):  # [Hq, D]: softmax over the whole history
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    slots = pool.req_to_token[row, : pool.lens[row]].long()
    k = pool.k[layer][slots].repeat_interleave(g, 1)
    v = pool.v[layer][slots].repeat_interleave(g, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k.double()) * SCALE, -1)
    return torch.einsum("hl,lhd->hd", p, v.double()).to(q.dtype)


def subset_attention(pool, layer, row, q, sel, recent_start, sink=CFG.sink):
    sub = DecodeSubsets(pool.req_to_token, torch.tensor([row]), torch.tensor([pool.lens[row]]),
                        sel[None], torch.full((1, SHAPE.num_kv_heads), sel.shape[1]),
                        torch.tensor([recent_start]), sink)
    return sparse_decode_reference(q[None], pool.k[layer], pool.v[layer], sub, scale=SCALE)[0]


# ------------------------------------------------------------------ decoder vs policy


def test_decoder_matches_policy_and_reference_kernel():
    """Rows, reselection keys and pool rows reach the policy and the kernel intact:
    each row of the decoder's one kernel call equals a directly driven twin policy's
    subset through the per-head reference (dense rows: full attention)."""
    dec = decoder("loopserve")
    twin = get_policy("loopserve", CFG, SHAPE)
    pool = FakePool()
    rids, rows, prompts = ["long", "short", "mid"], [3, 0, 5], [100, 20, 60]
    for rid, row, n in zip(rids, rows, prompts):
        pool.append(row, n)
        twin.start(rid, n)
    kinds = {rid: set() for rid in rids}
    for step in range(10):
        for row in rows:
            pool.append(row)  # the current token's K/V, written before attention
        plan = dec.plan(view(pool, rids, rows))
        qs = [torch.randn(len(rows), SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
              for _ in range(SHAPE.num_layers)]
        steps = [decode_step(twin, rid, pool.lens[row], lambda layer, b=b: qs[layer][b],
                             lambda layer, row=row: pool.history(layer, row))
                 for b, (rid, row) in enumerate(zip(rids, rows))]
        for layer in range(SHAPE.num_layers):
            out = run_layer(dec, plan, pool, qs[layer], layer)
            for b, (rid, row) in enumerate(zip(rids, rows)):
                r, sels = steps[b]
                kinds[rid].add(r.kind)
                if r.kind == Kind.SPARSE:
                    want = subset_attention(pool, layer, row, qs[layer][b], sels[layer],
                                            r.recent_start)
                else:
                    want = full_attention(pool, layer, row, qs[layer][b])
                torch.testing.assert_close(out[b], want, rtol=1e-4, atol=1e-5)
    # Selections at steps 4 and 8; "short" (21..30 positions) stays under min_context
    # (its last steps keep their queries for a selection at 32 positions and more).
    assert kinds == {"long": {Kind.OBSERVE, Kind.SPARSE}, "mid": {Kind.OBSERVE, Kind.SPARSE},
                     "short": {Kind.EXACT, Kind.OBSERVE}}
    assert dec.stats.reselections == 4
    assert dec.stats.sparse_steps == 2 * 6 and dec.stats.exact_steps == 3 * 10 - 12
    for rid in rids:
        dec.release(rid)
    assert dec.live_states == 0 and len(dec.policy.slots) == 0


class _PassLog:
    def __init__(self):
        self.seen: list[tuple[str, float]] = []

    def observe_pass(self, path: str, seconds: float) -> None:
        self.seen.append((path, seconds))


@pytest.mark.parametrize("mode", ["exact", "loopserve"])
def test_decode_passes_are_timed_by_path(mode):
    """Each decode pass is reported once the next decode pass plans, under what its
    attention did (loopserve with CFG: dense to step 3, a selection at steps 4 and 8,
    sparse between); a pass followed by an extend, or by any other pass, is not."""
    log = _PassLog()
    dec = Decoder(SHAPE, None if mode == "exact" else get_policy(mode, CFG, SHAPE),
                  pass_metrics=log)
    pool = FakePool()
    pool.append(0, 100)
    for _ in range(10):
        pool.append(0)
        dec.plan(view(pool, ["r"], [0]))
    paths = [p for p, _ in log.seen]
    want = (["exact"] * 9 if mode == "exact" else
            ["exact"] * 4 + ["reselect"] + ["sparse"] * 3 + ["reselect"])
    assert paths == want and all(sec >= 0 for _, sec in log.seen)
    pool.append(1, 5)
    dec.plan_extend(view(pool, ["s"], [1], mode="extend", extend_lens=(5,)))
    pool.append(0)
    dec.plan(view(pool, ["r"], [0]))
    assert len(log.seen) == 9  # the pass before the extend: not timed
    pool.append(0)
    dec.plan(view(pool, ["r"], [0]))
    dec.pass_ended()  # e.g. an idle pass
    pool.append(0)
    dec.plan(view(pool, ["r"], [0]))
    assert len(log.seen) == 10
    assert Decoder(SHAPE).pass_metrics is None  # off unless given


def test_a_contiguous_history_is_scored_in_place():
    """One reselecting row whose slots are one run: scoring reads the pool's slice (no
    gather) and selects what a twin policy fed the gathered keys selects."""
    dec = decoder("loopserve")
    twin = get_policy("loopserve", CFG, SHAPE)
    pool = FakePool(contiguous=True)
    pool.append(0, 100)
    twin.start("r", 100)
    for step in range(5):
        pool.append(0)
        plan = dec.plan(view(pool, ["r"], [0]))
        qs = [torch.randn(1, SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
              for _ in range(SHAPE.num_layers)]
        r, sels = decode_step(twin, "r", pool.lens[0], lambda layer: qs[layer][0],
                              lambda layer: pool.history(layer, 0))
        for layer in range(SHAPE.num_layers):
            run_layer(dec, plan, pool, qs[layer], layer)
    assert r.reselect and isinstance(plan.reselect[2], slice)
    for layer in range(SHAPE.num_layers):
        got = dec.policy.selection(layer, torch.tensor([dec.policy.state("r").slot]))
        assert torch.equal(got[0], sels[layer])


def test_decoder_rejects_unknown_impl():
    with pytest.raises(ValueError, match="valid: cpu, torch, triton, flashinfer"):
        decoder("loopserve", impl="cuda")


def _planted(dirs, planted, noise_gen):
    def keys(layer, pos):
        if pos in planted[layer]:
            return 6.0 * dirs
        return 0.1 * torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=noise_gen)
    return keys


def test_decoder_approximates_dense_attention_when_mass_is_selectable():
    """With attention concentrated on a few keys far from the sink and the window,
    loopserve's selection finds them and sparse decode matches dense attention."""
    dec = decoder("loopserve", dataclasses.replace(CFG, budget=6))
    pool = FakePool(seed=1)
    d = torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=pool.gen)
    dirs = d / d.norm(dim=-1, keepdim=True)
    planted = {0: {17, 40, 77}, 1: {9, 55, 120}}
    pool.append(2, 200, keys=_planted(dirs, planted, pool.gen))
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    for step in range(8):
        pool.append(2, keys=_planted(dirs, planted, pool.gen))
        plan = dec.plan(view(pool, ["r"], [2]))
        for layer in range(SHAPE.num_layers):
            # logit 12 on the planted keys, against ~0 for the noise
            q = (2.0 / SCALE * dirs.repeat_interleave(g, 0))[None]  # [1, Hq, D]
            out = run_layer(dec, plan, pool, q, layer)
            torch.testing.assert_close(out[0], full_attention(pool, layer, 2, q[0]),
                                       rtol=0, atol=5e-3)
    # Steps 0..3 attend in full (before the first selection), steps 4..7 sparsely.
    assert (dec.stats.exact_steps, dec.stats.sparse_steps) == (4, 4)


# ------------------------------------------------------------------ exact fallback, lifetime


def test_all_rows_exact_below_min_context_or_when_budget_covers():
    for cfg in (dataclasses.replace(CFG, min_context=10_000),
                dataclasses.replace(CFG, min_context=0, budget=4096)):
        dec = decoder("loopserve", cfg)
        exact = Decoder(SHAPE)  # exact mode
        pool = FakePool()
        pool.append(0, 150)
        pool.append(1, 40)
        for _ in range(9):
            pool.append(0), pool.append(1)
            plan = dec.plan(view(pool, ["a", "b"], [0, 1]))
            assert plan.sparse is None and plan.observe is None and plan.subsets.dense
            ref = exact.plan(view(pool, ["a", "b"], [0, 1]))
            for layer in range(SHAPE.num_layers):
                q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim)
                # exact mode's very call: the same output bit for bit
                assert torch.equal(run_layer(dec, plan, pool, q, layer),
                                   run_layer(exact, ref, pool, q, layer))
        assert (dec.stats.sparse_steps, dec.stats.exact_steps, dec.stats.reselections) == (0, 18, 0)


def test_history_crossing_min_context_skips_layers_until_its_queries_matter():
    """A prompt just under min_context: steps whose queries no sparse selection can
    use are exact rows (no per-layer policy work); the first sparse selection sees
    the same ring, hence selects the same positions, as a policy fed every query."""
    dec = decoder("loopserve")
    twin = get_policy("loopserve", CFG, SHAPE)
    pool = FakePool(seed=3)
    pool.append(0, 26)
    twin.start("r", 26)
    observed = []
    for _ in range(10):
        pool.append(0)
        plan = dec.plan(view(pool, ["r"], [0]))
        observed.append(plan.observe is not None)
        qs = [torch.randn(1, SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
              for _ in range(SHAPE.num_layers)]
        decode_step(twin, "r", pool.lens[0], lambda layer: qs[layer][0],
                    lambda layer: pool.history(layer, 0))
        for layer in range(SHAPE.num_layers):
            run_layer(dec, plan, pool, qs[layer], layer)
    # seq 27, 28 are exact (even 3 steps later the history is < 32); from seq 29 on
    # the query may be in the ring of a sparse selection; step 4 (seq 31) selects
    # densely, step 8 (seq 35) sparsely.
    assert observed == [False, False] + [True] * 8
    st, want = dec.policy.state("r"), twin.state("r")
    assert not st.dense and st.recent_start == want.recent_start == 35 - CFG.window
    for layer in range(SHAPE.num_layers):
        slot, twin_slot = torch.tensor([st.slot]), torch.tensor([want.slot])
        assert torch.equal(dec.policy.selection(layer, slot), twin.selection(layer, twin_slot))
    assert dec.stats.exact_steps == 2 + 6 and dec.stats.sparse_steps == 2


class FakeMetrics:
    def __init__(self):
        self.exact, self.selected, self.reselections, self.live = 0, [], 0, None

    def observe_step(self, exact, selected):
        self.exact += exact
        self.selected += list(selected)

    def observe_reselections(self, n):
        self.reselections += n

    def set_live_states(self, n):
        self.live = n


def test_state_lifetime_release_restart_and_metrics():
    metrics = FakeMetrics()
    dec = decoder("streaming", metrics=metrics)
    pool = FakePool()
    pool.append(0, 50), pool.append(1, 10)
    pool.append(0), pool.append(1)
    plan = dec.plan(view(pool, ["a", "b"], [0, 1]))
    assert dec.live_states == 2 and metrics.live == 2
    st = dec.policy.state("a")
    assert (st.prompt_len, st.seq_len, st.step) == (50, 51, 0)
    q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim)
    out = run_layer(dec, plan, pool, q, 0)
    assert torch.isfinite(out).all()
    # Counted once per pass: "a" streams (sink 2 + window 4), "b" is short.
    assert metrics.exact == 1 and metrics.selected == [2 + 4]
    assert (dec.stats.sparse_steps, dec.stats.exact_steps) == (1, 1)
    dec.release("a")
    dec.release("a")  # twice is fine
    dec.release("never-seen")
    assert dec.live_states == 1 and metrics.live == 1 and "a" not in dec.policy.states
    # A history that did not grow means the rid was re-prefilled: its state restarts.
    dec.plan(view(pool, ["b"], [1]))
    assert dec.policy.state("b").step == 0 and dec.policy.state("b").prompt_len == 10


def test_stale_states_are_dropped_when_no_release_comes():
    dec = decoder("loopserve", stale_after=10)
    pool = FakePool()
    pool.append(0, 40), pool.append(1, 40)
    pool.append(0), pool.append(1)
    dec.plan(view(pool, ["gone", "kept"], [0, 1]))
    for _ in range(63):  # the sweep runs every 64 passes
        pool.append(1)
        dec.plan(view(pool, ["kept"], [1]))
    assert "gone" not in dec.policy.states and "kept" in dec.policy.states
    assert dec.stats.stale_drops == 1 and dec.live_states == 1
    assert len(dec.policy.slots) == 1


# ------------------------------------------------------------------ snapkv prefill path


def test_snapkv_scores_the_final_chunk_and_decodes_its_selection():
    core = AttentionCore(decoder("snapkv"))
    twin = get_policy("snapkv", CFG, SHAPE)
    pool = FakePool()
    hq, d = SHAPE.num_q_heads, SHAPE.head_dim
    # Chunk 1 (not final): nothing is scored. Chunk 2 ends the 90-token prompt; a
    # short request in the same pass stays stateless (exact).
    pool.append(0, 60)
    plan = core.plan(view(pool, ["r"], [0], "extend", [60], final=False))
    assert not plan.extend.scored and "r" not in core.decoder.policy.states
    pool.append(0, 30), pool.append(1, 12)
    plan = core.plan(view(pool, ["r", "s"], [0, 1], "extend", [30, 12]))
    assert [r.rid for r in plan.extend.scored.values()] == ["r"]
    q = torch.randn(42, hq, d, generator=pool.gen)  # the pass's queries: 30 of r, 12 of s
    twin.start("r", 90)
    for layer in range(SHAPE.num_layers):
        out = torch.full_like(q, float("nan"))
        core.run(plan, layer, q, pool.k[layer], pool.v[layer], out, SCALE)
        assert torch.isfinite(out).all()
        twin.prefill_layer("r", layer, q[30 - CFG.window : 30], pool.history(layer, 0))
    assert "s" not in core.decoder.policy.states
    pool.append(0), pool.append(1)
    plan = core.plan(view(pool, ["r", "s"], [0, 1]))
    r, sels = decode_step(twin, "r", 91, None, None)
    qd = torch.randn(2, hq, d)
    out = run_layer(core.decoder, plan.decode, pool, qd, 0)
    torch.testing.assert_close(out[0], subset_attention(pool, 0, 0, qd[0], sels[0],
                                                        r.recent_start), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], full_attention(pool, 0, 1, qd[1]), rtol=1e-4, atol=1e-5)
    # A mixed pass: "r" decodes one token inside an extend batch and keeps its state.
    pool.append(0)
    plan = core.plan(view(pool, ["r"], [0], "extend", [1]))
    assert core.decoder.policy.state("r").step == 0 and not plan.extend.scored


def test_loopserve_seeds_its_first_steps_from_the_prompts_last_queries():
    """LoopServe's prompt seed on the served path: the pass that ends a long prompt
    scores it with its last ``window`` queries, and the first decode step attends that
    selection (a short prompt in the same pass starts at its first decode step)."""
    seeded = dataclasses.replace(CFG, mode="loopserve", prompt_seed=True)
    core = AttentionCore(decoder("loopserve", seeded))
    twin = get_policy("loopserve", seeded, SHAPE)
    pool = FakePool()
    hq, d = SHAPE.num_q_heads, SHAPE.head_dim
    pool.append(0, 90), pool.append(1, 12)
    plan = core.plan(view(pool, ["r", "s"], [0, 1], "extend", [90, 12]))
    (row,) = plan.extend.scored.values()
    assert (row.rid, row.q_start, row.q_end) == ("r", 90 - CFG.window, 90)
    q = torch.randn(102, hq, d, generator=pool.gen)
    twin.start("r", 90)
    for layer in range(SHAPE.num_layers):
        out = torch.full_like(q, float("nan"))
        core.run(plan, layer, q, pool.k[layer], pool.v[layer], out, SCALE)
        twin.prefill_layer("r", layer, q[90 - CFG.window : 90], pool.history(layer, 0))
    assert "s" not in core.decoder.policy.states
    pool.append(0), pool.append(1)
    plan = core.plan(view(pool, ["r", "s"], [0, 1]))
    r, sels = decode_step(twin, "r", 91, lambda layer: q[0], None)
    assert r.kind == Kind.SPARSE and not r.reselect
    assert core.decoder.policy.state("s").step == 0
    qd = torch.randn(2, hq, d)
    out = run_layer(core.decoder, plan.decode, pool, qd, 0)
    torch.testing.assert_close(out[0], subset_attention(pool, 0, 0, qd[0], sels[0],
                                                        r.recent_start), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], full_attention(pool, 0, 1, qd[1]), rtol=1e-4, atol=1e-5)
    assert core.decoder.rows()["r"]["path"] == "sparse"


# ------------------------------------------------------------------ the ForwardBatch view


def test_batch_view_reads_the_forward_batch():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_spec.integration.attention import batch_view

    r2t = torch.zeros(8, 64, dtype=torch.int32)
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, rids=["a", "b"], seq_lens_cpu=torch.tensor([40, 8]),
        seq_lens=torch.tensor([40, 8]), req_pool_indices=torch.tensor([3, 4]),
        extend_seq_lens_cpu=[40, 8], extend_seq_lens=torch.tensor([40, 8]),
        contains_last_prefill_chunk=False, input_ids=torch.arange(48),
        out_cache_loc=torch.arange(100, 148),
    )
    v = batch_view(fb, r2t)
    assert (v.mode, v.rids, v.seq_lens, v.pool_rows, v.extend_lens, v.final_chunk) == (
        "extend", ("a", "b"), (40, 8), (3, 4), (40, 8), False)
    assert v.input_ids is fb.input_ids and v.out_cache_loc is fb.out_cache_loc
    assert v.req_to_token is r2t and v.rows.tolist() == [3, 4] and v.prefix_lens == (0, 0)
    fb.forward_mode, fb.seq_lens_cpu = ForwardMode.DECODE, torch.tensor([41, 9])
    v = batch_view(fb, r2t)
    assert v.mode == "decode" and v.seq_lens == (41, 9) and v.extend_lens == ()
    fb.forward_mode = ForwardMode.IDLE
    assert batch_view(fb, r2t).mode == "other"
    with pytest.raises(ValueError, match="valid: decode, extend, other"):
        BatchView("prefill")


# ------------------------------------------------------------------ real servers

QUESTION = "What is the capital of France?"


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _doc(module_name: str, chars: int) -> str:
    return inspect.getdoc(__import__(module_name))[:chars]


def generate(url: str, text: str, max_new_tokens: int, **sampling) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0,
                                              "max_new_tokens": max_new_tokens, **sampling}}
    resp = requests.post(url + "/generate", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def sparse_metrics(url: str) -> dict[str, float]:
    """The sgl_spec sparse-decode series of /metrics, by name (with labels)."""
    text = requests.get(url + "/metrics", timeout=30).text
    names = ("sgl_spec:decode_steps_total", "sgl_spec:sparse_reselections_total",
             "sgl_spec:sparse_selected_tokens_sum", "sgl_spec:sparse_selected_tokens_count",
             "sgl_spec:sparse_live_states", "sgl_spec:decode_pass_seconds_sum",
             "sgl_spec:decode_pass_seconds_count")
    out = {}
    for line in text.splitlines():
        if line.startswith(names):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


SPARSE = 'sgl_spec:decode_steps_total{path="sparse"}'
EXACT = 'sgl_spec:decode_steps_total{path="exact"}'
RESELECT = "sgl_spec:sparse_reselections_total"
# 16 and 537 tokens, under the shared server's sparse-prefill threshold (600); sent one
# at a time so both servers batch alike.
PROMPTS = [
    chatml(QUESTION),
    chatml("Summarize this text in one sentence:\n" + _doc("argparse", 2500)),
]


@pytest.mark.server
class TestBudgetCoversHistory:
    """loopserve with --spec-budget 4096 and --spec-min-context 0: every history is
    covered by the budget, so decode is exact mode's, token for token."""

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, spec_server, loopserve_server):
        # The exact-mode reference from the session's exact server, its cache flushed
        # so that no prompt hits a prefix an earlier test left.
        requests.post(f"{spec_server.url}/flush_cache", timeout=60).raise_for_status()
        reference = [generate(spec_server.url, p, 24)["output_ids"] for p in PROMPTS]
        requests.post(f"{loopserve_server.url}/flush_cache", timeout=60).raise_for_status()
        return loopserve_server, reference

    def test_greedy_outputs_equal_exact_modes(self, servers):
        server, reference = servers
        before = sparse_metrics(server.url)
        outs = [generate(server.url, p, 24) for p in PROMPTS]
        assert [o["output_ids"] for o in outs] == reference
        after = sparse_metrics(server.url)
        steps = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
        assert delta(after, before, SPARSE) == 0 and delta(after, before, RESELECT) == 0
        assert steps <= delta(after, before, EXACT) <= steps + len(PROMPTS)
        assert after["sgl_spec:sparse_live_states"] == 0


@pytest.mark.server
class TestSmallBudget:
    """loopserve with --spec-budget 64 --spec-min-context 256 (nd 16),
    --spec-sparse-kv-cache drop, and sparse prefill from 256 tokens (conftest's
    small_budget_server)."""

    def test_long_prompt_decodes_sparse_and_reselects(self, small_budget_server):
        prompt = chatml("What does this module do?\n" + _doc("json", 5000))
        before = sparse_metrics(small_budget_server.url)
        out = generate(small_budget_server.url, prompt, 48, ignore_eos=True)
        after = sparse_metrics(small_budget_server.url)
        meta = out["meta_info"]
        assert 800 <= meta["prompt_tokens"] <= 1300
        assert meta["completion_tokens"] == 48 and out["text"].strip()
        # 47 decode steps (the first token comes from prefill), all sparse: 0..15 attend
        # what the prompt's last 64 queries selected at prefill, and the decoded queries
        # select anew at steps 16 and 32. Overlap scheduling may run one more.
        assert delta(after, before, EXACT) == 0
        assert 47 <= delta(after, before, SPARSE) <= 48
        assert delta(after, before, RESELECT) == 2
        # Attended per step: sink 4 + budget 64 + window 64 plus up to nd - 1 new tokens.
        n = delta(after, before, "sgl_spec:sparse_selected_tokens_count")
        mean = delta(after, before, "sgl_spec:sparse_selected_tokens_sum") / n
        assert n == delta(after, before, SPARSE) and 4 + 64 + 65 <= mean <= 4 + 64 + 80
        assert after["sgl_spec:sparse_live_states"] == 0  # released when it finished
        # Pass times by path: each decode pass but the last (no decode pass follows it).
        passes = {p: delta(after, before, f'sgl_spec:decode_pass_seconds_count{{path="{p}"}}')
                  for p in ("exact", "sparse", "reselect")}
        assert passes["exact"] == 0 and passes["reselect"] == 2
        assert 44 <= passes["sparse"] <= 46
        assert delta(after, before, 'sgl_spec:decode_pass_seconds_sum{path="sparse"}') > 0

    def test_a_follow_up_turn_reuses_only_what_dense_passes_wrote(self, small_budget_server):
        """--spec-sparse-kv-cache drop: the radix cache keeps the prompt, not the KV
        written from the first sparse step on, which is the first step here (the
        prompt's seed; the specontext server, whose default auto is drop too, hits only
        the prompt as well)."""
        url = small_budget_server.url
        first = chatml("Summarize this text.\n" + _doc("argparse", 4000))
        before = sparse_metrics(url)
        a = generate(url, first, 40, ignore_eos=True)
        assert delta(sparse_metrics(url), before, SPARSE) >= 20
        follow = (first + a["text"] + "<|im_end|>\n"
                  + "<|im_start|>user\nName one class it mentions.<|im_end|>\n"
                  + "<|im_start|>assistant\n")
        b = generate(url, follow, 8)
        p = a["meta_info"]["prompt_tokens"]
        # Step k writes the KV of position p + k; step 0 is the first sparse one.
        assert p - 1 <= b["meta_info"]["cached_tokens"] <= p
        assert b["meta_info"]["prompt_tokens"] > p + 40
        assert sparse_metrics(url)["sgl_spec:sparse_live_states"] == 0

    def test_short_prompt_decodes_exactly(self, small_budget_server):
        before = sparse_metrics(small_budget_server.url)
        out = generate(small_budget_server.url, chatml(QUESTION), 24, ignore_eos=True)
        after = sparse_metrics(small_budget_server.url)
        assert out["meta_info"]["prompt_tokens"] + 24 < 256
        assert delta(after, before, SPARSE) == 0 and delta(after, before, RESELECT) == 0
        assert 23 <= delta(after, before, EXACT) <= 24
        assert after["sgl_spec:sparse_live_states"] == 0

    def test_aborted_streams_free_their_states(self, small_budget_server):
        """Streams cut by the client at seeded random points (some before their first
        token, some mid-decode, sparse from their first step), then the server: every sparse
        state freed, and a greedy request over the cached prompt answers as the same
        request did before the aborts."""
        import random

        url = small_budget_server.url
        prompt = chatml("What does this module do?\n" + _doc("json", 1500))
        generate(url, prompt, 1)                      # cache the prompt: every run below
        reference = generate(url, prompt, 24)["output_ids"]   # extends over the same prefix
        rng = random.Random(18)
        cut_after = [rng.choice([0, 1, 8, 20, 30]) for _ in range(8)]  # chunks read
        abort_streams(url, [prompt + f" ({i})" for i in range(8)], cut_after)
        live = wait_until_freed(url)
        assert live == {"prefill_lines_offered": 0, "prefill_seeds": 0, "decode_states": 0,
                        "policy_states": 0, "policy_slots": 0}
        assert sparse_metrics(url)["sgl_spec:sparse_live_states"] == 0
        assert generate(url, prompt, 24)["output_ids"] == reference
        assert not any(live_requests(url).values())
