"""Round Attention's pieces without a server: the watershed on synthetic curves and on the
default model, the round strategies on hand-worked vectors, rounds of a chat."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sgl_spec.cache.turn_format import derive
from sgl_spec.rounds import conversations, select, watershed


@pytest.mark.parametrize("curve, expected", [
    # a drop to a floor: the first minimum under the bar (lo + 0.25 * range = 1.2)
    ([5.0, 4.5, 3.0, 1.0, 0.5, 0.6, 0.4, 0.45], 5),
    # a ripple high on the curve (index 2) is not significant
    ([5.0, 4.0, 4.2, 2.0, 0.8, 0.3, 0.9, 0.2], 6),
    # a low start (early layers agreeing with the later ones) is not the watershed
    ([0.16, 0.15, 0.148, 0.43, 0.48, 0.51, 0.09, 0.14, 0.06, 0.07], 7),
    # the floor reached at the last point
    ([4.0, 3.0, 2.0, 1.0, 0.0], 5),
    # rising: no minimum
    ([0.1, 0.2, 0.3, 0.4], None),
    # flat
    ([1.0, 1.0, 1.0, 1.0], None),
], ids=["drop", "early-ripple", "low-start", "last-point", "rising", "flat"])
def test_the_watershed_is_the_first_significant_local_minimum(curve, expected):
    assert watershed.find_watershed(curve) == expected


def test_mean_kl_to_later_layers_equals_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(6, 9, generator=g) * 2, dim=1)
    got = watershed.mean_kl_to_later(P)
    q = (P.double() + watershed.EPS)
    q = q / q.sum(1, keepdim=True)
    ref = [sum(float((q[i] * (q[i] / q[j]).log()).sum()) for j in range(i + 1, 6)) / (5 - i)
           for i in range(5)]
    assert got.shape == (5,)
    assert got.tolist() == pytest.approx(ref, rel=1e-5)
    same = watershed.mean_kl_to_later(P[[0] * 4])
    assert same.abs().max() < 1e-6  # identical layers: no divergence


def test_round_mass_sums_each_span_and_normalises_over_them():
    p = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2, 0.0])
    m = watershed.round_mass(p, [(1, 3), (3, 5)])
    assert m.tolist() == pytest.approx([0.2 / 0.5, 0.3 / 0.5])


SHARE = torch.tensor([0.02, 0.30, 0.05, 0.03, 0.40, 0.04, 0.02, 0.06, 0.03, 0.05])


@pytest.mark.parametrize("name, picked", [
    ("topk", [4]),           # top 10% of 10 rounds: 1 (the 0.40)
    ("fixed", [1, 4]),       # share > 0.1
    ("adaptive", [4]),       # mean 0.1, std 0.128: > 0.483 picks none; the argmax is kept
], ids=["topk", "fixed", "adaptive"])
def test_each_strategy_on_a_hand_worked_vector(name, picked):
    how = select.strategy(name)
    assert select.select(SHARE, how, recent=0) == picked
    # the last round before the question is kept as well
    assert select.select(SHARE, how, recent=1) == sorted({*picked, 9})


def test_topk_takes_a_tenth_rounded_up_and_adaptive_takes_outliers():
    share = torch.full((25,), 0.5 / 24)
    share[7] = 0.5
    share = share / share.sum()
    assert select.select(share, select.strategy("topk"), recent=0) == sorted(
        torch.topk(share, math.ceil(2.5)).indices.tolist())
    assert select.strategy("adaptive").pick(share).nonzero().flatten().tolist() == [7]


def test_adaptive_sets_an_outlier_aside_and_looks_again():
    # one pass: mean 0.05, std 0.111, > 0.382 picks the 0.5 only (its weight in the std
    # hides the 0.2); over the other 19: mean 0.026, std 0.041, > 0.149 picks the 0.2;
    # over the 18 equal ones nothing more
    share = torch.tensor([0.5, 0.2] + [0.3 / 18] * 18)
    assert select.strategy("adaptive").pick(share).nonzero().flatten().tolist() == [0, 1]
    assert (share > share.mean() + 3 * share.std(unbiased=False)).nonzero().flatten(
        ).tolist() == [0]


def test_an_unknown_strategy_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: topk, fixed, adaptive"):
        select.strategy("best")
    with pytest.raises(ValueError, match="non-empty"):
        select.select(torch.tensor([]), select.strategy("topk"))


def test_a_conversation_has_its_facts_in_their_rounds_and_asks_one(hf_tok):
    conv = conversations.conversation(hf_tok, 6, (40, 80), seed=3, asked=2)
    roles = [m["role"] for m in conv.messages]
    assert roles == ["system"] + ["user", "assistant"] * 6 + ["user"]
    for r, fact in enumerate(conv.facts):
        assert f"The {fact.key} is {fact.value}." in conv.messages[1 + 2 * r]["content"]
    assert conv.facts[1].key in conv.messages[-1]["content"] and conv.asked == 2
    with pytest.raises(ValueError, match="asked must be a round in 1..6"):
        conversations.conversation(hf_tok, 6, (40, 80), seed=3, asked=7)


def test_round_spans_are_the_earlier_rounds_of_the_chat(hf_tok):
    conv = conversations.conversation(hf_tok, 5, (40, 60), seed=1)
    text = hf_tok.apply_chat_template(list(conv.messages), tokenize=False,
                                      add_generation_prompt=True)
    ids = hf_tok.encode(text, add_special_tokens=False)
    spans = watershed.round_spans(ids, derive(hf_tok))
    assert len(spans) == 5  # rounds 1..5; the system prompt and the question are not
    for (a, b), fact in zip(spans, conv.facts, strict=True):
        assert fact.value in hf_tok.decode(ids[a:b])
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))


@pytest.mark.slow
def test_calibrate_watershed_prints_the_curve_and_writes_the_profile(model_path, tmp_path,
                                                                     capsys):
    from sgl_spec.calibrate.__main__ import main

    out = tmp_path / "ws.json"
    assert main(["watershed", "--model-path", model_path, "--quick", "--out", str(out)]) == 0
    run = capsys.readouterr()
    prof = json.loads(out.read_text())
    assert prof["layers"] == 30 and len(prof["curve"]) == 29 and len(prof["curves"]) == 3
    assert all(k >= 0 for k in prof["curve"])
    assert prof["watershed"] == watershed.find_watershed(prof["curve"])
    assert len(prof["recall"]) == 30 and len(prof["asked_ranks"]) == 3
    assert all(0 <= r <= 1 for r in prof["recall"])
    kept = prof["strategy_recall"]
    assert set(kept) == {"peak", "mass"} and set(kept["peak"]) == {"topk", "fixed", "adaptive"}
    assert all(len(v) == 30 and all(0 <= r <= 1 for r in v)
               for by in kept.values() for v in by.values())
    assert "mean KL to later" in run.out and "asked round in the top 10%" in run.out
    assert "topk / fixed / adaptive" in run.out
    assert run.out.strip().endswith(str(out))
    assert (tmp_path / "ws.png").stat().st_size > 0
    assert "watershed: conversations" in run.err  # the progress bar


@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_upper_layer_attention_over_a_working_set_equals_a_float64_dense_reference(impl, dtype):
    """Two requests of one batch, each with its own kept rounds; the upper buffers hold only
    their working sets, at upper slots the full pool's slots map to."""
    from sgl_spec.kernels.sparse_decode import default_impl, sparse_decode
    from sgl_spec.rounds import working_set
    from sgl_spec.tiers.working_set import UpperSlots

    g = torch.Generator().manual_seed(0)
    full, upper_n, hkv, hq, d = 96, 56, 2, 6, 64  # the default model's head_dim and group
    fk = torch.randn(full, hkv, d, generator=g).to(dtype)
    fv = torch.randn(full, hkv, d, generator=g).to(dtype)
    r2t = torch.randperm(full, generator=g)[:80].view(2, 40).to(torch.int32)
    spans = [(0, 6), (6, 14), (14, 22), (22, 30)]  # round 0 and three earlier rounds
    kept = [working_set.kept_positions(spans, [0, 2]), working_set.kept_positions(spans, [0, 1, 3])]
    seq_lens, current = torch.tensor([40, 37]), torch.tensor([30, 30])
    slots = UpperSlots(full, upper_n)
    uk = torch.full((upper_n, hkv, d), float("nan")).to(dtype)  # unloaded rows: poison
    uv = torch.full((upper_n, hkv, d), float("nan")).to(dtype)
    for b in range(2):
        pos = torch.cat([kept[b], torch.arange(int(current[b]), int(seq_lens[b]))])
        fs = r2t[b, pos].long()
        up = slots.assign(fs)
        assert up is not None
        uk[up], uv[up] = fk[fs], fv[fs]
    sub = working_set.subsets(r2t, torch.tensor([0, 1]), seq_lens, kept, current, slots, hkv)
    q = torch.randn(2, hq, d, generator=g).to(dtype)
    if impl == "cpu" and default_impl(q, uk, uv) != "cpu":
        pytest.skip("the C++ kernel is not built here")
    got = sparse_decode(q, uk, uv, sub, scale=d ** -0.5, impl=impl).double()
    for b in range(2):
        pos = torch.cat([kept[b], torch.arange(int(current[b]), int(seq_lens[b]))])
        k, v = fk[r2t[b, pos].long()].double(), fv[r2t[b, pos].long()].double()
        for h in range(hq):
            p = torch.softmax(q[b, h].double() @ k[:, h // 3].T * d ** -0.5, dim=-1)
            ref = p @ v[:, h // 3]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got[b, h], ref, atol=tol, rtol=tol), (b, h)


def test_a_working_set_with_an_unloaded_round_is_refused():
    from sgl_spec.rounds import working_set
    from sgl_spec.tiers.working_set import UpperSlots

    slots = UpperSlots(16, 8)
    r2t = torch.arange(16, dtype=torch.int32).view(1, 16)
    slots.assign(torch.arange(12, 16))  # the current round only
    kept = [working_set.kept_positions([(0, 2), (2, 6)], [1])]
    with pytest.raises(ValueError, match=r"positions \[2, 3, 4, 5\] have no upper slot"):
        working_set.subsets(r2t, torch.tensor([0]), torch.tensor([16]), kept,
                            torch.tensor([12]), slots, 1)
    with pytest.raises(ValueError, match="is in its current round"):
        working_set.subsets(r2t, torch.tensor([0]), torch.tensor([16]),
                            [torch.tensor([13])], torch.tensor([12]), slots, 1)


def test_asked_rank_and_recall_by_hand():
    # one KV group, two question tokens, three rounds over T = 6 keys: token 0 spreads over
    # rounds 0 and 1, token 1 looks round 2 up
    p = torch.tensor([[[0.3, 0.2, 0.3, 0.2, 0.0, 0.0],
                       [0.1, 0.0, 0.0, 0.1, 0.6, 0.2]]])  # [Hkv 1, n 2, T 6]
    spans = [(0, 2), (2, 4), (4, 6)]
    assert watershed.asked_rank(p, spans, 2) == 1  # its peak: 0.6 against 0.3 and 0.3
    assert watershed.asked_rank(p, spans, 0) == 2  # ties count as not above
    # recall: the top tenth of 20 rounds is 2, of 5 rounds 1
    ranks = [[1, 3], [2, 1], [1, 2]]
    assert watershed.recall(ranks, [20, 20, 5]) == [1.0, 1 / 3]
    assert watershed.recall([], []) == []


def test_kept_by_each_strategy_and_score_by_hand():
    # one KV group, one question token: a long round spreads 0.6 of the mass (0.1 a key),
    # a short one holds the fact (0.35 on one key)
    p = torch.tensor([[[0.1] * 6 + [0.35, 0.05]]])  # [Hkv 1, n 1, T 8]
    spans = [(0, 6), (6, 8)]
    k = watershed.kept(p, spans, asked=1, recent=0)
    # peak shares 0.22 / 0.78: every strategy keeps the fact's round
    assert k["peak"] == {"topk": True, "fixed": True, "adaptive": True}
    # mass shares 0.6 / 0.4: topk keeps the long round only; fixed keeps both (> 0.1);
    # adaptive (mean + 3 std = 1.1) only the most attended, the long one
    assert k["mass"] == {"topk": False, "fixed": True, "adaptive": False}
    # kept per conversation and layer -> per score and strategy, per layer
    rec = watershed.strategy_recall([[k, k], [k, watershed.kept(p, spans, 0, 0)]])
    assert rec["peak"]["topk"] == [1.0, 0.5] and rec["mass"]["fixed"] == [1.0, 1.0]

