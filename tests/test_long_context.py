"""The long-context evaluation pieces without a server or the opt-in model: the
dataset preset and its long-style questions, their scoring, where answers come in the
output and how much decoding before them was sparse, the config set and its quick plan."""

from __future__ import annotations

import dataclasses
import os

import pytest

from sgl_spec.bench import configset, dataset, plan, scoring, summary
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.dataset import DatasetConfig, Fact
from sgl_spec.config import DecodeConfig

LONG_SET = os.path.join(configset.CONFIG_DIR, "long-context.toml")


@pytest.fixture(scope="module")
def quick_convs(tok):
    return dataset.generate(DatasetConfig.preset("long-context-quick"), tok)


def test_long_context_preset_shape():
    full = DatasetConfig.preset("long-context")
    assert full.context_len == 32768 and full.long_answer_share == 0.5
    assert full.conversations * full.turns[0] == 54  # 18 questions per position
    assert min(full.tokens_per_turn) >= 4096 and 2 * max(full.tokens_per_turn) <= 16384
    assert DatasetConfig.preset("long-context-quick").conversations == 3
    with pytest.raises(ValueError, match="over the 8192-token context window"):
        DatasetConfig(turns=(2, 2), tokens_per_turn=(8000,))
    with pytest.raises(ValueError, match=r"long_answer_share must be in \[0, 1\]"):
        DatasetConfig(long_answer_share=1.5)


def test_long_context_dataset_is_balanced(tok):
    convs = dataset.generate(DatasetConfig.preset("long-context"), tok)
    s = dataset.stats(convs)
    assert s["positions"] == {"begin": 18, "middle": 18, "end": 18}
    assert s["styles"] == {"short": 27, "long": 27}
    turns = [t for c in convs for t in c.turns]
    for p in dataset.POSITIONS:  # the long style is dealt per position
        assert sum(t.style == "long" for t in turns if t.position == p) == 9
    assert s["sources"]["earlier_turn"] > 0
    # 4k-16k tokens of conversation up to each question.
    for c in convs:
        assert c.turns[0].n_tokens >= 4000 and c.history_tokens <= 16384


def test_long_questions_restate_a_long_subject(quick_convs):
    turns = [t for c in quick_convs for t in c.turns]
    long = [t for t in turns if t.style == "long"]
    short = [t for t in turns if t.style == "short"]
    assert long and short
    for t in long:
        assert t.fact.qualifier and "repeats the whole subject" in t.question
        assert t.fact.sentence in (quick_convs[0].turns[0].context + "".join(
            x.context for c in quick_convs for x in c.turns))
        assert len(t.fact.key.split()) >= 20  # ~24 tokens restated before the value
    for t in short:
        assert t.question.endswith(("Answer with the number only.",
                                    "Answer with one word only."))


def test_default_dataset_has_no_long_subjects(tok):
    convs = dataset.generate(DatasetConfig.preset("quick"), tok)
    assert all(t.style == "short" and not t.fact.qualifier for c in convs for t in c.turns)


def test_jsonl_round_trip_keeps_styles(quick_convs, tmp_path):
    path = str(tmp_path / "d.jsonl")
    dataset.to_jsonl(quick_convs, path)
    assert dataset.from_jsonl(path) == quick_convs


def test_fact_question_styles():
    fact = Fact(0, "blue", "lighthouse", "number", "4817", "that the county surveyor "
                "wrote in its winter maintenance ledger during the first week of the fair")
    assert fact.sentence.startswith("The secret code of the blue lighthouse that the county")
    assert fact.question("long").endswith("repeats the whole subject of the question, "
                                          "then the number.")
    with pytest.raises(ValueError, match=r"unknown question style 'poem'; valid: \('short', "
                                         r"'long'\)"):
        fact.question("poem")


@pytest.mark.parametrize("reply, style, em", [
    ("The secret code of the blue lighthouse that the council wrote\nis 4817.", "long", True),
    ("The secret code of the blue lighthouse that the council wrote\nis 4817.", "short",
     False),  # the short style reads the first line only
    ("The secret code of the blue lighthouse is 48170.", "long", False),
    ("4817", "short", True),
], ids=["long-two-lines", "short-first-line", "long-wrong", "short"])
def test_long_style_scoring(reply, style, em):
    assert scoring.exact_match(reply, "4817", style) is em
    assert (scoring.token_f1(reply, "4817", style) == 1.0) is (em and style == "long"
                                                               or reply == "4817")


@pytest.mark.parametrize("tokens, gold, step", [
    (["4", "8", "1", "7"], "4817", 0),
    (["The", " code", " of", " the", " barn", " is", " ", "4", "8", "1", "7", "."], "4817", 7),
    (["The", " password", " is", " mango", "."], "mango", 3),
    (["48170", "."], "4817", None),  # a longer number is not the answer
    (["The", " code", " is", " unknown", "."], "4817", None),
], ids=["first", "digits", "word", "not-a-prefix", "absent"])
def test_answer_step(tokens, gold, step):
    assert scoring.answer_step(tokens, gold) == step


def test_first_sparse_step_by_mode():
    long, short = 8000, 1000
    assert DecodeConfig(mode="exact").first_sparse_step(long) is None
    assert DecodeConfig(mode="loopserve").first_sparse_step(long) == 16
    assert DecodeConfig(mode="loopserve", prompt_seed=True).first_sparse_step(long) == 0
    assert DecodeConfig(mode="loopserve").first_sparse_step(short) is None  # < min_context
    assert DecodeConfig(mode="snapkv").first_sparse_step(long) == 0
    assert DecodeConfig(mode="streaming", budget=1).first_sparse_step(long) == 0
    assert DecodeConfig(mode="loopserve", budget=8000).first_sparse_step(long) is None


def _result(tokens: list[str], prompt_tokens: int) -> TurnResult:
    return TurnResult("c", 1, 0.1, 1.0, prompt_tokens, 0, len(tokens), "stop", "".join(tokens),
                      "sha", tuple(range(len(tokens))),
                      tuple(((t, -0.1), ("x", -3.0)) for t in tokens))


def _chat_turn(tokens, style, prompt_tokens=8000):
    text = "".join(tokens)
    score = scoring.TurnScore("c", 0, "end", "this_turn", text, "4817",
                              scoring.exact_match(text, "4817", style), 1.0, style)
    return summary.ChatTurn(_result(tokens, prompt_tokens), score, 4200)


def test_answer_timing_counts_sparse_steps_before_the_answers():
    late = [" w"] * 30 + [" 4817", "."]
    turns = [_chat_turn(["4817"], "short"), _chat_turn(late, "long"),
             _chat_turn(late, "long", prompt_tokens=1000),  # dense: history too short
             _chat_turn(["no"], "long")]  # never answered
    dense = summary.answer_timing(turns)
    assert dense["decode_steps_before_answer"] == 60 and dense["sparse_steps_before_answer"] == 0
    assert dense["by_style"]["long"] == {"n": 3, "answered": 2, "median_step": 30,
                                         "min_step": 30, "share_late": 1.0}
    assert dense["by_style"]["short"]["median_step"] == 0
    loop = summary.answer_timing(turns, DecodeConfig(mode="loopserve").first_sparse_step)
    assert loop["sparse_steps_before_answer"] == 30 - 16
    assert loop["sparse_share_before_answer"] == pytest.approx(14 / 60)
    snap = summary.answer_timing(turns, DecodeConfig(mode="snapkv").first_sparse_step)
    assert snap["sparse_steps_before_answer"] == 30
    assert summary.turn_record(turns[1])["answer_step"] == 30


def test_long_context_set_rows_and_quick_plan():
    s = configset.load(LONG_SET)
    names = [c.name for c in s.configs]
    assert names[0] == "sgl_spec exact" == s.reference.name == s.baseline.name
    assert names[-1] == "stock"
    for row in ("loopserve B=512", "loopserve B=1024", "loopserve B=2048", "snapkv B=1024",
                "streaming B=1024", "loopserve prefill a=0.955", "loopserve prefill a=0.97",
                "loopserve prefill a=0.98", "loopserve B=1024 + prefill a=0.97"):
        assert row in names
    by = {c.name: c for c in s.configs}
    assert by["stock"].spec() is None
    combo = by["loopserve B=1024 + prefill a=0.97"].spec()
    assert (combo.decode.mode, combo.decode.budget) == ("loopserve", 1024)
    assert (combo.prefill.mode, combo.prefill.alpha) == ("loopserve", 0.97)
    assert plan.choose(s.plan, quick=False).dataset == "long-context"
    quick = plan.choose(s.plan, quick=True)
    assert quick.dataset == "long-context-quick" and quick.longgen == () and quick.chats == ()
    # A set without a quick form of its dataset gets the harness' quick plan.
    assert plan.choose(configset.load().plan, quick=True).dataset == "quick"


def test_only_some_rows_keeps_baseline_and_reference():
    s = configset.load(LONG_SET).only(["loopserve B=1024"])
    assert [c.name for c in s.configs] == ["sgl_spec exact", "loopserve B=1024"]
    assert s.within_points == (("loopserve B=1024", 3),)
    with pytest.raises(ValueError, match=r"has no row\(s\) \['loopserve B=4096'\]; valid: "):
        configset.load(LONG_SET).only(["loopserve B=4096"])


def test_long_subjects_share_no_words_within_a_conversation(tok):
    cfg = dataclasses.replace(DatasetConfig.preset("long-context-quick"), facts_per_turn=4)
    for conv in dataset.generate(cfg, tok):
        quals = [f.qualifier for t in conv.turns for f in t.facts]
        assert len(quals) == 8
        for part in ("that ", " wrote in ", " during "):
            pieces = [q.split(part)[-1].split(" wrote in ")[0].split(" during ")[0]
                      for q in quals]
            assert len(set(pieces)) == len(pieces), pieces
    with pytest.raises(ValueError, match="distinct for at most 8 facts per conversation, "
                                         "got 5 \\* 2"):
        dataclasses.replace(cfg, facts_per_turn=5)
