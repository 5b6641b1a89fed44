"""Sparse decode in the serving backend: SparseDecoder on a fake KV pool (no server),
the backend's row split against torch_native, and real servers in loopserve mode.

Fake pools scatter each request's positions over random slots and NaN-poison every
slot no request owns, so reading outside a request's history gives NaN. Rows the
decoder must leave to the dense path are NaN-poisoned in ``out`` and must stay so.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import requests
import torch

from conftest import COMMON_FLAGS, _log_path
from sgl_spec.attention.sparse_decode import SparseDecoder
from sgl_spec.bench.server import SPEC, ServerProcess
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference
from sgl_spec.sparse import AttnShape, SparseParams, get_policy, pack_subsets
from sgl_spec.sparse.params import use_exact

SHAPE = AttnShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)
PARAMS = SparseParams(budget=8, sink=2, window=4, nd=4, first_select_step=4, min_context=32)
SCALE = SHAPE.sm_scale


class FakePool:
    """A KV pool of one layer per ``SHAPE.num_layers``, rows of req_to_token per request."""

    def __init__(self, slots: int = 2048, max_ctx: int = 512, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        hkv, d = SHAPE.num_kv_heads, SHAPE.head_dim
        nan = float("nan")
        self.k = [torch.full((slots, hkv, d), nan) for _ in range(SHAPE.num_layers)]
        self.v = [torch.full((slots, hkv, d), nan) for _ in range(SHAPE.num_layers)]
        self.req_to_token = torch.zeros(8, max_ctx, dtype=torch.int32)
        self.free = torch.randperm(slots, generator=self.gen).tolist()
        self.lens: dict[int, int] = {}

    def append(self, row: int, n: int = 1, keys=None) -> None:
        """Write K/V of ``n`` new positions of request ``row``; keys(layer, pos) -> [Hkv, D]."""
        start = self.lens.get(row, 0)
        for pos in range(start, start + n):
            slot = self.free.pop()
            self.req_to_token[row, pos] = slot
            for layer in range(SHAPE.num_layers):
                k = keys(layer, pos) if keys else 0.5 * torch.randn(
                    SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen)
                self.k[layer][slot] = k
                self.v[layer][slot] = torch.randn(
                    SHAPE.num_kv_heads, SHAPE.head_dim, generator=self.gen)
        self.lens[row] = start + n

    def history(self, layer: int, row: int) -> torch.Tensor:  # [seq_len, Hkv, D]
        return self.k[layer][self.req_to_token[row, : self.lens[row]].long()]


def run_decode(dec, pool, rows, q, layer):
    """One layer of one pass through the decoder; returns (out, exact rows)."""
    seq = torch.tensor([pool.lens[r] for r in rows])
    out = torch.full((len(rows), SHAPE.num_q_heads, SHAPE.head_dim), float("nan"))
    exact = dec.decode_layer(layer, q, pool.k[layer], pool.v[layer], pool.req_to_token,
                             torch.tensor(rows), seq, out, SCALE)
    return out, exact


def full_attention(pool, layer, row, q):  # [Hq, D]: softmax over the whole history
    k = pool.history(layer, row).repeat_interleave(SHAPE.num_q_heads // SHAPE.num_kv_heads, 1)
    v = pool.v[layer][pool.req_to_token[row, : pool.lens[row]].long()]
    v = v.repeat_interleave(SHAPE.num_q_heads // SHAPE.num_kv_heads, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k.double()) * SCALE, -1)
    return torch.einsum("hl,lhd->hd", p, v.double()).to(q.dtype)


def plan(dec, pool, rids, rows):
    dec.plan_decode(rids, [pool.lens[r] for r in rows], rows)


# ------------------------------------------------------------------ decoder vs policy


@pytest.mark.parametrize("impl", ["torch-cached", "torch"])
def test_decoder_matches_policy_and_reference_kernel(impl):
    """Rows, reselection keys and pool rows reach the policy and the kernel intact:
    the decoder's output equals a directly driven policy's subsets through the
    per-head reference, and exactly the dense rows are left to the caller. With
    the cached impl a stale sink + selection (kept past a reselection) would differ."""
    dec = SparseDecoder(get_policy("loopserve", PARAMS, SHAPE), impl=impl)
    twin = get_policy("loopserve", PARAMS, SHAPE)
    pool = FakePool()
    rids, rows, prompts = ["long", "short", "mid"], [3, 0, 5], [100, 20, 60]
    for rid, row, n in zip(rids, rows, prompts):
        pool.append(row, n)
        twin.start(rid, n)
    seen_sparse, seen_full = set(), set()
    for step in range(10):
        for row in rows:
            pool.append(row)  # the current token's K/V, written before attention
        plan(dec, pool, rids, rows)
        reselect = [twin.step(rid, pool.lens[row]) for rid, row in zip(rids, rows)]
        for layer in range(SHAPE.num_layers):
            q = torch.randn(len(rows), SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
            out, exact = run_decode(dec, pool, rows, q, layer)
            subs = [twin.decode_layer(rid, layer, q[b], pool.history(layer, row) if reselect[b]
                                      else None) for b, (rid, row) in enumerate(zip(rids, rows))]
            dense = [b for b, s in enumerate(subs) if s.dense]
            # Dense rows at a history the policy could sparsify (LoopServe before its
            # first selection) are attended in full by the decoder; the others are left.
            here = [b for b in dense if not use_exact(pool.lens[rows[b]], PARAMS)]
            assert exact == [b for b in dense if b not in here]
            for b in exact:
                assert torch.isnan(out[b]).all()  # left to the dense path
            for b in here:
                torch.testing.assert_close(out[b], full_attention(pool, layer, rows[b], q[b]),
                                           rtol=1e-4, atol=1e-5)
            seen_full.update(rids[b] for b in here)
            sparse = [b for b in range(len(rows)) if b not in exact]
            seen_sparse.update(rids[b] for b in sparse)
            if not sparse:
                continue
            idx = torch.tensor(sparse)
            want = sparse_decode_reference(
                q[idx], pool.k[layer], pool.v[layer], pool.req_to_token,
                torch.tensor(rows)[idx], torch.tensor([pool.lens[r] for r in rows])[idx],
                *pack_subsets([subs[b] for b in sparse], SHAPE.num_kv_heads, "cpu"),
                sink=PARAMS.sink, scale=SCALE,
            )
            torch.testing.assert_close(out[idx], want, rtol=1e-4, atol=1e-5)
    # Selections at steps 4 and 8; "short" (21..30 positions) stays under min_context.
    assert seen_sparse == {"long", "mid"}
    assert seen_full == {"long", "mid"}  # their steps before the first selection
    assert dec.stats.reselections == 4
    assert dec.stats.sparse_steps == 2 * 6 and dec.stats.exact_steps == 3 * 10 - 12
    if impl == "torch-cached":
        assert sorted(dec._fixed) == ["long", "mid"]  # one entry per layer each
        assert all(len(per_layer) == SHAPE.num_layers for per_layer in dec._fixed.values())
    for rid in rids:
        dec.release(rid)
    assert dec.live_states == 0 and not dec._fixed


def test_decoder_rejects_unknown_impl():
    with pytest.raises(ValueError, match="valid: torch-cached, torch, triton, flashinfer"):
        SparseDecoder(get_policy("loopserve", PARAMS, SHAPE), impl="cuda")


def _planted(dirs, planted, noise_gen):
    def keys(layer, pos):
        if pos in planted[layer]:
            return 6.0 * dirs  # logit 12 against ~0 for the noise
        return 0.1 * torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=noise_gen)
    return keys


def test_decoder_approximates_dense_attention_when_mass_is_selectable():
    """With attention concentrated on a few keys far from the sink and the window,
    loopserve's selection finds them and sparse decode matches dense attention."""
    params = dataclasses.replace(PARAMS, budget=6)
    dec = SparseDecoder(get_policy("loopserve", params, SHAPE))
    pool = FakePool(seed=1)
    d = torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=pool.gen)
    dirs = d / d.norm(dim=-1, keepdim=True)
    planted = {0: {17, 40, 77}, 1: {9, 55, 120}}
    pool.append(2, 200, keys=_planted(dirs, planted, pool.gen))
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    checked = 0
    for step in range(8):
        pool.append(2, keys=_planted(dirs, planted, pool.gen))
        plan(dec, pool, ["r"], [2])
        for layer in range(SHAPE.num_layers):
            q = (8.0 * dirs.repeat_interleave(g, 0))[None]  # [1, Hq, D]
            out, exact = run_decode(dec, pool, [2], q, layer)
            if exact:
                continue
            k = pool.history(layer, 2)
            v = pool.v[layer][pool.req_to_token[2, : pool.lens[2]].long()]
            dense = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0),
                v.transpose(0, 1).repeat_interleave(g, 0), scale=SCALE,
            ).transpose(0, 1)  # [1, Hq, D]
            torch.testing.assert_close(out, dense, rtol=0, atol=5e-3)
            checked += 1
    # Steps 0..3 attend in full in the decoder (before the first selection, at a
    # history >= min_context), steps 4..7 sparsely: all 8 steps, both layers.
    assert checked == 2 * 8


# ------------------------------------------------------------------ exact fallback, lifetime


def test_all_rows_exact_below_min_context_or_when_budget_covers():
    for params in (dataclasses.replace(PARAMS, min_context=10_000),
                   dataclasses.replace(PARAMS, min_context=0, budget=4096)):
        dec = SparseDecoder(get_policy("loopserve", params, SHAPE))
        pool = FakePool()
        pool.append(0, 150)
        pool.append(1, 40)
        for _ in range(9):
            pool.append(0), pool.append(1)
            plan(dec, pool, ["a", "b"], [0, 1])
            for layer in range(SHAPE.num_layers):
                q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim)
                out, exact = run_decode(dec, pool, [0, 1], q, layer)
                assert exact == [0, 1] and torch.isnan(out).all()
            assert not dec.planned  # the backend makes exact mode's call
        assert (dec.stats.sparse_steps, dec.stats.exact_steps, dec.stats.reselections) == (0, 18, 0)


def test_history_crossing_min_context_skips_layers_until_its_queries_matter():
    """A prompt just under min_context: steps whose queries no sparse selection can
    use skip the layers (not planned); the first sparse selection sees the same
    ring, hence selects the same positions, as a policy fed every query."""
    dec = SparseDecoder(get_policy("loopserve", PARAMS, SHAPE))
    twin = get_policy("loopserve", PARAMS, SHAPE)
    pool = FakePool(seed=3)
    pool.append(0, 26)
    twin.start("r", 26)
    planned = []
    for _ in range(10):
        pool.append(0)
        plan(dec, pool, ["r"], [0])
        planned.append(dec.planned)
        reselect = twin.step("r", pool.lens[0])
        for layer in range(SHAPE.num_layers):
            q = torch.randn(1, SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
            if dec.planned:
                run_decode(dec, pool, [0], q, layer)
            twin.decode_layer("r", layer, q[0], pool.history(layer, 0) if reselect else None)
    # seq 27, 28 skip (even 3 steps later the history is < 32); from seq 29 on the
    # query may be in the ring of a sparse selection; step 4 (seq 31) selects
    # densely, step 8 (seq 35) sparsely.
    assert planned == [False, False] + [True] * 8
    st, want = dec.policy.states.get("r"), twin.states.get("r")
    assert not st.dense and st.recent_start == want.recent_start == 35 - PARAMS.window
    for layer in range(SHAPE.num_layers):
        assert torch.equal(st.sel[layer], want.sel[layer])
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
    dec = SparseDecoder(get_policy("streaming", PARAMS, SHAPE), metrics=metrics)
    pool = FakePool()
    pool.append(0, 50), pool.append(1, 10)
    pool.append(0), pool.append(1)
    plan(dec, pool, ["a", "b"], [0, 1])
    assert dec.live_states == 2 and metrics.live == 2
    st = dec.policy.states.get("a")
    assert (st.prompt_len, st.seq_len, st.step) == (50, 51, 0)
    q = torch.randn(2, SHAPE.num_q_heads, SHAPE.head_dim)
    for layer in range(SHAPE.num_layers):
        run_decode(dec, pool, [0, 1], q, layer)
    # Counted once per pass: "a" streams (sink 2 + window 4), "b" is short.
    assert metrics.exact == 1 and metrics.selected == [2 + 4]
    assert (dec.stats.sparse_steps, dec.stats.exact_steps) == (1, 1)
    dec.release("a")
    dec.release("a")  # twice is fine
    dec.release("never-seen")
    assert dec.live_states == 1 and metrics.live == 1 and "a" not in dec.policy.states
    # A history that did not grow means the rid was re-prefilled: its state restarts.
    plan(dec, pool, ["b"], [1])
    assert dec.policy.states.get("b").step == 0 and dec.policy.states.get("b").prompt_len == 10


def test_stale_states_are_dropped_when_no_release_comes():
    dec = SparseDecoder(get_policy("loopserve", PARAMS, SHAPE), stale_after=10)
    pool = FakePool()
    pool.append(0, 40), pool.append(1, 40)
    pool.append(0), pool.append(1)
    plan(dec, pool, ["gone", "kept"], [0, 1])
    for _ in range(63):  # the sweep runs every 64 passes
        pool.append(1)
        plan(dec, pool, ["kept"], [1])
    assert "gone" not in dec.policy.states and "kept" in dec.policy.states
    assert dec.stats.stale_drops == 1 and dec.live_states == 1


# ------------------------------------------------------------------ snapkv prefill path


def test_snapkv_scores_the_final_chunk_and_decodes_its_selection():
    dec = SparseDecoder(get_policy("snapkv", PARAMS, SHAPE))
    twin = get_policy("snapkv", PARAMS, SHAPE)
    pool = FakePool()
    hq, d = SHAPE.num_q_heads, SHAPE.head_dim
    # Chunk 1 (not final): nothing is scored. Chunk 2 ends the 90-token prompt; a
    # short request in the same pass stays stateless (exact).
    pool.append(0, 60)
    dec.plan_extend(["r"], [60], [60], [0], final=False)
    assert not dec.prefill_planned and "r" not in dec.policy.states
    pool.append(0, 30), pool.append(1, 12)
    dec.plan_extend(["r", "s"], [90, 12], [30, 12], [0, 1], final=True)
    q = torch.randn(42, hq, d, generator=pool.gen)  # the pass's queries: 30 of r, 12 of s
    twin.start("r", 90)
    for layer in range(SHAPE.num_layers):
        dec.prefill_layer(layer, q, pool.k[layer], pool.req_to_token)
        twin.prefill_layer("r", layer, q[30 - PARAMS.window : 30], pool.history(layer, 0))
    assert "s" not in dec.policy.states
    pool.append(0), pool.append(1)
    plan(dec, pool, ["r", "s"], [0, 1])
    twin.step("r", 91)
    qd = torch.randn(2, hq, d)
    out, exact = run_decode(dec, pool, [0, 1], qd, 0)
    assert exact == [1]
    want = sparse_decode_reference(
        qd[:1], pool.k[0], pool.v[0], pool.req_to_token, torch.tensor([0]),
        torch.tensor([91]), *pack_subsets([twin.decode_layer("r", 0, qd[0])], 2, "cpu"),
        sink=PARAMS.sink, scale=SCALE,
    )
    torch.testing.assert_close(out[:1], want, rtol=1e-4, atol=1e-5)
    # A mixed pass: "r" decodes one token inside an extend batch and keeps its state.
    pool.append(0)
    dec.plan_extend(["r"], [92], [1], [0], final=True)
    assert dec.policy.states.get("r").step == 0 and not dec.prefill_planned


# ------------------------------------------------------------------ backend row split


def _bare_backend(decoder):
    from sgl_spec.attention.backend import SpecAttnBackend

    backend = object.__new__(SpecAttnBackend)  # the decode kernels read no other state
    backend.sparse, backend._sparse_layer = decoder, (0 if decoder else None)
    return backend


def _torch_native_decode(q, pool, rows, layer=0):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    out = torch.full_like(q, float("nan"))
    TorchNativeAttnBackend._run_sdpa_forward_decode(
        object.__new__(TorchNativeAttnBackend), q, out, pool.k[layer], pool.v[layer],
        pool.req_to_token, torch.tensor(rows), torch.tensor([pool.lens[r] for r in rows]),
        None, scaling=SCALE, enable_gqa=True,
    )
    return out


def test_backend_exact_rows_are_torch_natives_and_sparse_rows_the_kernels():
    pool = FakePool()
    rows, rids = [0, 1, 2], ["long", "short", "long2"]
    for row, n in zip(rows, [120, 15, 90]):
        pool.append(row, n)
    dec = SparseDecoder(get_policy("streaming", PARAMS, SHAPE))
    for row in rows:
        pool.append(row)
    plan(dec, pool, rids, rows)
    q = torch.randn(3, SHAPE.num_q_heads, SHAPE.head_dim, generator=pool.gen)
    seq = torch.tensor([pool.lens[r] for r in rows])

    def backend_decode(decoder):
        out = torch.full_like(q, float("nan"))
        _bare_backend(decoder)._run_sdpa_forward_decode(
            q, out, pool.k[0], pool.v[0], pool.req_to_token, torch.tensor(rows), seq,
            None, scaling=SCALE, enable_gqa=True,
        )
        return out

    dense = _torch_native_decode(q, pool, rows)
    assert torch.equal(backend_decode(None), dense)  # exact mode: torch_native's call
    got = backend_decode(dec)
    assert torch.equal(got[1], dense[1])  # the short row: the same dense computation
    streaming = SparseParams(budget=1, sink=PARAMS.sink, window=PARAMS.window, min_context=0)
    for b in (0, 2):
        recent = torch.tensor([pool.lens[rows[b]] - streaming.window])
        want = sparse_decode_reference(
            q[b : b + 1], pool.k[0], pool.v[0], pool.req_to_token, torch.tensor([rows[b]]),
            seq[b : b + 1], torch.empty(1, 2, 0, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64), recent, sink=PARAMS.sink, scale=SCALE,
        )
        torch.testing.assert_close(got[b : b + 1], want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got[b], dense[b], atol=1e-3)  # really sparse


def test_plan_pass_reads_the_forward_batch():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_spec.attention.backend import plan_pass

    dec = SparseDecoder(get_policy("snapkv", PARAMS, SHAPE))
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, rids=["a", "b"], seq_lens_cpu=torch.tensor([40, 8]),
        seq_lens=torch.tensor([40, 8]), req_pool_indices=torch.tensor([3, 4]),
        extend_seq_lens_cpu=[40, 8], extend_seq_lens=torch.tensor([40, 8]),
        contains_last_prefill_chunk=True,
    )
    plan_pass(dec, fb)
    assert dec.prefill_planned and [r.rid for r in dec._prefill] == ["a"]
    assert dec._prefill[0].q_start == 40 - PARAMS.window and dec._prefill[0].q_end == 40
    fb.forward_mode, fb.seq_lens_cpu = ForwardMode.DECODE, torch.tensor([41, 9])
    plan_pass(dec, fb)
    assert dec.planned and [r.rid for r in dec._rows] == ["a", None]
    assert [r.pool_row for r in dec._rows] == [3, 4]
    fb.forward_mode = ForwardMode.IDLE
    plan_pass(dec, fb)
    assert not dec.planned and not dec.prefill_planned


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
             "sgl_spec:sparse_live_states")
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
# Roughly 20, 550 and 960 tokens; sent one at a time so both servers batch alike.
PROMPTS = [
    chatml(QUESTION),
    chatml("Summarize this text in one sentence:\n" + _doc("argparse", 2500)),
    chatml("Name one function described here.\n" + _doc("json", 5000)),
]


@pytest.mark.server
class TestBudgetCoversHistory:
    """loopserve with --spec-budget 4096 and --spec-min-context 0: every history is
    covered by the budget, so decode is exact mode's, token for token."""

    @pytest.fixture(scope="class")
    def servers(self, model_path, tmp_path_factory):
        # One server at a time (2-core machines): the exact-mode reference first.
        flags = ["--model-path", model_path, *COMMON_FLAGS]
        with ServerProcess(SPEC, flags, log_path=_log_path(tmp_path_factory, "exact")) as s:
            reference = [generate(s.url, p, 24)["output_ids"] for p in PROMPTS]
        sparse = flags + ["--spec-mode", "loopserve", "--spec-budget", "4096",
                          "--spec-min-context", "0", "--enable-metrics"]
        with ServerProcess(SPEC, sparse,
                           log_path=_log_path(tmp_path_factory, "loopserve-4096")) as s:
            yield s, reference

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
    """loopserve with --spec-budget 64 --spec-min-context 256 (nd 16)."""

    @pytest.fixture(scope="class")
    def server(self, model_path, tmp_path_factory):
        flags = ["--model-path", model_path, *COMMON_FLAGS, "--spec-mode", "loopserve",
                 "--spec-budget", "64", "--spec-min-context", "256", "--enable-metrics"]
        with ServerProcess(SPEC, flags,
                           log_path=_log_path(tmp_path_factory, "loopserve-64")) as s:
            yield s

    def test_long_prompt_decodes_sparse_and_reselects(self, server):
        prompt = chatml("What does this module do?\n" + _doc("json", 5000))
        before = sparse_metrics(server.url)
        out = generate(server.url, prompt, 48, ignore_eos=True)
        after = sparse_metrics(server.url)
        meta = out["meta_info"]
        assert 800 <= meta["prompt_tokens"] <= 1300
        assert meta["completion_tokens"] == 48 and out["text"].strip()
        # 47 decode steps (the first token comes from prefill): 0..15 exact, then
        # sparse, selecting at steps 16 and 32. Overlap scheduling may run one more.
        assert delta(after, before, EXACT) == 16
        assert 31 <= delta(after, before, SPARSE) <= 32
        assert delta(after, before, RESELECT) == 2
        # Attended per step: sink 4 + budget 64 + window 64 plus up to nd - 1 new tokens.
        n = delta(after, before, "sgl_spec:sparse_selected_tokens_count")
        mean = delta(after, before, "sgl_spec:sparse_selected_tokens_sum") / n
        assert n == delta(after, before, SPARSE) and 4 + 64 + 65 <= mean <= 4 + 64 + 80
        assert after["sgl_spec:sparse_live_states"] == 0  # released when it finished

    def test_short_prompt_decodes_exactly(self, server):
        before = sparse_metrics(server.url)
        out = generate(server.url, chatml(QUESTION), 24, ignore_eos=True)
        after = sparse_metrics(server.url)
        assert out["meta_info"]["prompt_tokens"] + 24 < 256
        assert delta(after, before, SPARSE) == 0 and delta(after, before, RESELECT) == 0
        assert 23 <= delta(after, before, EXACT) <= 24
        assert after["sgl_spec:sparse_live_states"] == 0
