"""The multi-turn QA dataset generator, offline: determinism, placement, planted facts."""

from __future__ import annotations

import dataclasses
import re

import pytest

from sgl_spec.bench import dataset
from sgl_spec.bench.dataset import DatasetConfig, Fact


QUICK = DatasetConfig.preset("quick")
# Small but with every shape feature: 2-4 turns, 3 facts per turn, all positions.
SMALL = DatasetConfig(seed=5, conversations=6, turns=(2, 4), tokens_per_turn=(300, 600),
                      facts_per_turn=3)


@pytest.fixture(scope="module")
def small(tok):
    return dataset.generate(SMALL, tok)


@pytest.fixture(scope="module")
def default_convs(hf_tok):
    return dataset.generate(DatasetConfig.preset("default"), hf_tok)


def _count_word(word: str, text: str) -> int:
    return len(re.findall(rf"\b{re.escape(word)}\b", text, re.IGNORECASE))


# --------------------------------------------------------------------------- facts


def test_fact_wording():
    fact = Fact(turn=0, colour="blue", object="lighthouse", kind="number", value="4817")
    assert fact.sentence == "The secret code of the blue lighthouse is 4817."
    assert fact.question() == ("Question: What is the secret code of the blue lighthouse? "
                             "Answer with the number only.")
    word = Fact(turn=1, colour="green", object="bicycle", kind="word", value="falcon")
    assert word.sentence == "The password of the green bicycle is falcon."
    assert word.question().endswith("Answer with one word only.")


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "colour", "value": "4817"}, "valid"),
    ({"kind": "number", "value": ""}, "one word"),
    ({"kind": "word", "value": "two words"}, "one word"),
], ids=["unknown-kind", "empty-value", "two-word-value"])
def test_fact_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fact(turn=0, colour="red", object="kite", **kwargs)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_conversations(tok, small):
    assert dataset.generate(SMALL, tok) == small


def test_different_seed_different_conversations(tok, small):
    other = dataset.generate(dataclasses.replace(SMALL, seed=6), tok)
    assert [c.user_turns for c in other] != [c.user_turns for c in small]
    assert {t.answer for c in other for t in c.turns} != {t.answer for c in small for t in c.turns}


# --------------------------------------------------------------------------- placement


def _assert_placed(turn) -> None:
    msg, q = turn.user_message, turn.question
    assert msg.count(q) == 1
    start = msg.index(q)
    if turn.position == "begin":
        assert start == 0
    elif turn.position == "end":
        assert msg.endswith(q)
    else:  # the whole question inside the middle third
        assert len(msg) / 3 <= start and start + len(q) <= 2 * len(msg) / 3
    # The rest of the message is the context, only the whitespace at the seam moves.
    assert msg.replace(q, " ").split() == turn.context.split()


@pytest.mark.parametrize("position", dataset.POSITIONS)
def test_question_position(tok, position):
    convs = dataset.generate(dataclasses.replace(SMALL, positions=(position,)), tok)
    for turn in (t for c in convs for t in c.turns):
        assert turn.position == position
        _assert_placed(turn)


def test_place_middle_prefers_a_paragraph_break():
    context = "A. B.\n\nC. D.\n\nE. F."
    assert dataset.place("Q?", context, "middle") == "A. B.\n\nQ?\n\nC. D.\n\nE. F."
    assert dataset.place("Q?", context, "begin") == "Q?\n\n" + context
    assert dataset.place("Q?", context, "end") == context + "\n\nQ?"
    with pytest.raises(ValueError, match="begin"):
        dataset.place("Q?", context, "top")


def test_positions_and_sources_are_balanced(small):
    s = dataset.stats(small)
    counts = [s["positions"][p] for p in dataset.POSITIONS]
    assert sum(counts) == s["turns"] and max(counts) - min(counts) <= 1
    eligible = s["turns"] - s["conversations"]
    assert s["sources"]["earlier_turn"] == round(SMALL.earlier_turn_share * eligible)


# --------------------------------------------------------------------------- planted facts


def test_each_fact_planted_exactly_once(small):
    for conv in small:
        everything = "\n".join(conv.user_turns)
        for turn in conv.turns:
            assert len(turn.facts) == SMALL.facts_per_turn
            for fact in turn.facts:
                assert fact.turn == turn.index
                assert turn.context.count(fact.sentence) == 1
                assert fact.sentence in turn.user_message
                assert all(fact.sentence not in other.context
                           for other in conv.turns if other is not turn)
                assert _count_word(fact.value, everything) == 1


def test_keys_and_values_unique_in_a_conversation(small):
    for conv in small:
        facts = [f for t in conv.turns for f in t.facts]
        assert len({f.object for f in facts}) == len(facts)
        assert len({f.value for f in facts}) == len(facts)


def test_question_sources(small):
    for conv in small:
        for turn in conv.turns:
            assert turn.answer == turn.fact.value
            assert turn.question == turn.fact.question()
            if turn.source == "this_turn":
                assert turn.fact in turn.facts
            else:
                assert turn.index > 0
                assert turn.fact in conv.turns[turn.fact.turn].facts
                assert turn.fact.turn < turn.index
        assert conv.turns[0].source == "this_turn"


@pytest.mark.parametrize("share, expect", [(0.0, "this_turn"), (1.0, "earlier_turn")],
                         ids=["share-0", "share-1"])
def test_earlier_turn_share_extremes(tok, share, expect):
    convs = dataset.generate(dataclasses.replace(SMALL, earlier_turn_share=share), tok)
    assert all(t.source == expect for c in convs for t in c.turns[1:])


# --------------------------------------------------------------------------- sizes


def test_token_lengths_stub_tokenizer(tok, small):
    for conv in small:
        assert conv.tokens_per_turn in SMALL.tokens_per_turn
        assert SMALL.turns[0] <= len(conv.turns) <= SMALL.turns[1]
        for turn in conv.turns:
            assert turn.n_tokens == len(tok.encode(turn.user_message))
            assert abs(turn.n_tokens - conv.tokens_per_turn) <= 0.15 * conv.tokens_per_turn


def test_default_preset_real_tokenizer(hf_tok, default_convs):
    for conv in default_convs:
        for turn in conv.turns:
            assert turn.n_tokens == len(hf_tok.encode(turn.user_message, add_special_tokens=False))
            assert abs(turn.n_tokens - conv.tokens_per_turn) <= 0.15 * conv.tokens_per_turn
            _assert_placed(turn)
            assert all(f.sentence in turn.context for f in turn.facts)
    s = dataset.stats(default_convs)
    assert s["conversations"] == 18 and s["turns"] == 54
    assert s["turns_per_conversation"] == {2: 6, 3: 6, 4: 6}
    assert s["positions"] == {"begin": 18, "middle": 18, "end": 18}
    assert s["sources"] == {"this_turn": 36, "earlier_turn": 18}
    assert 850 <= s["history_tokens"]["min"] <= 1000
    assert 6500 <= s["history_tokens"]["max"] <= 7000


# --------------------------------------------------------------------------- config, io


@pytest.mark.parametrize("kwargs, match", [
    ({"conversations": 0}, "conversations"),
    ({"turns": (3, 2)}, "turns"),
    ({"turns": (0, 2)}, "turns"),
    ({"tokens_per_turn": ()}, "tokens_per_turn"),
    ({"tokens_per_turn": (100,)}, "tokens_per_turn"),
    ({"facts_per_turn": 0}, "facts_per_turn"),
    ({"facts_per_turn": 9}, "facts_per_turn"),
    ({"earlier_turn_share": 1.5}, "earlier_turn_share"),
    ({"earlier_turn_share": -0.1}, "earlier_turn_share"),
    ({"positions": ("top",)}, r"\('begin', 'middle', 'end'\)"),
    ({"positions": ()}, "positions"),
    ({"positions": ("begin", "begin")}, "distinct"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tokens_per_turn": (2500,)}, "context window"),
], ids=["no-conversations", "turns-reversed", "zero-turns", "no-sizes", "size-too-small",
        "no-facts", "too-many-facts", "share-above-1", "share-negative", "unknown-position",
        "no-positions", "duplicate-position", "no-answer-budget", "over-window"])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetConfig(**kwargs)


def test_presets():
    default = DatasetConfig.preset("default")
    assert default.tokens_per_turn == (500, 1000, 1750) and default.turns == (2, 4)
    assert QUICK.conversations == 3 and QUICK.tokens_per_turn == (400,)
    with pytest.raises(ValueError, match=r"\['default', 'late-needles', 'long-context', "
                       r"'long-context-quick', 'long-turns', 'quick'\]"):
        DatasetConfig.preset("huge")


def test_late_needles_are_long_answers_past_the_sparse_threshold(tok):
    """Every question in the long style over 3-4k tokens of history (above the default
    --spec-min-context 2048, inside the default model's reach), 4 per position."""
    s = dataset.stats(dataset.generate(DatasetConfig.preset("late-needles"), tok))
    assert s["styles"] == {"long": 12} and s["positions"] == {"begin": 4, "middle": 4, "end": 4}
    assert 2048 < s["history_tokens"]["min"] and s["history_tokens"]["max"] < 4096


def test_quick_stats(tok):
    s = dataset.stats(dataset.generate(QUICK, tok))
    assert s["conversations"] == 3
    assert sum(s["turns_per_conversation"].values()) == 3
    assert s["facts"] == s["turns"] * QUICK.facts_per_turn
    assert sum(s["positions"].values()) == sum(s["sources"].values()) == s["turns"]


def test_jsonl_round_trip(tmp_path, small):
    path = str(tmp_path / "qa.jsonl")
    dataset.to_jsonl(small, path)
    assert dataset.from_jsonl(path) == small
    with open(path) as f:
        assert sum(1 for _ in f) == len(small)


def test_to_workload(small):
    work = small[0].to_workload()
    assert work.name == small[0].name
    assert work.user_turns == tuple(t.user_message for t in small[0].turns)
