"""Turn formats derived from chat templates, and the token scan that uses them."""

from __future__ import annotations

from pathlib import Path

import pytest

from _turn_cache import END_THINK, FMT, IM_END, IM_START, NL, THINK, USER, turn
from sgl_spec.cache.rounds import RequestRounds
from sgl_spec.cache.segment import UNTAGGED, TurnTag, segment
from sgl_spec.cache.turn_format import TurnFormat, derive

DATA = Path(__file__).parent / "data"
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


def _roles_and_rounds(spans):
    return [(s.tag.role, s.tag.round) for s in spans]


def test_segment_synthetic_chat():
    tokens = (turn("system", [20]) + turn("user", [30, 31]) +
              turn("assistant", [40], reasoning=[50, 51]) + turn("user", [32]))
    spans = segment(tokens, FMT)
    assert [(s.tag.turn, s.tag.role, s.tag.round, s.tag.reasoning) for s in spans] == [
        (0, "system", 0, False), (1, "user", 1, False), (2, "assistant", 1, False),
        (2, "assistant", 1, True), (2, "assistant", 1, False), (3, "user", 2, False)]
    assert spans[0].start == 0 and spans[-1].end == len(tokens)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    reasoning = spans[3]
    assert tokens[reasoning.start] == THINK and tokens[reasoning.end - 1] == END_THINK
    assert spans[1].closed_at == spans[1].end - 1  # after IM_END, before the newline
    assert spans[-1].closed_at == len(tokens) - 1


def test_segment_raw_text_is_one_untagged_turn():
    spans = segment([20, 21, 22, 23], FMT)
    assert len(spans) == 1 and spans[0].tag == UNTAGGED and spans[0].closed_at is None


def test_segment_open_and_pending_turns():
    spans = segment(turn("user", [30]) + [IM_START], FMT)
    assert spans[-1].tag == TurnTag(1, None, 1, False)  # opener not complete yet
    spans = segment(turn("user", [30]) + [IM_START, USER, NL, 33], FMT)
    assert spans[-1].tag.role == "user" and spans[-1].closed_at is None


def test_turn_format_rejects_bad_roles():
    with pytest.raises(ValueError, match="system, user, assistant, tool"):
        TurnFormat(openers=(("robot", (1, 2)),))


def test_derive_chatml_from_the_default_model(hf_tok):
    fmt = derive(hf_tok)
    assert dict(fmt.openers)["user"] == tuple(
        hf_tok.encode("<|im_start|>user", add_special_tokens=False))
    assert fmt.end == tuple(hf_tok.encode("<|im_end|>", add_special_tokens=False))
    assert {r for r, _ in fmt.openers} == {"system", "user", "assistant", "tool"}
    assert fmt.think is None and not fmt.drops_reasoning
    ids = hf_tok.encode(hf_tok.apply_chat_template(CONVERSATION, tokenize=False),
                        add_special_tokens=False)
    spans = segment(ids, fmt)
    assert _roles_and_rounds(spans) == [
        ("system", 0), ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)]
    assert hf_tok.decode(ids[spans[2].start:spans[2].end]).startswith(
        "<|im_start|>assistant\nParis.<|im_end|>")


def test_derive_llama3_style_template_string(hf_tok):
    template = (DATA / "llama3_style.jinja").read_text()
    fmt = derive(hf_tok, chat_template=template)
    text = hf_tok.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False)
    assert "<|start_header_id|>user<|end_header_id|>" in text
    ids = hf_tok.encode(text, add_special_tokens=False)
    spans = segment(ids, fmt)
    # BOS text before the first header is an untagged preamble.
    tagged = [s for s in spans if s.tag.role is not None]
    assert _roles_and_rounds(tagged) == [
        ("system", 0), ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)]
    # These markers are plain text to this tokenizer: "|><|" merges across the
    # turn edge, so the boundary sits at the nearest whole token.
    assert hf_tok.decode(ids[tagged[3].start:tagged[3].end]).startswith(
        "|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>")


def test_derive_reasoning_template_drops_history_reasoning(hf_tok):
    template = (DATA / "chatml_reasoning.jinja").read_text()
    fmt = derive(hf_tok, chat_template=template, reasoning=("<think>", "</think>"))
    assert fmt.drops_reasoning
    assert fmt.think == (tuple(hf_tok.encode("<think>", add_special_tokens=False)),
                         tuple(hf_tok.encode("</think>", add_special_tokens=False)))
    plain = derive(hf_tok, reasoning=("<think>", "</think>"))
    assert not plain.drops_reasoning  # SmolLM2's own template keeps everything
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello!"}]
    ids = hf_tok.encode(hf_tok.apply_chat_template(
        msgs, chat_template=template, tokenize=False), add_special_tokens=False)
    spans = segment(ids, fmt)
    think = [s for s in spans if s.tag.reasoning]
    assert len(think) == 1
    assert hf_tok.decode(ids[think[0].start:think[0].end]) == "<think>\nthe user greets\n</think>"


def test_request_rounds_lookup_and_release():
    rounds = RequestRounds(FMT, capacity=2)
    prompt = turn("user", [30, 31]) + [IM_START, 5, NL]
    rounds.observe("a", prompt)
    spans = rounds.get("a", seq_len=len(prompt) + 7)
    assert [(s.role, s.round) for s in spans] == [("user", 1), ("assistant", 1)]
    assert spans[-1].end == len(prompt) + 7  # generated tokens join the open turn
    rounds.observe("b", prompt)
    rounds.observe("c", prompt)
    assert rounds.get("a") is None and len(rounds) == 2  # capacity bound
    rounds.release("b")
    rounds.release("c")
    assert len(rounds) == 0
