"""Turn formats derived from chat templates, the token scan that uses them, and the
tree summary derived from them on demand (no sglang needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _turns import END_THINK, FMT, IM_START, NL, THINK, USER, turn

from sgl_spec.cache.segment import UNTAGGED, TurnTag, segment
from sgl_spec.cache.summary import Segment, summary, totals
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


def _seg(sid, parent, tokens, tier="device", atime=float("nan")):
    return Segment(sid, parent, np.array(tokens, dtype=np.int64), tier, atime)


def test_summary_derives_rounds_of_each_branch_on_demand():
    """Two conversations share a system prompt; one forks after its first answer.
    Segments cut anywhere (here mid-turn): rounds come from the tokens, not the cuts."""
    system = turn("system", [20])
    q1, a1 = turn("user", [30, 31]), turn("assistant", [40], reasoning=[50, 51])
    q2, q2b = turn("user", [32]), turn("user", [33, 34, 35])
    head = system + q1 + a1
    segs = [
        _seg(1, None, head[:7], atime=100.0),
        _seg(2, 1, head[7:], "host", atime=101.0),
        _seg(3, 2, q2, atime=105.0),
        _seg(4, 2, q2b, atime=103.0),
        _seg(5, None, [70, 71, 72], None),  # raw text; a tombstone (no tier)
    ]
    s = summary(segs, FMT, tree_core="compiled", eviction="lru", freed_by_rule={"lru": 3},
                now=110.0)
    assert s["num_branches"] == 3 and s["tree_core"] == "compiled"
    newest = s["branches"][0]
    assert newest["leaf_node"] == 3 and newest["last_access_s_ago"] == 5.0
    assert newest["exclusive_tokens"] == len(q2)
    rounds = newest["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[0]["turns"] == [{"turn": 0, "role": "system", "tokens": len(system),
                                   "reasoning_tokens": 0}]
    assert [t["role"] for t in rounds[1]["turns"]] == ["user", "assistant"]
    assert rounds[1]["turns"][1]["reasoning_tokens"] == 4  # <think> 50 51 </think>
    assert rounds[1]["tier"] == "mixed" and rounds[2]["tier"] == "device"
    assert rounds[0]["last_access_s_ago"] == 10.0  # only segment 1 holds round 0
    assert rounds[1]["device_tokens"] + rounds[1]["host_tokens"] == len(q1) + len(a1)
    raw = s["branches"][-1]
    assert raw["last_access_s_ago"] is None and raw["rounds"][0]["tier"] == "device"
    assert raw["rounds"][0]["turns"][0]["role"] is None
    t = s["totals"]  # every token once, shared prefix included
    assert t["by_tier"] == {"device": 7 + len(q2) + len(q2b), "host": len(head) - 7}
    assert sum(t["by_role"].values()) == len(head) + len(q2) + len(q2b)
    assert t["by_role"]["reasoning"] == 4 and "untagged" not in t["by_role"]
    assert s["freed_tokens_by_rule"] == {"lru": 3}


def test_summary_reports_a_branchs_compressed_host_bytes():
    """Krul's records: a branch sums the stored and full bytes of its host segments."""
    segs = [Segment(1, None, np.arange(10, dtype=np.int64), "host", 1.0, 400, 1000),
            Segment(2, 1, np.arange(4, dtype=np.int64), "host", 2.0, 160, 400),
            _seg(3, 1, [7, 8], atime=3.0)]
    s = summary(segs, None, tree_core="tagged", eviction="lru", freed_by_rule={})
    by_leaf = {b["leaf_node"]: b for b in s["branches"]}
    assert by_leaf[2]["krul_stored_bytes"] == 560 and by_leaf[2]["krul_full_bytes"] == 1400
    assert by_leaf[3]["krul_stored_bytes"] == 400 and by_leaf[3]["krul_full_bytes"] == 1000
    plain = summary([_seg(1, None, [5])], None, tree_core="tagged", eviction="lru",
                    freed_by_rule={})
    assert "krul_stored_bytes" not in plain["branches"][0]


def test_summary_without_a_turn_format_is_untagged():
    segs = [_seg(1, None, [5, 6, 7]), _seg(2, 1, [8])]
    s = summary(segs, None, tree_core="tagged", eviction="lru", freed_by_rule={})
    (b,) = s["branches"]
    assert b["tokens"] == 4 and b["rounds"][0]["turns"][0]["role"] is None
    assert totals(segs, None)["by_role"] == {"untagged": 4}
    assert summary([], FMT, tree_core="compiled", eviction="lru",
                   freed_by_rule={})["num_branches"] == 0


def test_derive_qwen25_template_with_its_default_system_prompt(hf_tok):
    # Qwen2.5's ChatML: a default system prompt when none is given, and tool results
    # rendered inside a user turn (no tool opener to tag).
    template = (DATA / "qwen2.5_chatml.jinja").read_text()
    fmt = derive(hf_tok, chat_template=template)
    opener = {r: hf_tok.decode(list(ids)) for r, ids in fmt.openers}
    assert opener == {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant",
                      "system": "<|im_start|>system"}
    assert hf_tok.decode(list(fmt.end)) == "<|im_end|>"
    text = hf_tok.apply_chat_template(CONVERSATION[1:], chat_template=template,
                                      tokenize=False)
    spans = segment(hf_tok.encode(text, add_special_tokens=False), fmt)
    assert _roles_and_rounds(spans) == [
        ("system", 0), ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)]
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert "You are Qwen" in hf_tok.decode(ids[spans[0].start:spans[0].end])
