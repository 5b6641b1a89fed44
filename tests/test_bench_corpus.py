"""Benchmark helpers without a server: corpus, workloads, report ratios and divergences."""

from __future__ import annotations


import pytest

from sgl_spec.bench import corpus, report, workloads
from sgl_spec.bench.chat_client import TurnResult


def test_pool_is_prose_and_fixed():
    pool = corpus.paragraphs()
    assert len(pool) > 300
    assert len({text for _, text in pool}) == len(pool)
    for source, text in pool:
        assert source.split(".")[0] in {m.split(".")[0] for m in corpus.MODULES}
        assert ">>>" not in text and "\n" not in text
        assert len(text.split()) >= corpus.MIN_WORDS


@pytest.mark.parametrize("n_tokens", [300, 1000, 3000], ids=lambda n: f"{n}tok")
def test_document_length(tok, n_tokens):
    n = len(tok.encode(corpus.document(tok, n_tokens, seed=0)))
    assert n_tokens * 0.98 <= n <= n_tokens


@pytest.mark.parametrize("n_tokens", [1000, 3000, 6000], ids=lambda n: f"{n}tok")
def test_document_length_real_tokenizer(hf_tok, n_tokens):
    text = corpus.document(hf_tok, n_tokens, seed=3)
    n = len(hf_tok.encode(text, add_special_tokens=False))
    assert n_tokens * 0.98 <= n <= n_tokens


def test_document_is_deterministic_per_seed(tok):
    a = corpus.document(tok, 1500, seed=7)
    assert a == corpus.document(tok, 1500, seed=7)
    assert a != corpus.document(tok, 1500, seed=8)


def test_passages_join_to_document(tok):
    ps = corpus.passages(tok, 800, seed=2)
    assert corpus.join(ps) == corpus.document(tok, 800, seed=2)
    assert all(p.n_tokens == len(tok.encode(p.text)) for p in ps)


def test_chunks_are_disjoint(tok):
    groups = corpus.chunks(tok, [1000, 500, 500, 500], seed=4)
    texts = [p.text for g in groups for p in g]
    assert len(texts) == len(set(texts))
    sizes = [len(tok.encode(corpus.join(g))) for g in groups]
    assert [s >= 0.98 * n and s <= n for s, n in zip(sizes, [1000, 500, 500, 500])] == [True] * 4


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_length_raises(tok, bad):
    with pytest.raises(ValueError, match="positive"):
        corpus.passages(tok, bad, seed=0)


def test_too_long_raises(tok):
    with pytest.raises(ValueError, match="fewer than"):
        corpus.document(tok, 10_000_000, seed=0)


def test_conversations_deterministic_and_shaped(tok):
    cfg = workloads.ChatConfig(conversations=2, turns=4, first_tokens=1000, turn_tokens=500)
    a = workloads.conversations(tok, cfg, "g")
    assert a == workloads.conversations(tok, cfg, "g")
    assert [c.name for c in a] == ["g-0", "g-1"]
    assert all(len(c.user_turns) == 4 for c in a)
    assert a[0].user_turns[0] != a[1].user_turns[0]
    assert len(tok.encode(a[0].user_turns[0])) > 1000
    assert 500 < len(tok.encode(a[0].user_turns[1])) < 600


def test_doc_chat_followups_are_short(tok):
    cfg = workloads.WorkloadConfig.preset(quick=False).doc_chat
    conv = workloads.conversations(tok, cfg, "d")[0]
    assert len(tok.encode(conv.user_turns[0])) >= cfg.first_tokens
    assert all(len(tok.encode(q)) < 120 for q in conv.user_turns[1:])


def test_chat_config_rejects_overflow():
    with pytest.raises(ValueError, match="context window"):
        workloads.ChatConfig(conversations=1, turns=8, first_tokens=1000, turn_tokens=1000)


# ------------------------------------------------------------------------- report


def _turn(conv="c", turn=1, ttft=1.0, latency=2.0, out=11, ids=(1, 2, 3), top=None,
          cached=0, prompt="p") -> TurnResult:
    top = top if top is not None else tuple(((f"t{i}", -0.1), ("x", -3.0)) for i in ids)
    return TurnResult(conversation=conv, turn=turn, ttft_s=ttft, latency_s=latency,
                      prompt_tokens=100, cached_tokens=cached, output_tokens=out,
                      finish_reason="length", text="", prompt_sha1=prompt,
                      output_ids=tuple(ids), top_logprobs=top)


@pytest.mark.parametrize(
    ("spec", "stock", "want"),
    [(1.0, 4.0, 0.25), (3.0, 3.0, 1.0), (None, 1.0, None), (1.0, 0.0, None)],
    ids=["faster", "equal", "missing", "zero-baseline"],
)
def test_ratio(spec, stock, want):
    assert report.ratio(spec, stock) == want


def test_ratios_only_shared_numbers():
    got = report.ratios({"a": 2.0, "b": "x", "c": 1, "d": None}, {"a": 4.0, "c": 2, "b": "y"})
    assert got == {"a": 0.5, "c": 0.5}


def test_tpot_and_summary():
    turns = [_turn(turn=1, ttft=3.0, latency=4.0, out=11),
             _turn(turn=2, ttft=1.0, latency=3.0, out=21, cached=90),
             _turn(turn=3, ttft=2.0, latency=3.0, out=1, cached=110)]
    assert turns[0].tpot_s == pytest.approx(0.1)
    assert turns[2].tpot_s is None
    s = report.summarize_turns(turns)
    assert s.ttft_turn1_mean_s == 3.0
    assert s.ttft_later_mean_s == 1.5
    assert s.tpot_median_s == pytest.approx(0.1)
    assert s.output_tok_per_s == pytest.approx(33 / 10)
    assert s.cached_tokens_later_mean == 100
    assert s.cached_tokens_total == 200


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [((1, 2, 3), (1, 2, 3), None), ((1, 2, 3), (1, 5, 3), 1), ((1, 2), (1, 2, 3), 2),
     ((), (), None), ((4,), (5,), 0)],
    ids=["equal", "middle", "prefix", "empty", "first"],
)
def test_first_divergence(a, b, want):
    assert report.first_divergence(a, b) == want


def test_divergence_margin_and_near_tie():
    stock = _turn(ids=(1, 2, 3), top=((("a", -0.1), ("b", -2.0)), (("c", -0.60), ("d", -0.62)),
                                      (("e", -0.1), ("f", -1.0))))
    tie = _turn(ids=(1, 9, 3), top=((("a", -0.1), ("b", -2.0)), (("d", -0.60), ("c", -0.65)),
                                    (("e", -0.1), ("f", -1.0))))
    d = report.divergence(stock, tie)
    assert (d.position, d.stock_token, d.spec_token) == (1, 2, 9)
    assert d.stock_margin == pytest.approx(0.02)
    assert d.spec_margin == pytest.approx(0.05)
    assert d.near_tie
    wide = _turn(ids=(7, 2, 3), top=((("z", -0.1), ("a", -2.0)),) * 3)
    d = report.divergence(stock, wide)
    assert d.position == 0 and d.stock_margin == pytest.approx(1.9) and not d.near_tie
    assert report.divergence(stock, _turn(ids=(1, 2, 3))) is None


def test_divergence_at_eos_has_no_margin():
    stock = _turn(ids=(1, 2), top=((("a", -0.1), ("b", -2.0)),))  # EOS has no logprobs
    spec = _turn(ids=(1, 2, 3), top=((("a", -0.1), ("b", -2.0)), (("c", -1.0), ("d", -1.01))))
    d = report.divergence(stock, spec)
    assert d.position == 2 and d.stock_token is None and d.stock_margin is None
    assert d.spec_margin is None and not d.near_tie


def test_compare_and_agreement():
    stock = [_turn(turn=1), _turn(turn=2, ids=(1, 2, 4)), _turn(turn=3)]
    spec = [_turn(turn=1), _turn(turn=2, ids=(1, 2, 5), prompt="q"), _turn(turn=3, ids=(8,))]
    rows = report.compare_turns(stock, spec)
    assert [r["identical"] for r in rows] == [True, False, False]
    assert [r["same_prompt"] for r in rows] == [True, False, True]
    agree = report.agreement(rows)
    assert agree == {"turns": 3, "identical": 1, "near_tie_divergences": 0,
                     "other_divergences": 2, "same_prompts": 2, "acceptable": False}
    with pytest.raises(ValueError, match="no result"):
        report.compare_turns(stock, spec[:1])


def test_markdown_has_ratios_and_divergences():
    stock = [_turn(turn=1, ttft=3.0), _turn(turn=2, ttft=2.0, ids=(1, 2, 4))]
    spec = [_turn(turn=1, ttft=3.0), _turn(turn=2, ttft=0.2, ids=(1, 2, 5))]
    compared = report.compare_turns(stock, spec)
    a = vars(report.summarize_turns(stock))
    b = vars(report.summarize_turns(spec))
    results = {
        "meta": {"started": "now", "model": "m"},
        "servers": {s: {"start_s": 20.0, "peak_rss_bytes": 2**31} for s in ("stock", "spec")},
        "workloads": {"doc_chat": {"stock": a, "spec": b, "ratio": report.ratios(b, a),
                                   "agreement": report.agreement(compared),
                                   "turns_compared": compared}},
    }
    md = report.markdown(results)
    assert "| doc_chat | **ratio** | 1x | **0.1x** |" in md
    assert "1/2 identical, 0 near-tie, 1 other" in md
    assert "## Divergent turns" in md and "| doc_chat | c | 2 | 2 | 4 | 5 |" in md
