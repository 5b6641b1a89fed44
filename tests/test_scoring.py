"""Scorers for the QA and long-generation workloads, on hand-computed examples."""

from __future__ import annotations

import pytest

from sgl_spec.bench import longgen, scoring
from sgl_spec.bench.agreement import Agreement
from sgl_spec.bench.dataset import Fact, Turn

# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("text, expect", [
    ("The Code is 4817.", "code is 4817"),
    ("  A   falcon!  ", "falcon"),
    ("an apple, the pear", "apple pear"),
    ("4,817", "4817"),
    ("Theatre", "theatre"),
    ("", ""),
], ids=["sentence", "article-and-spaces", "two-articles", "thousands-comma",
        "article-inside-word", "empty"])
def test_normalize(text, expect):
    assert scoring.normalize(text) == expect


@pytest.mark.parametrize("prediction, expect", [
    ("4817", "4817"),
    ("\n\n  4817  \nBecause the text says so.", "4817"),
    ("falcon\nfalcon", "falcon"),
    ("   \n", ""),
], ids=["one-line", "leading-blank-lines", "first-of-two", "blank"])
def test_extract_answer(prediction, expect):
    assert scoring.extract_answer(prediction) == expect


# --------------------------------------------------------------------------- exact match, F1


@pytest.mark.parametrize("prediction, gold, expect", [
    ("4817", "4817", True),
    ("The secret code is 4817.", "4817", True),
    ("Falcon", "falcon", True),
    ("The password is \"falcon\".", "falcon", True),
    ("4817\nor maybe 1234", "4817", True),
    ("I think it is 1234.\nNo wait: 4817.", "4817", False),
    ("48170", "4817", False),
    ("falcons", "falcon", False),
    ("", "4817", False),
    ("blue lighthouse", "the blue lighthouse", True),
    ("lighthouse blue", "blue lighthouse", False),
], ids=["equal", "in-sentence", "case", "quoted", "first-line-only",
        "answer-on-second-line", "longer-number", "plural", "empty", "multi-token",
        "multi-token-order"])
def test_exact_match(prediction, gold, expect):
    assert scoring.exact_match(prediction, gold) is expect


@pytest.mark.parametrize("prediction, gold, expect", [
    ("4817", "4817", 1.0),
    ("The code is 4817", "4817", 0.5),          # p=1/3, r=1: 2*(1/3)/(4/3)
    ("blue lighthouse", "the red lighthouse", 0.5),  # p=1/2, r=1/2
    ("1234", "4817", 0.0),
    ("", "4817", 0.0),
    ("", "", 1.0),
    ("4817\nsomething else entirely", "4817", 1.0),
    ("red red lighthouse", "red lighthouse", 0.8),  # p=2/3, r=1: 2*(2/3)/(5/3)
], ids=["equal", "one-of-three", "half-half", "wrong", "empty-prediction", "both-empty",
        "first-line-only", "repeated-token"])
def test_token_f1(prediction, gold, expect):
    assert scoring.token_f1(prediction, gold) == pytest.approx(expect)


# --------------------------------------------------------------------------- aggregation


def _turn(index: int, fact_turn: int, position: str, value: str) -> Turn:
    fact = Fact(turn=fact_turn, colour="red", object=f"kite{fact_turn}", kind="number",
                value=value)
    own = index == fact_turn
    return Turn(index=index, context="ctx " + fact.sentence, facts=(fact,) if own else (),
                question=fact.question(), position=position,
                source="this_turn" if own else "earlier_turn",
                fact=fact, answer=value, user_message=fact.question() + "\n\nctx",
                n_tokens=10)


def test_score_turn_and_accuracy():
    turns = [_turn(0, 0, "begin", "1111"), _turn(1, 1, "middle", "2222"),
             _turn(2, 0, "end", "1111"), _turn(3, 1, "begin", "2222")]
    replies = ["1111", "Code 2222.", "The code is 9999", "2222 or 1111"]
    scores = [scoring.score_turn("c0", t, r) for t, r in zip(turns, replies)]
    assert [s.exact_match for s in scores] == [True, True, False, True]
    assert [s.f1 for s in scores] == pytest.approx([1.0, 2 / 3, 0.0, 0.5])
    assert scores[2].source == "earlier_turn" and scores[2].answer == "1111"

    acc = scoring.accuracy(scores)
    assert acc["overall"]["n"] == 4
    assert acc["overall"]["exact_match"] == pytest.approx(0.75)
    assert list(acc["by_position"]) == ["begin", "middle", "end"]
    assert acc["by_position"]["begin"] == {"n": 2, "exact_match": 1.0, "f1": pytest.approx(0.75)}
    assert acc["by_position"]["end"]["exact_match"] == 0.0
    assert acc["by_source"]["this_turn"]["exact_match"] == 1.0
    assert acc["by_source"]["earlier_turn"]["exact_match"] == 0.5
    assert set(acc["by_position_source"]) == {"begin/this_turn", "middle/this_turn",
                                              "end/earlier_turn", "begin/earlier_turn"}


def test_turn_score_validation():
    with pytest.raises(ValueError, match="begin"):
        scoring.TurnScore("c", 0, "top", "this_turn", "x", "x", True, 1.0)


# --------------------------------------------------------------------------- long generation


def test_longgen_prompts():
    prompts = longgen.prompts("default")
    assert prompts == longgen.prompts("default")
    assert len({p.name for p in prompts}) == len(prompts) >= 6
    assert all(1024 <= p.max_tokens <= 4096 for p in prompts)
    assert {p.max_tokens for p in prompts} >= {1024, 4096}
    assert [p.name for p in longgen.prompts("quick")] == ["animals", "long-division"]
    assert any("List 300 different animals" in p.prompt for p in prompts)
    work = prompts[0].to_workload()
    assert work.name == "longgen-animals" and work.user_turns == (prompts[0].prompt,)
    with pytest.raises(ValueError, match=r"\['default', 'long-context', 'quick', 'reasoning', 'reasoning-x4'\]"):
        longgen.prompts("long")


@pytest.mark.parametrize("max_tokens", [512, 8192], ids=["too-short", "too-long"])
def test_longgen_prompt_validation(max_tokens):
    with pytest.raises(ValueError, match="1024, 4096"):
        longgen.LongGenPrompt("x", "Write.", max_tokens)


@pytest.mark.parametrize("kwargs, match", [
    ({"context_tokens": -1}, "context_tokens must be >= 0"),
    ({"facts": 3}, "facts must be in .* need context_tokens > 0"),
    ({"context_tokens": 100, "facts": 99}, r"facts must be in \[0, 32\]"),
    ({"context_tokens": 7000}, "over the 8192-token window"),
], ids=["negative-context", "facts-without-context", "too-many-facts", "over-window"])
def test_long_context_prompt_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        longgen.LongGenPrompt("x", "Write.", 2048, **kwargs)


def test_long_context_prompts_stub_tokenizer(tok):
    p = next(p for p in longgen.PROMPTS if p.name == "doc-facts")
    assert [q.name for q in longgen.prompts("long-context")] == ["doc-facts", "doc-outline"]
    assert p.needs_tokenizer and p.ignore_eos
    with pytest.raises(ValueError, match="pass the tokenizer"):
        p.render()
    text = p.render(tok)
    assert text == p.render(tok)  # deterministic
    assert text.startswith(longgen.DOC_INTRO + "\n\n") and text.endswith("\n\n" + p.prompt)
    doc, facts = longgen.document_with_facts(tok, p.context_tokens, p.facts, p.seed)
    assert text == f"{longgen.DOC_INTRO}\n\n{doc}\n\n{p.prompt}"
    assert len(facts) == 8 and len({f.object for f in facts}) == 8
    assert all(doc.count(f.sentence) == 1 for f in facts)
    assert len({f.value for f in facts}) == 8
    assert len(tok.encode(doc)) <= p.context_tokens
    other = next(q for q in longgen.PROMPTS if q.name == "doc-outline")
    assert other.render(tok).split("\n\n")[1] != text.split("\n\n")[1]  # other seed


def test_long_context_prompts_real_tokenizer(hf_tok):
    """The history is over --spec-min-context (2048) from the first decode step."""
    for p in longgen.prompts("long-context"):
        text = p.render(hf_tok)
        assert text == p.render(hf_tok)
        chat = hf_tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
        n = len(hf_tok.encode(chat, add_special_tokens=False))
        assert 2048 < 0.95 * p.context_tokens <= n
        assert n - p.context_tokens <= longgen.PROMPT_OVERHEAD_TOKENS
        assert n + p.max_tokens <= 8192


def test_longgen_score():
    assert longgen.score([1, 2, 3], [1, 2, 4]) == Agreement(2, 2 / 3)
    assert longgen.summarize([longgen.score([1], [1])])["identical"] == 1


def test_look_ahead_adds_the_largest_mass_before_each_position_past_the_sink():
    import torch

    from sgl_spec.sparse.scoring import look_ahead

    x = torch.tensor([[[9.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0]]])  # [R=1, Hkv=1, N=7]
    lo = torch.tensor([1])  # position 0 is the sink: its 9 reaches no one
    # own mass + the largest of itself and the 2 before it: 5 counts twice where it is
    assert look_ahead(x, 2, lo).tolist() == [[[9.0, 0.0, 10.0, 5.0, 5.0, 0.0, 2.0]]]
    assert torch.equal(look_ahead(x, 0, lo), x)
    two = torch.stack([x[0], x[0]])  # rows with their own sinks
    out = look_ahead(two, 1, torch.tensor([0, 3]))
    assert out[0, 0].tolist() == [18.0, 9.0, 10.0, 5.0, 0.0, 0.0, 2.0]
    assert out[1, 0].tolist() == [9.0, 0.0, 5.0, 0.0, 0.0, 0.0, 2.0]


def test_ties_go_to_the_earlier_position_whatever_the_batch():
    import torch

    from sgl_spec.sparse.scoring import select_topk

    flat = torch.zeros(1, 1, 64)
    flat[0, 0, 10:30] = 1.0  # a plateau of 20 equal scores, 8 of them selected
    lo, hi = torch.tensor([2]), torch.tensor([60])
    one = select_topk(flat, 8, lo, hi, first_of_ties=True)
    assert one[0, 0].tolist() == list(range(10, 18))
    batch = torch.cat([torch.rand(3, 1, 64), flat])  # the same row beside others
    many = select_topk(batch, 8, torch.tensor([2] * 4), torch.tensor([60] * 4),
                       first_of_ties=True)
    assert torch.equal(many[3], one[0])
