"""The many-sessions workload (``sgl_spec.bench.sessions``): what it sends and how it
classifies and sums a follow-up. The server rows are a benchmark, not a test."""

from __future__ import annotations

import pytest

from sgl_spec.bench import sessions
from sgl_spec.bench.dataset import POSITIONS


@pytest.fixture(scope="module")
def sess(hf_tok):
    return sessions.sessions(hf_tok, 4, 400, seed=0)


def test_documents_hold_three_facts_at_begin_middle_and_end(sess, hf_tok):
    for s in sess:
        at = [s.document.index(f.sentence) / len(s.document) for f in s.facts]
        assert at[0] < 0.2 and 0.35 < at[1] < 0.65 and at[2] > 0.8, at
        assert 350 <= len(hf_tok.encode(s.document)) <= 450
        assert len({f.value for f in s.facts}) == 3
    assert len({s.document for s in sess}) == 4


def test_plan_opens_every_session_then_revisits_each_twice_in_order(sess):
    order = sessions.plan(sess, seed=0)
    assert order[:4] == [(i, 0) for i in range(4)]
    revisits = order[4:]
    assert sorted(revisits) == sorted((i, v) for i in range(4) for v in (1, 2))
    for i in range(4):
        assert revisits.index((i, 1)) < revisits.index((i, 2))
    assert revisits != sorted(revisits)                  # shuffled
    for s in sess:                                       # every position asked once
        assert sorted(sessions.asked(s, v) for v in range(3)) == [0, 1, 2]


def test_a_revisit_extends_the_previous_prompt_with_the_gold_answer(sess, hf_tok):
    s = sess[1]
    m2 = sessions.messages(s, 2)
    assert [m["role"] for m in m2] == ["user", "assistant", "user", "assistant", "user"]
    assert m2[:3] == sessions.messages(s, 1)[:3]
    assert m2[1]["content"] == s.facts[sessions.asked(s, 0)].value
    assert s.document in m2[0]["content"] and s.document not in m2[2]["content"]
    prev, now = (hf_tok.apply_chat_template(sessions.messages(s, v), tokenize=False,
                                            add_generation_prompt=True) for v in (1, 2))
    assert now.startswith(prev)      # a cached previous prompt is a prefix of this one
    assert sessions.n_tokens(hf_tok, sessions.messages(s, 1)) < sessions.n_tokens(hf_tok, m2)


@pytest.mark.parametrize("meta,history,source", [
    ({"cached_tokens": 0}, 0, "new"),
    ({"cached_tokens": 40}, 500, "recomputed"),
    ({"cached_tokens": 500, "cached_tokens_details": {"device": 500}}, 500, "device"),
    ({"cached_tokens": 500, "cached_tokens_details": {"device": 20, "host": 480}}, 500, "host"),
    ({"cached_tokens": 495, "cached_tokens_details": {"storage": 490}}, 500, "storage"),
])
def test_a_follow_up_is_classified_by_where_its_history_came_from(meta, history, source):
    assert sessions._source(meta, history) == source


def _answer(session, visit, pos, source, ttft, correct, text="x", restore=None):
    return {"session": session, "visit": visit, "position": pos, "prompt_tokens": 1,
            "ttft_s": ttft, "cached": 0, "source": source, "text": text, "correct": correct,
            "restore_s": restore, "restore_tokens": None}


def test_summary_counts_restored_conversations_and_splits_ttft_by_tier():
    ref = [_answer("s0", 0, "begin", "new", 9, True), _answer("s0", 1, "middle", "host", 1, True),
           _answer("s1", 1, "end", "recomputed", 8, False),
           _answer("s1", 2, "begin", "device", 0.5, True)]
    row = [dict(a) for a in ref]
    row[1]["text"] = "y"
    out = sessions.summarize({"reference": {"answers": ref, "krul_branches": []},
                              "krul": {"answers": row, "krul_branches": [(39, 100), (41, 100)]}},
                             ref)
    k = out["krul"]
    assert k["conversations_restored"] == 1                  # s0's first revisit only
    assert k["sources"] == {"device": 1, "host": 1, "storage": 0, "recomputed": 1}
    assert k["ttft_host_s"] == 1 and k["ttft_recomputed_s"] == 8 and k["ttft_device_s"] == 0.5
    assert k["greedy_agreement"] == pytest.approx(2 / 3)      # follow-ups only
    assert k["em_by_position"] == {"begin": 1.0, "middle": 1.0, "end": 0.0}
    assert set(k["em_by_position"]) == set(POSITIONS)
    assert k["krul_stored_over_full"] == pytest.approx(0.4)
    assert out["reference"]["krul_stored_over_full"] is None


def test_rows_differ_only_in_their_cache_flags():
    flags = {r: sessions.row_args(r, "M", 1000, 2.0, 9000, profile="p.json")
             for r in sessions.ROWS}
    assert all(f[:7] == flags["recompute"][:7] for f in flags.values())
    assert "--enable-hierarchical-cache" not in flags["recompute"]
    assert flags["reference"][-1] == "9000"
    assert "--spec-krul" in flags["krul"] and "file" in flags["krul+file"]
    assert flags["krul-int8"][-2:] == ["--spec-krul-codec", "int8"]
    assert flags["krul-recompute"][-3:] == ["--spec-krul", "--spec-krul-profile", "p.json"]
    for how in ("pipelined", "serial"):  # the same profile; only the restore's order differs
        assert flags[f"krul-recompute-{how}"] == [*flags["krul-recompute"],
                                                  "--spec-krul-restore", how]
        assert f"krul-recompute-{how}" not in sessions.DEFAULT_ROWS
    assert "krul-recompute" not in sessions.DEFAULT_ROWS
    assert sessions.counterpart("krul-recompute-pipelined", ["krul-recompute-serial"]) \
        == "krul-recompute-serial"
    assert sessions.counterpart("krul-recompute", ["hicache"]) == "hicache"
    with pytest.raises(ValueError, match="needs a restore profile"):
        sessions.row_args("krul-recompute", "M", 1000, 2.0, 9000)
    with pytest.raises(ValueError, match="valid: reference"):
        sessions.row_args("lmcache", "M", 1000, 2.0, 9000)


def test_krul_follow_ups_are_paired_with_hicache_ones_of_the_same_visit_round_and_tier():
    def rnd(*answers):
        return {"answers": list(answers), "krul_branches": []}

    hicache = [rnd(_answer("s0", 0, "begin", "new", 9, True),
                   _answer("s0", 1, "middle", "host", 1.0, True, restore=0.10),
                   _answer("s1", 1, "end", "host", 2.0, True, restore=0.20),
                   _answer("s1", 2, "begin", "recomputed", 8, True)),
               rnd(_answer("s0", 1, "middle", "host", 1.0, True, restore=0.10))]
    krul = [rnd(_answer("s0", 0, "begin", "new", 3, True),          # an opening: not paired
                _answer("s1", 1, "end", "host", 1.0, True, restore=0.05),   # out of order
                _answer("s0", 1, "middle", "host", 1.1, True, restore=0.06),
                _answer("s1", 2, "begin", "host", 1, True, restore=0.05)),  # other tier
            rnd(_answer("s0", 1, "middle", "host", 1.2, True, restore=0.04))]
    p = sessions.paired({"krul": krul, "hicache": hicache}, "krul", "hicache")
    assert p["pairs"] == 3
    assert p["ttft_ratio"] == pytest.approx((0.5, 1.1, 1.2))
    assert p["stage_ratio"] == pytest.approx((0.25, 0.4, 0.6))
    assert p["stage_s"][1] == pytest.approx(0.05) and p["other_stage_s"][1] == pytest.approx(0.1)
    assert sessions.counterpart("krul+file") == "hicache+file"
    assert sessions.counterpart("krul-int8") == "hicache"
    assert sessions.counterpart("krul", {"hicache": [], "hicache-tagged": []}) == "hicache-tagged"
    assert "--spec-tree-core" in sessions.row_args("hicache-tagged", "M", 1000, 2.0, 9000)
    res = {"summary": sessions.summarize({"krul": krul[0], "hicache": hicache[0]}, None),
           "config": {"conversations": 2, "doc_tokens": 1, "device_tokens": 1,
                      "host_ratio": 1.0, "rounds": 2},
           "rows": ["hicache", "krul"], "paired": {"krul vs hicache": p}}
    md = sessions.markdown(res)
    assert "krul against hicache, the same follow-up and round, both from the host tier (3 pairs)" in md
    assert "restore stage 0.25 / 0.40 / 0.60x (median 50.0 ms against 100.0 ms)" in md
    assert res["summary"]["krul"]["restore_stage_host_s"] == pytest.approx(0.05)


def test_server_flags_are_appended_to_every_row_and_may_not_set_the_rows_own():
    extra = tuple(sessions.server_flags("--dtype float32 --chunked-prefill-size=512"))
    assert extra == ("--dtype", "float32", "--chunked-prefill-size=512")
    for row in ("reference", "hicache", "krul+file"):
        assert sessions.row_args(row, "M", 1000, 2.0, 9000, extra=extra)[-3:] == list(extra)
    for bad in ("--spec-krul", "--max-total-tokens=4096", "--hicache-ratio 3"):
        with pytest.raises(ValueError, match="may not set --.*it owns --model-path"):
            sessions.server_flags(bad)
    with pytest.raises(SystemExit):
        sessions.main(["--out", "/tmp/x", "--server-flags", "--spec-mode loopserve"])


def test_a_forced_share_profile_makes_that_share(tmp_path):
    import json

    from sgl_spec.krul.restore_cost import host_share, read_profile

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576}))
    for share in (0.25, 0.5):
        path = sessions.forced_profile(str(model), share, str(tmp_path / f"{share}.json"))
        for pipelined in (True, False):  # the serial and pipelined rows restore alike
            assert host_share(read_profile(path), 30, pipelined=pipelined) == share
