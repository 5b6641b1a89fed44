"""SpeContext without a server: the retrieval head against a float64 reference, its
state in the pool across passes and cached turns, elastic loading, the EAGLE-3
loader, and the decoder's staged path against the in-place kernel."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from _head import HCFG, HeadPool, pass_view, random_weights, reference_select, run_pass, runtime
from _sparse import SHAPE, FakePool
from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.decode import Decoder
from sgl_spec.config import DecodeConfig
from sgl_spec.head import eagle3
from sgl_spec.head.config import HeadConfig
from sgl_spec.head.model import RetrievalHead
from sgl_spec.kernels.sparse_decode import DecodeSubsets
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference
from sgl_spec.sparse import get_policy
from sgl_spec.sparse.elastic import ElasticKV, pair_loads

N_AUX = 3


def _aux(n: int, seed: int) -> torch.Tensor:  # [n, 3, Ht]
    return torch.randn(n, N_AUX, HCFG.target_hidden_size, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the head


@pytest.mark.parametrize("budget,window", [(8, 4), (20, 1)], ids=["b8-w4", "b20-w1"])
def test_runtime_selection_equals_the_float64_reference(budget, window):
    """Prefill pass, then decode passes: the served selection (pool-resident keys,
    kept qh, GQA group max) equals the reference written out from the formulas."""
    w = random_weights()
    pool, rt = HeadPool(), None
    rt = runtime(w, pool)
    n, steps = 60, 4
    ids = torch.randint(0, HCFG.vocab_size, (n + steps,), generator=torch.Generator().manual_seed(1))
    aux = _aux(n + steps, 2)
    loc = pool.take(0, 0, n)
    run_pass(rt, pass_view(pool, "extend", ["r"], [0], [n], [n], ids[:n], loc), aux[:n])
    for s in range(steps):
        t = n + s  # the decoded token's position
        loc = pool.take(0, t, 1)
        view = pass_view(pool, "decode", ["r"], [0], [t + 1], [1], ids[t : t + 1], loc)
        rt.begin_pass(view)
        got = rt.select(view, [0], budget, 2, window)[0]
        want = reference_select(HCFG, w, ids, aux, t, budget, 2, window)
        assert torch.equal(got, want), (s, got, want)
        for i in range(N_AUX):
            rt.capture(i, aux[t : t + 1, i])


def test_a_cached_turn_computes_head_keys_for_its_new_tokens_only():
    """Turn 2 over turn 1's cached slots writes the head's keys of its new slots alone,
    equal to a whole-sequence computation; turn 1's slots are not touched."""
    w = random_weights()
    pool = HeadPool()
    rt = runtime(w, pool)
    n1, n2 = 40, 70
    ids = torch.randint(0, HCFG.vocab_size, (n2,), generator=torch.Generator().manual_seed(3))
    aux = _aux(n2, 4)
    s1 = pool.take(0, 0, n1)
    run_pass(rt, pass_view(pool, "extend", ["t1"], [0], [n1], [n1], ids[:n1], s1), aux[:n1])
    before_keys, before_kh = pool.keys.clone(), pool.kh.clone()
    pool.req_to_token[1, :n1] = pool.req_to_token[0, :n1]  # the radix cache's match
    s2 = pool.take(1, n1, n2 - n1)
    run_pass(rt, pass_view(pool, "extend", ["t2"], [1], [n2], [n2 - n1], ids[n1:], s2), aux[n1:])
    changed = ~((pool.keys == before_keys) | (pool.keys.isnan() & before_keys.isnan()))
    assert sorted(changed.any(-1).any(-1).nonzero().flatten().tolist()) == sorted(s2.tolist())
    keys, _ = RetrievalHead(HCFG, w).over_sequence(ids, aux)
    slots = pool.req_to_token[1, :n2].long()
    torch.testing.assert_close(pool.keys[slots], keys, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.kh[s1], before_kh[s1])


def test_passes_the_runtime_was_not_told_of_are_ignored():
    pool = HeadPool()
    rt = runtime(random_weights(), pool)
    rt.begin_pass(BatchView("other"))
    for i in range(N_AUX):
        rt.capture(i, _aux(5, 0)[:, i])
    assert pool.keys.isnan().all()


# ------------------------------------------------------------------ elastic loading


def test_pair_loads_fills_each_row_with_the_wanted_set():
    g = torch.Generator().manual_seed(0)
    staged = torch.tensor([[5, 1, -1, 9], [3, 4, 6, 7]])
    want = torch.tensor([[1, 2, 9, 11], [3, 4, 6, 7]])
    group, dst, src = pair_loads(staged, want)
    assert group.tolist() == [0, 0] and src.tolist() == [2, 11]
    new = staged.clone()
    new[group, dst] = src
    assert sorted(new[0].tolist()) == [1, 2, 9, 11] and new[1].tolist() == [3, 4, 6, 7]
    for _ in range(20):  # random rounds: always the wanted set, only the difference moves
        want = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(3)])
        old = staged = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(3)])
        group, dst, src = pair_loads(staged, want)
        new = staged.clone()
        new[group, dst] = src
        for r in range(3):
            assert set(new[r].tolist()) == set(want[r].tolist())
            assert len(group[group == r]) == len(set(want[r].tolist()) - set(old[r].tolist()))


def test_elastic_buffer_equals_a_fresh_gather_of_the_attended_set():
    """Over many steps of moving selections, each request's staging rows hold exactly
    the K/V of sink + selection + window (any order), loading only the difference."""
    sink, budget, window, hkv, d = 2, 6, 3, 2, 4
    el = ElasticKV(sink, budget, window, hkv)
    s = el.rows
    g = torch.Generator().manual_seed(0)
    pool_k = torch.randn(400, hkv, d, generator=g)
    r2t = torch.randperm(400, generator=g)[:300].view(2, 150).int()
    cap = 3
    staged = torch.full((cap, hkv, s), -1, dtype=torch.int64)
    stage = torch.full((cap * s, hkv, d), float("nan"))
    pool_v, stage_v = -pool_k, stage.clone()  # copied by the same call as K
    slots, rows = torch.tensor([2, 0]), torch.tensor([1, 0])
    seq = torch.tensor([60, 90])
    loaded = []
    sel = None
    for step in range(12):
        seq = seq + 1
        rows_sel = []
        for b, n in enumerate(seq.tolist()):
            heads = []
            for h in range(hkv):
                cand = list(range(sink, n - window))
                if step % 4 == 0:  # a fresh selection, then one position swapped per step
                    pick = [cand[i] for i in torch.randperm(len(cand), generator=g)[:budget]]
                else:
                    pick = sel[b, h].tolist()
                    out = [c for c in cand if c not in pick]
                    pick[int(torch.randint(budget, (1,), generator=g))] = out[
                        int(torch.randint(len(out), (1,), generator=g))]
                heads.append(sorted(pick))
            rows_sel.append(heads)
        sel = torch.tensor(rows_sel)
        ep = el.plan(staged, slots, sel, seq, r2t, rows, torch.tensor([0, 1]))
        ep.ahead.copy(stage, stage_v, pool_k, pool_v)
        ep.current.copy(stage, stage_v, pool_k, pool_v)
        loaded.append(ep.loaded)
        for b in range(2):
            for h in range(hkv):
                want = el.want(sel[b : b + 1], seq[b : b + 1])[0, h]
                got_pos = staged[slots[b], h]
                assert set(got_pos.tolist()) == set(want.tolist())
                rows_k = stage.view(cap, s, hkv, d)[slots[b], :, h]
                fresh = pool_k[r2t[rows[b], got_pos].long(), h]
                assert torch.equal(rows_k, fresh)
                assert torch.equal(stage_v.view(cap, s, hkv, d)[slots[b], :, h], -fresh)
    assert loaded[0] == 2 * hkv * s  # the first step gathers everything
    # then the difference only: per row and head the swapped position, the new token
    # and the window's oldest position (if the selection does not hold it)
    assert max(loaded[1:4]) <= 2 * hkv * 3


# ------------------------------------------------------------------ the EAGLE-3 layout


def _write_eagle3(path, cfg: HeadConfig, w, prefix: str = "", extra_cfg=None, drop=()):
    from safetensors.torch import save_file

    h = cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    t = {"fc.weight": w.fc, "midlayer.hidden_norm.weight": w.hidden_norm,
         "midlayer.input_layernorm.weight": w.input_norm,
         "midlayer.self_attn.q_proj.weight": w.q_proj,
         "midlayer.self_attn.k_proj.weight": w.k_proj,
         "midlayer.self_attn.v_proj.weight": torch.randn(cfg.num_kv_heads * cfg.head_dim, 2 * h, generator=g),
         "midlayer.self_attn.o_proj.weight": torch.randn(h, cfg.num_q_heads * cfg.head_dim, generator=g),
         "midlayer.post_attention_layernorm.weight": torch.ones(h),
         "midlayer.mlp.gate_proj.weight": torch.randn(48, h, generator=g),
         "midlayer.mlp.up_proj.weight": torch.randn(48, h, generator=g),
         "midlayer.mlp.down_proj.weight": torch.randn(h, 48, generator=g),
         "norm.weight": torch.ones(h), "lm_head.weight": torch.randn(20, h, generator=g),
         "d2t": torch.arange(20), "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool)}
    if w.embed is not None:
        t["embed_tokens.weight"] = w.embed
    save_file({(prefix + k): v.contiguous() for k, v in t.items() if k not in drop},
              os.path.join(path, "model.safetensors"))
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
            "num_attention_heads": cfg.num_q_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": 20,
            "target_hidden_size": cfg.target_hidden_size, "rope_theta": cfg.rope_theta,
            "intermediate_size": 48, "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, **(extra_cfg or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)


@pytest.mark.parametrize("prefix,embed", [("", True), ("model.", False)],
                         ids=["plain-with-embed", "model-prefix-no-embed"])
def test_eagle3_loader_cuts_the_head_out_of_a_draft(tmp_path, prefix, embed):
    w = random_weights(embed=embed)
    _write_eagle3(tmp_path, HCFG, w, prefix)
    cfg, got, n_aux = eagle3.load(str(tmp_path))
    assert n_aux == 3 and cfg.aux_layers == (1, 2, 3) and cfg.num_kv_heads == 2
    for f in ("fc", "hidden_norm", "input_norm", "q_proj", "k_proj"):
        assert torch.equal(getattr(got, f), getattr(w, f))
    assert (got.embed is None) == (not embed)


@pytest.mark.parametrize("case,message", [
    ("no-config", "no config.json"),
    ("architecture", "not an EAGLE-3 draft"),
    ("missing", "missing tensors ['midlayer.self_attn.k_proj.weight']"),
    ("shape", "q_proj (144, 48) (expected (192, 48))"),
    ("fc", "does not read whole target hidden states"),
], ids=["no-config", "architecture", "missing-tensor", "wrong-shape", "bad-fc"])
def test_eagle3_loader_rejects_a_malformed_checkpoint(tmp_path, case, message):
    w = random_weights()
    if case == "shape":
        w = dataclasses.replace(w, q_proj=w.q_proj[:144])
    if case == "fc":
        w = dataclasses.replace(w, fc=w.fc[:, :40])
    _write_eagle3(tmp_path, HCFG, w,
                  extra_cfg={"architectures": ["LlamaForCausalLM"]} if case == "architecture" else None,
                  drop=("midlayer.self_attn.k_proj.weight",) if case == "missing" else ())
    if case == "no-config":
        os.remove(tmp_path / "config.json")
    with pytest.raises(ValueError, match="EAGLE-3 draft") as exc:
        eagle3.load(str(tmp_path))
    assert message in str(exc.value)


def test_saved_head_round_trips(tmp_path):
    w = random_weights(embed=False)
    eagle3.save(str(tmp_path), HCFG, w, metadata={"steps": 3})
    cfg, got, n_aux = eagle3.load(str(tmp_path))
    assert cfg == HCFG and n_aux == 3 and torch.equal(got.q_proj, w.q_proj)
    assert json.load(open(tmp_path / "config.json"))["sgl_spec_head_only"] is True


# ------------------------------------------------------------------ the decoder


CFG = DecodeConfig(mode="specontext", budget=8, sink=2, window=4, min_context=32)


def _serve(prefetch="inline", prompts=(60, 20, 45), steps=6, seed=0, device="cpu", impl=None,
           dtype=torch.float32, cfg=CFG):
    """A Decoder with the specontext policy over FakePool (the target's two layers) and
    a head whose keys live in a HeadPool indexed by the same slots. Random values are
    drawn on the CPU, so every device serves the same inputs."""
    pool = FakePool(seed=seed, device=device, dtype=dtype)
    hpool = HeadPool(slots=2048, rows=8, ctx=512, seed=seed, device=device)
    hpool.req_to_token = pool.req_to_token  # one slot space, as in the server
    w = random_weights(seed=seed)
    rt = runtime(w, hpool)
    shape = dataclasses.replace(SHAPE, kv_dtype=dtype)
    pol = get_policy("specontext", cfg, shape, device)
    pol.attach(rt)
    dec = Decoder(shape, pol, prefetch=prefetch, impl=impl,
                  pool_layers=lambda layer: (pool.k[layer], pool.v[layer]))
    rids, rows = ["a", "b", "c"][: len(prompts)], [3, 0, 5][: len(prompts)]
    g = torch.Generator().manual_seed(seed)
    for rid, row, n in zip(rids, rows, prompts):
        pool.append(row, n)
        slots = pool.req_to_token[row, :n].long()
        ids = torch.randint(0, HCFG.vocab_size, (n,), generator=g)
        run_pass(rt, pass_view(hpool, "extend", [rid], [row], [n], [n], ids, slots),
                 _aux(n, seed + row))
    outs = []
    for _ in range(steps):
        for row in rows:
            pool.append(row)
        seq = [pool.lens[r] for r in rows]
        loc = torch.stack([pool.req_to_token[r, pool.lens[r] - 1].long() for r in rows])
        ids = torch.randint(0, HCFG.vocab_size, (len(rows),), generator=g)
        view = BatchView("decode", tuple(rids), tuple(seq), tuple(rows), (), True,
                         pool.req_to_token, torch.tensor(rows, device=device),
                         torch.tensor(seq, device=device), ids.to(device), loc)
        rt.begin_pass(view)
        plan = dec.plan(view)
        step = []
        for layer in range(SHAPE.num_layers):
            q = torch.randn(len(rows), SHAPE.num_q_heads, SHAPE.head_dim, generator=g).to(
                device, dtype)
            out = torch.full_like(q, float("nan"))
            dec.run(plan, layer, q, pool.k[layer], pool.v[layer], out, SHAPE.sm_scale)
            step.append((q, out, plan))
        for i in range(N_AUX):
            rt.capture(i, _aux(len(rows), seed + 100)[:, i].to(device))
        outs.append(step)
    return dec, pool, rids, rows, outs


def test_staged_rows_equal_the_in_place_kernel_and_short_rows_stay_exact():
    dec, pool, rids, rows, outs = _serve()
    pol = dec.policy
    for q_out_plans in outs:
        for layer, (q, out, plan) in enumerate(q_out_plans):
            sub = plan.subsets  # the selections, as the in-place path would read them
            ref = sparse_decode_reference(q, pool.k[layer], pool.v[layer], sub,
                                          scale=SHAPE.sm_scale)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # "b" (20 + 6 positions) stays under min_context 32: exact through the pool.
    last = outs[-1][0][2]
    assert last.staged is not None and last.staged.rest is not None
    assert last.staged.elastic.idx.tolist() == [0, 2]
    assert pol.stats.selections == 2 * 6 and dec.stats.exact_steps == 6
    assert pol.stats.full_loads == 2 and 0 < pol.stats.mean_overlap <= 1
    for rid in rids:
        dec.release(rid)
    assert dec.live_states == 0 and len(pol.slots) == 0


@pytest.mark.parametrize("prefetch", ["inline", "thread"])
def test_dense_layers_attend_the_whole_history_and_the_rest_their_selection(prefetch):
    """--spec-dense-layers 1: layer 0 of every row is exact attention over the pool, the
    other layer is the staged selection, as without the flag."""
    cfg = dataclasses.replace(CFG, dense_layers=1)
    dec, pool, rids, rows, outs = _serve(prefetch, cfg=cfg, seed=5)
    _, _, _, _, plain = _serve(prefetch, seed=5)
    for step, base in zip(outs, plain):
        (q0, out0, plan), (q1, out1, _) = step
        ref = sparse_decode_reference(q0, pool.k[0], pool.v[0], plan.dense,
                                      scale=SHAPE.sm_scale)
        torch.testing.assert_close(out0, ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(out1, base[1][1])  # the sparse layer as without the flag
    assert plan.dense.dense and plan.staged is not None


def test_dense_layers_are_checked():
    with pytest.raises(ValueError, match="--spec-dense-layers is read only with a sparse"):
        DecodeConfig(mode="exact", dense_layers=1)
    pol = get_policy("specontext", dataclasses.replace(CFG, dense_layers=2), SHAPE)
    with pytest.raises(ValueError, match="valid: 0-1 for this model's 2 layers"):
        Decoder(SHAPE, pol)


def test_thread_prefetch_gives_the_inline_result():
    _, _, _, _, inline = _serve("inline", seed=3)
    _, _, _, _, thread = _serve("thread", seed=3)
    for a, b in zip(inline, thread):
        for (_, oa, _), (_, ob, _) in zip(a, b):
            assert torch.equal(oa, ob)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["triton", "flashinfer"])
def test_on_cuda_the_side_stream_serves_the_selected_rows(impl):
    """The GPU path as served: head, policy and staging on CUDA, the staged rows copied
    on the side stream, the kernel FlashInfer (as the server picks on CUDA) or Triton.
    Each layer's output equals the reference over the selection it was planned with,
    and the selections are the CPU run's (same inputs)."""
    if impl == "flashinfer":
        pytest.importorskip("flashinfer")
    dec, pool, rids, rows, outs = _serve("stream", device="cuda", impl=impl,
                                         dtype=torch.bfloat16)  # a GPU pool's dtype
    assert dec.prefetcher.name == "stream"
    for q_out_plans in outs:
        for layer, (q, out, plan) in enumerate(q_out_plans):
            ref = sparse_decode_reference(q.float(), pool.k[layer].float(),
                                          pool.v[layer].float(), plan.subsets,
                                          scale=SHAPE.sm_scale)
            assert float((out.float() - ref).norm() / ref.norm()) <= 2e-2, (layer, impl)
    cpu = _serve("inline")[4]
    same = total = 0
    for a, b in zip(cpu, outs):
        sa, sb = a[0][2].subsets, b[0][2].subsets
        same += int((sa.sel_idx == sb.sel_idx.cpu()).all(-1).sum())
        total += sa.sel_idx.shape[0] * sa.sel_idx.shape[1]
    assert same >= 0.9 * total, (same, total)  # float rounding may swap a near-tie
    for rid in rids:
        dec.release(rid)
    assert dec.live_states == 0


def test_a_reused_slot_starts_with_empty_staging():
    pol = get_policy("specontext", CFG, SHAPE)
    pol.start("x", 50)
    slot = pol.state("x").slot
    pol.slots.buffer("staged")[0, slot] = 7
    pol.release("x")
    pol.start("y", 50)
    assert pol.state("y").slot == slot and (pol.slots.buffer("staged")[0, slot] == -1).all()


def test_specontext_flags_are_checked():
    with pytest.raises(ValueError, match="--spec-draft-path is read only with --spec-mode specontext"):
        DecodeConfig(mode="loopserve", draft_path="/x")
    with pytest.raises(ValueError, match="valid values: auto, inline, thread, stream"):
        DecodeConfig(mode="specontext", prefetch="fast")
    with pytest.raises(ValueError, match="--spec-prefetch stream needs a CUDA device"):
        Decoder(SHAPE, get_policy("specontext", CFG, SHAPE), prefetch="stream")
    with pytest.raises(ValueError, match="needs the KV pool's layers"):
        Decoder(SHAPE, get_policy("specontext", CFG, SHAPE), prefetch="thread")


def test_training_capture_keeps_only_the_last_logits_and_the_same_targets(model_path):
    """``capture`` asks the target for one position's logits (``logits_to_keep=1``: the LM
    head over every position was ~1/5 of a long pass on a 151k vocabulary); the aux
    states and attention rows it keeps equal those of a full forward."""
    from sgl_spec.head import data, train

    model, tok, rec = train.load_target(model_path)
    cfg = train.head_config(model)
    sample = data.make(tok, 384, seed=3)
    seen = []  # positions the LM head ran over in capture
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[1]))
    got = train.capture(model, rec, sample, cfg.aux_layers)
    hook.remove()
    assert seen == [1]
    rec.start(torch.tensor(sample.queries))
    with torch.no_grad():
        full = model(input_ids=torch.tensor(sample.ids)[None], output_hidden_states=True,
                     use_cache=False)
    assert full.logits.shape[1] == len(sample.ids)  # the reference computed every position
    want_aux = torch.stack([full.hidden_states[i][0] for i in cfg.aux_layers], 1)
    torch.testing.assert_close(got.aux, want_aux.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(got.target, rec.sum / rec.layers, rtol=0, atol=0)
    rec.rows = None


def _shape_and_head(tmp_path, layers: int, aux: tuple[int, ...]) -> tuple[str, DecodeConfig]:
    """A model directory with the default model's attention shape (config.json only) and
    a random head for it; the SpeContext config at B=256 that reads them."""
    model = tmp_path / "model"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "vocab_size": 1000}))
    hcfg = HeadConfig(hidden_size=576, num_q_heads=9, num_kv_heads=3, head_dim=64,
                      vocab_size=1000, target_hidden_size=576, aux_layers=aux)
    eagle3.save(str(tmp_path / "head"), hcfg, random_weights(hcfg))
    return str(model), DecodeConfig(mode="specontext", budget=256,
                                    draft_path=str(tmp_path / "head"))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_calibrate_decode_times_the_path_served_on_the_device(tmp_path, device):
    """``calibrate decode`` on the default model's shape and a random head: every timed
    step of the sparse row attends its selection and loads part of B (the head's inputs
    drift), the exact row's none; on CUDA the loads go through the side stream and the
    kernel is the Triton one, as a GPU server runs them."""
    from sgl_spec.attention import step_cost

    model, cfg = _shape_and_head(tmp_path, 30, (1, 14, 26))
    prof = step_cost.profile(model, cfg, (1024, 2048), steps=6, repeats=1,
                             progress=False, device=device)
    assert prof["device"] == device and ("gpu" in prof) == (device == "cuda")
    assert all(t > 0 for t in prof["exact_s"] + prof["sparse_s"])
    for c in prof["sparse_counts"]:
        assert c["sparse_steps"] == 6 and c["exact_steps"] == 0
        assert 0 < c["rows_loaded"] < 256 and 0 < c["overlap"] < 1
    with pytest.raises(ValueError, match="valid on cuda: specontext"):
        step_cost.check(DecodeConfig(mode="loopserve"), (8192,), "cuda")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_calibrate_decode_offload_row_reads_the_host(tmp_path, device, monkeypatch):
    """``calibrate decode --offload-layers``: a third row with the last layers' KV in host
    memory (pinned on CUDA); its steps are sparse, every load of those layers reads the
    host copies (on CUDA through the Triton kernel, no host gather), and the profile has
    the host copies' time and the hidden share."""
    from sgl_spec.attention import step_cost
    from sgl_spec.kernels import sparse_decode

    model, cfg = _shape_and_head(tmp_path, 6, (1, 3, 4))
    reads = []
    copy = sparse_decode.copy_rows

    def spy(sk, sv, pk, pv, dst, src):
        reads.append((pk.device.type, pk.is_pinned() if pk.device.type == "cpu" else None))
        return copy(sk, sv, pk, pv, dst, src)

    monkeypatch.setattr("sgl_spec.sparse.elastic.copy_rows", spy)
    if device == "cuda":
        from sgl_spec.kernels.sparse_decode import reference

        ref = reference.copy_rows_reference

        def no_host_gather(sk, sv, pk, pv, dst, src):
            assert pk.is_cuda, "a host gather (the reference) ran for a pinned host pool"
            return ref(sk, sv, pk, pv, dst, src)
        monkeypatch.setattr(reference, "copy_rows_reference", no_host_gather)
    prof = step_cost.profile(model, cfg, (1024,), steps=4, repeats=1, progress=False,
                             device=device, offload_layers=4)
    assert prof["offload_layers"] == [2, 3, 4, 5]
    assert prof["offload_s"][0] > 0 and prof["host_copy_s"][0] > 0
    assert 0 <= prof["hidden_share"][0] <= 1
    host_reads = [r for r in reads if r[0] == "cpu"]
    if device == "cuda":
        assert host_reads and all(pinned for _, pinned in host_reads)
    with pytest.raises(ValueError, match="valid 0..6"):
        step_cost.offload_plan(cfg, 6, 7)
    with pytest.raises(ValueError, match="valid: specontext"):
        step_cost.offload_plan(DecodeConfig(mode="loopserve"), 6, 2)
