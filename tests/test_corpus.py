"""Benchmark texts without a server: the prose corpus and the speed chats built from it."""

from __future__ import annotations

import pytest

from sgl_spec import corpus
from sgl_spec.bench import chats


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
    cfg = chats.ChatConfig(conversations=2, turns=4, first_tokens=1000, turn_tokens=500)
    a = chats.conversations(tok, cfg, "g")
    assert a == chats.conversations(tok, cfg, "g")
    assert [c.name for c in a] == ["g-0", "g-1"]
    assert all(len(c.user_turns) == 4 for c in a)
    assert a[0].user_turns[0] != a[1].user_turns[0]
    assert len(tok.encode(a[0].user_turns[0])) > 1000
    assert 500 < len(tok.encode(a[0].user_turns[1])) < 600


@pytest.mark.parametrize("name", ["doc_chat", "doc_chat-quick"])
def test_doc_chat_followups_are_short(tok, name):
    cfg = chats.preset(name)
    assert cfg.follow_ups
    conv = chats.conversations(tok, cfg, "d")[0]
    assert len(tok.encode(conv.user_turns[0])) >= cfg.first_tokens
    assert all(len(tok.encode(q)) < 120 for q in conv.user_turns[1:])


def test_chat_presets_are_the_compared_workloads():
    """The sizes the stock-vs-exact comparison measured (README): 3 x 5 turns over a
    3000-token document, 6 growing turns of 950 tokens; the quick ones 1 x 3."""
    doc, grow = chats.preset("doc_chat"), chats.preset("growing")
    assert (doc.conversations, doc.turns, doc.first_tokens, doc.turn_tokens,
            doc.max_tokens) == (3, 5, 3000, 0, 64)
    assert (grow.conversations, grow.turns, grow.first_tokens, grow.turn_tokens,
            grow.seed) == (1, 6, 950, 950, 100)
    assert not grow.follow_ups
    quick = chats.preset("growing-quick")
    assert (quick.turns, quick.turn_tokens, quick.max_tokens) == (3, 1000, 32)
    with pytest.raises(ValueError, match=r"unknown chat 'doc'; valid: \['doc_chat'"):
        chats.preset("doc")


def test_chat_config_rejects_overflow():
    with pytest.raises(ValueError, match="context window"):
        chats.ChatConfig(conversations=1, turns=8, first_tokens=1000, turn_tokens=1000)
