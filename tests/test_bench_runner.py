"""The evaluation harness without a server: figures, checks, tables, plots, and the
server sweeps' row selection and rounds (its configuration files and plans:
``test_bench_configset.py``)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from sgl_spec.bench import (configset, plan, plots, results, runner, sparse_counters, summary,
                            sweep, tables)
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.dataset import DatasetConfig, generate
from _tokenizers import WordTokenizer

# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("tokens, bucket", [
    (0, "0-1k"), (1023, "0-1k"), (1024, "1k-2k"), (4095, "3k-4k"), (5000, "4k-6k"),
    (6144, ">=6k"), (9000, ">=6k"),
], ids=lambda x: str(x))
def test_history_bucket(tokens, bucket):
    assert summary.history_bucket(tokens) == bucket
    assert bucket in summary.bucket_order()


DATA = DatasetConfig(seed=3, conversations=6, turns=(2, 3), tokens_per_turn=(300, 900),
                     facts_per_turn=2)


@pytest.fixture(scope="module")
def convs():
    return generate(DATA, WordTokenizer())


def _results(convs, answer, ids=lambda conv, turn: (1, 2, 3), lg_ids=(5, 6, 7, 8)):
    """Synthetic TurnResults: ``answer(turn)`` is the reply text; prompts grow by turn."""
    out = []
    for conv in convs:
        history = 0
        for t in conv.turns:
            history += t.n_tokens + 40
            out.append(TurnResult(
                conversation=conv.name, turn=t.index + 1, ttft_s=0.001 * history,
                latency_s=0.001 * history + 0.1, prompt_tokens=history,
                cached_tokens=history - t.n_tokens - 40, output_tokens=3,
                finish_reason="stop", text=answer(t), prompt_sha1="x",
                output_ids=ids(conv, t), top_logprobs=((("a", -0.1), ("b", -3.0)),) * 3))
    lg = [TurnResult("longgen-animals", 1, 0.2, 2.2, 30, 0, len(lg_ids), "length", "...",
                     "y", lg_ids, ((("a", -0.1), ("b", -0.15)),) * len(lg_ids))]
    return out, lg


def test_accuracy_by_bucket(convs):
    chat, _ = _results(convs, lambda t: t.answer if t.position == "end" else "no idea")
    turns = summary.score_conversations(convs, chat)
    by_pos = summary.accuracy_by(turns, lambda t: t.score.position, ("begin", "middle", "end"))
    assert list(by_pos) == ["begin", "middle", "end"]
    assert by_pos["end"]["overall"]["exact_match"] == 1.0
    assert by_pos["begin"]["overall"]["exact_match"] == 0.0
    assert by_pos["middle"]["overall"]["f1"] == 0.0
    by_size = summary.accuracy_by(turns, lambda t: t.size)
    assert sorted(by_size) == ["300", "900"]
    assert sum(g["overall"]["n"] for g in by_size.values()) == len(turns)
    by_hist = summary.accuracy_by(turns, lambda t: t.history, summary.bucket_order())
    assert list(by_hist) == [b for b in summary.bucket_order() if b in by_hist]
    e = summary.end_this_turn_short(turns)
    short_end = [t for t in turns if t.result.prompt_tokens < summary.SHORT_HISTORY
                 and t.score.position == "end" and t.score.source == "this_turn"]
    assert e["n"] == len(short_end) > 0 and e["exact_match"] == 1.0
    assert summary.end_this_turn_short(turns, max_history=1)["exact_match"] is None


def test_speed_by_history(convs):
    chat, _ = _results(convs, lambda t: t.answer)
    speed = summary.speed_by_history(chat)
    assert sum(s["n"] for s in speed.values()) == len(chat)
    ttfts = [s["ttft_median_s"] for s in speed.values()]
    assert ttfts == sorted(ttfts)  # synthetic TTFT grows with history
    assert all(s["tpot_median_s"] == pytest.approx(0.05) for s in speed.values())


SPARSE = {"chat": {"sparse_steps": 300, "decode_steps": 1200, "reselections": 20,
                   "sparse_share": 0.25},
          "longgen": {"sparse_steps": 496, "decode_steps": 511, "reselections": 31,
                      "sparse_share": 496 / 511}}


def _three_rows(convs, within_points=None):
    plan = runner.RunPlan("quick", ("animals",), 256)
    ref_chat, ref_lg = _results(convs, lambda t: t.answer)
    # "loopserve" loses begin-position questions and diverges on their tokens.
    lossy = lambda t: "4" if t.position == "begin" else t.answer  # noqa: E731
    lossy_ids = lambda c, t: (1, 9) if t.position == "begin" else (1, 2, 3)  # noqa: E731
    ls_chat, ls_lg = _results(convs, lossy, lossy_ids, lg_ids=(5, 6, 0, 0))
    runs = [
        results.ConfigRun("stock", None, {"peak_rss_bytes": 3 * 2**30, "start_s": 20.0},
                          ref_chat, ref_lg),
        results.ConfigRun("sgl_spec exact", None, {"peak_rss_bytes": 2**31, "start_s": 21.0},
                          ref_chat, ref_lg),
        results.ConfigRun("loopserve B=512", None, None, ls_chat, ls_lg, SPARSE),
    ]
    meta = {"configset": "trio", "started": "now", "model": "m", "dataset_preset": "custom",
            "concurrency": 1, "duration_s": 60.0}
    return results.build(meta, DATA, convs, plan, runs, "sgl_spec exact", within_points)


def test_results_figures(convs):
    res = _three_rows(convs)
    stock, exact, loop = res["configs"]
    assert "agreement" not in exact
    assert stock["agreement"]["chat"]["counts"]["identical"] == len(stock["turns"])
    begins = sum(t["position"] == "begin" for t in loop["turns"])
    counts = loop["agreement"]["chat"]["counts"]
    assert counts["identical"] == len(loop["turns"]) - begins
    assert loop["agreement"]["chat"]["tokens"]["min_prefix"] == 1
    assert loop["agreement"]["longgen"]["tokens"]["mean_prefix"] == 2
    assert loop["agreement"]["longgen"]["counts"]["near_tie_divergences"] == 1
    assert loop["accuracy"]["by_position"]["begin"]["exact_match"] == 0.0
    assert exact["accuracy"]["overall"]["exact_match"] == 1.0
    assert res["dataset"]["stats"]["conversations"] == len(convs)
    assert list(res["acceptance"]) == [
        "stock: exact match vs sgl_spec exact by query position",
        "stock: identical to sgl_spec exact",
        "sgl_spec exact: end-position this-turn EM, history < 2048 tokens",
        "loopserve B=512: exact match vs sgl_spec exact by query position",
        "loopserve B=512: identical to sgl_spec exact",
    ]
    assert res["acceptance"]["stock: exact match vs sgl_spec exact by query position"] == \
        "begin +0.0, middle +0.0, end +0.0 points"
    assert res["acceptance"]["loopserve B=512: exact match vs sgl_spec exact by query "
                             "position"] == "begin -100.0, middle +0.0, end +0.0 points"
    assert loop["sparse_decode"] == SPARSE
    assert stock["sparse_decode"] == {"chat": None, "longgen": None}
    assert res["acceptance"]["sgl_spec exact: end-position this-turn EM, history < 2048 tokens"] \
        .endswith("PASS")


@pytest.mark.parametrize("points, verdict", [
    (100, "PASS"), (99.9, "FAIL"), (0, "FAIL")], ids=["loses-100-of-100", "loses-100-of-99.9",
                                                      "loses-100-of-0"])
def test_within_points_check(convs, points, verdict):
    res = _three_rows(convs, {"loopserve B=512": points})
    key = (f"loopserve B=512: exact match within {points:g} points of sgl_spec exact at "
           "every query position")
    assert res["checks"] == {"within_points": {"loopserve B=512": points},
                             "followup_speedup": {}}
    assert res["acceptance"][key] == (f"begin -100.0, middle +0.0, end +0.0 points (need >= "
                                      f"{-points:g} each): {verdict}")
    assert f"- {key}: begin -100.0" in tables.markdown(res)


def test_position_deltas_without_questions(convs):
    res = _three_rows(convs)
    ref, loop = res["configs"][1], res["configs"][2]
    del loop["accuracy"]["by_position"]["middle"]
    assert results.position_deltas(loop, ref) == {"begin": -100.0, "middle": None, "end": 0.0}
    assert results.position_check(loop, ref, 200).endswith("FAIL")  # a missing position


PROM = """# HELP sgl_spec:decode_steps_total Request decode steps by attention path
# TYPE sgl_spec:decode_steps_total counter
sgl_spec:decode_steps_total{path="sparse"} 120.0
sgl_spec:decode_steps_total{path="exact"} 30.0
sgl_spec:decode_steps_total{path="sparse",pid="7"} 5.0
sgl_spec:sparse_reselections_total 8.0
sgl_spec:sparse_selected_tokens_sum 1000.0
sglang:num_running_reqs{model_name="m"} 0.0
"""


def test_sparse_counters_parse_and_delta():
    after = sparse_counters.parse(PROM)
    assert after == sparse_counters.SparseCounters(125.0, 30.0, 8.0)
    assert sparse_counters.parse("sglang:num_running_reqs 0.0\n") is None  # stock, exact
    before = sparse_counters.SparseCounters(25.0, 10.0, 2.0)
    assert sparse_counters.delta(after, before) == {
        "sparse_steps": 100, "decode_steps": 120, "reselections": 6, "sparse_share": 100 / 120,
        "rows_loaded_per_step": None, "selection_overlap": None, "head_ms_per_pass": None}
    assert sparse_counters.delta(after, None)["decode_steps"] == 155
    assert sparse_counters.delta(None, before) is None
    assert sparse_counters.delta(before, before)["sparse_share"] is None  # no decode steps


def test_specontext_histograms_give_means_per_step():
    text = PROM + ("sgl_spec:specontext_rows_loaded_sum 300.0\n"
                   "sgl_spec:specontext_rows_loaded_count 10.0\n"
                   "sgl_spec:specontext_selection_overlap_sum 7.5\n"
                   "sgl_spec:specontext_selection_overlap_count 9.0\n"
                   "sgl_spec:specontext_head_seconds_sum 0.02\n"
                   "sgl_spec:specontext_head_seconds_count 10.0\n")
    before = sparse_counters.SparseCounters(25.0, 10.0, 2.0, 100.0, 5.0, 1.5, 3.0, 0.01, 5.0)
    d = sparse_counters.delta(sparse_counters.parse(text), before)
    assert d["rows_loaded_per_step"] == pytest.approx(40.0)
    assert d["selection_overlap"] == pytest.approx(1.0)
    assert d["head_ms_per_pass"] == pytest.approx(2.0)
    configs = [{"name": "specontext B=1024", "sparse_decode": {"chat": d, "longgen": None}}]
    assert tables.elastic_table(configs)[2] == "| specontext B=1024 | chat | 40.0 | 1.000 | 2.00 |"


def test_pass_seconds_parse_and_delta():
    text = ('sgl_spec:decode_pass_seconds_sum{path="exact"} 1.6\n'
            'sgl_spec:decode_pass_seconds_count{path="exact"} 20.0\n'
            'sgl_spec:decode_pass_seconds_sum{path="sparse"} 0.0\n'
            'sgl_spec:decode_pass_seconds_count{path="sparse"} 0.0\n'
            'sgl_spec:decode_pass_seconds_bucket{le="0.005",path="exact"} 0.0\n')
    after = sparse_counters.passes(text)
    assert after == {"exact": [1.6, 20.0], "sparse": [0.0, 0.0]}
    d = sparse_counters.pass_delta(after, {"exact": [0.8, 10.0]})
    assert d == {"exact": [pytest.approx(0.8), 10.0]}  # paths without a pass left out
    assert sparse_counters.pass_ms(d) == {"exact": pytest.approx(80.0)}
    assert sparse_counters.passes("sglang:num_running_reqs 0.0\n") == {}  # stock
    assert sparse_counters.pass_ms(None) == {}


def test_sparse_counters_read_without_metrics():
    assert sparse_counters.read("http://127.0.0.1:9") is None  # nothing listens: '-'


def test_markdown_takes_a_third_row(convs):
    md = tables.markdown(_three_rows(convs))
    for heading in ("## Accuracy by query position", "## Greedy agreement with `sgl_spec exact`",
                    "## Speed", "by history length", "## Dataset"):
        assert heading in md
    rows = [line for line in md.splitlines() if line.startswith("| loopserve B=512 |")]
    # accuracy, position x source, size, history, gap, answer timing, agreement, speed
    assert len(rows) == 8
    assert "## Gap to the reference, by position, with speed" in md
    assert "## When the answers came" in md
    size_row = next(r for r in md.splitlines() if r.startswith("| stock | ") and "(n=" in r
                    and "n=15" not in r)
    assert size_row.count("1.00 (1.00) n=") == 2  # one cell per size: 300 and 900
    acc_row = next(r for r in md.splitlines() if r.startswith("| loopserve B=512 | 0."))
    assert "| 0.00 (0.00) n=" in acc_row  # begin position lost
    assert "| sgl_spec exact (reference) |" in md
    assert "| stock | 1.00 (1.00)" in md
    speed = next(r for r in md.splitlines() if r.startswith("| stock | ") and "3.00" in r)
    assert speed.endswith("| - | - | 3.00 | 20.0 |")  # no sparse-decode counters
    assert "| sparse decode steps chat | sparse decode steps long-gen |" in md
    loop_speed = [r for r in md.splitlines() if r.startswith("| loopserve B=512 |")][-1]
    assert "| 300/1200 (0.25) | 496/511 (0.97) |" in loop_speed


def test_plots_written(convs, tmp_path):
    paths = plots.write_plots(_three_rows(convs), str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == [plots.ACCURACY_PNG, plots.SPEED_PNG]
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_write_results(convs, tmp_path):
    import json

    written = results.write(_three_rows(convs), str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in written) == sorted(
        ["results.json", "results.md", plots.ACCURACY_PNG, plots.SPEED_PNG])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [c["name"] for c in doc["configs"]] == ["stock", "sgl_spec exact", "loopserve B=512"]


def test_a_server_that_does_not_come_up(monkeypatch, tmp_path):
    """The run fails naming the configuration and showing the tail of its log."""
    monkeypatch.setitem(configset.LAUNCHERS, "broken",
                        configset.Launcher("sgl_spec.bench.no_such_launcher", ()))
    cfg = configset.ServerConfig("broken row", "broken", ("--x",))
    progress = runner.Progress(1)
    work = runner.Workloads(runner.RunPlan.preset(True), [], 32, [], {})
    with pytest.raises(runner.ServerStartError) as exc:
        runner.run_config(cfg, "/m", work, str(tmp_path), progress)
    progress.close()
    msg = str(exc.value)
    assert msg.startswith("configuration 'broken row': the server did not come up.")
    assert "No module named sgl_spec.bench.no_such_launcher" in msg
    assert str(tmp_path / "server-broken-row.log") in msg


def test_solvable_check_is_na_without_short_history_questions(convs):
    """A dataset of long turns only has no end-position question under 2048 tokens of
    history: the reference's solvability check says n/a, not FAIL."""
    res = _three_rows(convs)
    for c in res["configs"]:
        c["end_this_turn_short"] = {"exact_match": None, "n": 0, "max_history_tokens": 2048}
    verdict = results.acceptance(res)[
        "sgl_spec exact: end-position this-turn EM, history < 2048 tokens"]
    assert verdict == "n/a of 0 questions (need >= 0.5): n/a (no such question in this dataset)"


def test_rounds_interleave_rows_and_name_a_row_that_fails_to_start():
    from sgl_spec.bench.server import ServerStartError

    rows = (configset.ServerConfig("a", "sgl_spec"), configset.ServerConfig("b", "sgl_spec"))
    order = []
    runs = sweep.run_interleaved(rows, 2, lambda c, i: order.append((c.name, i)) or {"i": i})
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert runs == {"a": [{"i": 0}, {"i": 1}], "b": [{"i": 0}, {"i": 1}]}

    def fail(c, i):
        if c.name == "b":
            raise ServerStartError("exited with 1")
        return {}

    with pytest.raises(ServerStartError, match="configuration 'b': exited with 1"):
        sweep.run_interleaved(rows, 1, fail)
    assert sparse_counters.add([{"sparse": 1.0}, None, {"sparse": 2.0, "exact": 1.0}]) == {
        "sparse": 3.0, "exact": 1.0}
    assert sparse_counters.add([None, {}]) is None


# --------------------------------------------------------------------------- speed chats


def _speed_turns(ttfts, diverge_at=None, conv="doc_chat-0"):
    """One speed-chat conversation; ``diverge_at``: the turn whose answer differs at
    token 1 with a 0.1-nat margin (a near tie)."""
    top = ((("a", -0.1), ("b", -0.2)),) * 3
    return [TurnResult(conv, i + 1, ttft, ttft + 1.0, 3000 + 60 * i, 0 if i == 0 else 3000,
                       11, "length", f"answer {i}", f"p{i}",
                       (1, 9, 3) if diverge_at == i + 1 else (1, 2, 3), top)
            for i, ttft in enumerate(ttfts)]


def _serving(mean_ttft_ms, throughput, texts):
    from sgl_spec.bench import serving

    return serving.figures(serving.ServingResult(
        {"mean_ttft_ms": mean_ttft_ms, "median_ttft_ms": mean_ttft_ms,
         "mean_tpot_ms": 357.1, "median_tpot_ms": 357.1, "output_throughput": throughput},
        547, tuple(texts), ("python", "-m", "sglang.bench_serving")))


def _stock_vs_exact(convs, need=5.0):
    chat, lg = _results(convs, lambda t: t.answer)
    runs = [results.ConfigRun("stock", None, None, chat, lg,
                              chats={"doc_chat": _speed_turns([5.0, 3.5, 3.5]),
                                     "growing": _speed_turns([1.0, 6.0], conv="growing-0")},
                              serving=_serving(9016, 32.18, ["x", "y"])),
            results.ConfigRun("sgl_spec exact", None, None, chat, lg,
                              chats={"doc_chat": _speed_turns([5.0, 0.35, 0.35], 3),
                                     "growing": _speed_turns([1.0, 3.0], conv="growing-0")},
                              serving=_serving(7823, 40.86, ["x", "z"]))]
    meta = {"configset": "baseline", "started": "now", "model": "m",
            "dataset_preset": "custom", "concurrency": 1, "duration_s": 60.0}
    p = plan.RunPlan("quick", ("animals",), 256, ("doc_chat", "growing"), "default")
    return results.build(meta, DATA, convs, p, runs, "sgl_spec exact",
                         followup_speedup={"sgl_spec exact": need})


def test_speed_chats_against_the_first_row(convs):
    """What stock-vs-exact compared: follow-up TTFT over a cached document against stock
    in the same run, outputs token by token with the margin at the first divergence,
    and the bench_serving row."""
    res = _stock_vs_exact(convs)
    assert res["baseline"] == "stock" and res["near_tie_nats"] == 0.25
    stock, exact = res["configs"]  # stock: the baseline; exact: the reference
    assert "ratio" not in stock["chats"]["doc_chat"] and "agreement" not in exact["chats"][
        "doc_chat"]
    doc = exact["chats"]["doc_chat"]
    assert doc["summary"]["ttft_later_mean_s"] == pytest.approx(0.35)
    assert doc["ratio"]["ttft_later_mean_s"] == pytest.approx(0.1)
    assert stock["chats"]["doc_chat"]["agreement"]["counts"] == {
        "turns": 3, "identical": 2, "near_tie_divergences": 1, "other_divergences": 0,
        "same_prompts": 3, "acceptable": True}
    assert exact["serving"]["ratio"]["ttft_mean_s"] == pytest.approx(7823 / 9016)
    assert stock["serving"]["agreement"] == {"requests": 2, "identical_texts": 1}
    assert res["acceptance"]["sgl_spec exact: doc_chat TTFT of turns >= 2"] == (
        "10.00x faster than stock; outputs identical to stock or near-tie 3/3 (need >= 5x): "
        "PASS")
    assert not any("growing TTFT" in k for k in res["acceptance"])  # not a follow-up chat
    failed = _stock_vs_exact(convs, need=20)["acceptance"]
    assert failed["sgl_spec exact: doc_chat TTFT of turns >= 2"].endswith("(need >= 20x): FAIL")

    md = tables.markdown(res)
    assert "## Speed chats" in md and "## Serving" in md and "## Divergent speed-chat" in md
    assert "| doc_chat | **sgl_spec exact / stock** | 1x | 0.1x | 1x | 1.72x | 1x |  |" in md
    assert "| growing | **sgl_spec exact / stock** | 1x | 0.5x |" in md
    assert "| doc_chat | sgl_spec exact | 5000 | 350 | 100.0 | " in md
    assert "| doc_chat | stock | 5000 | 3500 | 100.0 | 2.20 | 3000 | 2/3 identical, 1 near-tie, " \
        "0 other |" in md
    assert "| **sgl_spec exact / stock** | 0.868x | 0.868x | 1x | 1.27x | 1x |  |" in md
    assert "| stock | 9016 | 9016 | 357.1 | 32.18 | 547 | 1/2 texts identical |" in md
    assert "| sgl_spec exact | 7823 | 7823 | 357.1 | 40.86 | 547 | reference |" in md
    assert ("| stock | doc_chat | doc_chat-0 | 3 | 1 | 9 | 2 | 0.100 | 0.100 | yes "
            "| yes |") in md
    assert "- sgl_spec exact: doc_chat TTFT of turns >= 2: 10.00x faster than stock" in md


def test_resume_reads_back_rows_played_on_the_same_inputs(convs, monkeypatch, tmp_path):
    """--resume: a row already played on the same inputs is read back (turns, server
    info, counters), not played again; other inputs or another row's flags replay it;
    the report marks the reused row and its ratio across runs."""
    toml = tmp_path / "set.toml"
    toml.write_text('name = "two"\n[[config]]\nname = "sgl_spec exact"\nlauncher = "sgl_spec"\n'
                    'flags = ["--spec-mode", "exact"]\nreference = true\n[[config]]\n'
                    'name = "loopserve B=512"\nlauncher = "sgl_spec"\n'
                    'flags = ["--spec-mode", "loopserve", "--spec-budget", "512"]\n')
    sets = configset.load(str(toml))
    out = tmp_path / "out"
    out.mkdir()
    for name in runner.INPUT_FILES:
        (out / name).write_text("[]")
    played = []

    def fake_run(cfg, model, work, out_dir, progress, pinned=None, journal=None):
        played.append(cfg.name)
        chat, lg = _results(convs, lambda t: t.answer)
        return results.ConfigRun(cfg.name, asdict(cfg), {"peak_rss_bytes": 1}, chat,
                                 lg, SPARSE, {}, None)

    monkeypatch.setattr(runner, "run_config", fake_run)
    work = runner.Workloads(plan.RunPlan.preset(True), convs, 32, [], {})
    first = runner.side_by_side(sets, "/m", DATA, work, str(out), False)
    assert played == ["sgl_spec exact", "loopserve B=512"]
    again = runner.side_by_side(sets, "/m", DATA, work, str(out), False, resume=True)
    assert played == ["sgl_spec exact", "loopserve B=512"]  # nothing played again
    for a, b in zip(first["configs"], again["configs"]):
        assert a["accuracy"] == b["accuracy"] and a["server"] == b["server"]
        assert a["sparse_decode"] == b["sparse_decode"]
    assert again["configs"][1]["agreement"] == first["configs"][1]["agreement"]
    # Other inputs: every row is played again.
    (out / "chats.json").write_text("{}")
    runner.side_by_side(sets.only(["loopserve B=512"]), "/m", DATA, work, str(out), False,
                        resume=True)
    assert played[2:] == ["sgl_spec exact", "loopserve B=512"]
    monkeypatch.setattr(runner, "_meta", lambda *a: {
        **runner.provenance.run_meta("/m", configset="two", quick=False,
                                     dataset_preset="custom", concurrency=1),
        "started": "later"})
    mixed = runner.side_by_side(sets, "/m", DATA, work, str(out), False, resume=True)
    assert played[4:] == []
    assert mixed["configs"][1]["ratio_across_runs"] is False  # both from the same run
    # Replay only the reference: the loopserve row's ratio now spans two runs.
    (out / "turns-sgl_spec-exact.json").unlink()
    mixed = runner.side_by_side(sets, "/m", DATA, work, str(out), False, resume=True)
    assert played[4:] == ["sgl_spec exact"]
    assert mixed["configs"][1]["ratio_across_runs"] is True
    md = tables.markdown(mixed)
    assert "Rows read back from earlier runs" in md and "(other run)" in md


def test_server_ports_are_free_and_below_the_ephemeral_range():
    """A server binds its port minutes after it is chosen; a port of the kernel's
    source-port range can meanwhile be taken by any outgoing connection (seen in CI:
    "address already in use" after a 3.5 min boot beside other servers)."""
    import socket

    from sgl_spec.bench import server

    top = min(server._ephemeral_start(), server._HIGHEST_PORT)
    ports = {server.free_port() for _ in range(20)}
    assert all(server._LOWEST_PORT <= p < top for p in ports) and len(ports) > 1
    for p in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))   # still free


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path):
    """Seen in CI: another server's TCPStore took a port chosen minutes earlier, and the
    HTTP server's bind failed after its boot. A real uvicorn (sglang's HTTP server) is
    started on a port held by a listening socket: it fails the bind, and ``start``
    launches it again on a free port, which answers /health."""
    import socket

    import requests

    from sgl_spec.bench.server import ServerProcess

    (tmp_path / "health_app.py").write_text(
        "async def app(scope, receive, send):\n"
        "    if scope['type'] != 'http':\n"
        "        return\n"
        "    await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "    await send({'type': 'http.response.body', 'body': b'ok'})\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        proc = ServerProcess("uvicorn", ["health_app:app"], port=taken, timeout_s=60,
                             env={"PYTHONPATH": str(tmp_path)})
        with proc:
            assert proc.port != taken
            assert requests.get(proc.url + "/health", timeout=5).status_code == 200


def test_an_interrupted_row_resumes_after_its_finished_conversations(convs, monkeypatch,
                                                                    tmp_path):
    """The QA conversations are journaled as they finish: a run killed in its third
    conversation leaves two; --resume plays only the others, and the row's turns (in
    dataset order) and sparse counters equal an uninterrupted run's. Another row's
    journal, a torn last line and a fresh (non-resumed) run are handled."""
    from sgl_spec.bench.journal import Journal
    from sgl_spec.bench.sparse_counters import SparseCounters

    chat, _ = _results(convs, lambda t: t.answer)
    steps = {"n": 0}  # the server's cumulative decode steps, as /metrics reads
    played, kill_at = [], {"n": None}

    def fake_play(client, model, conv, max_tokens, history=None, on_turn=None,
                  ignore_eos=False):
        played.append(conv.name)
        out = []
        for t in (t for t in chat if t.conversation == conv.name):
            steps["n"] += 10
            if len(played) == kill_at["n"] and out:
                raise KeyboardInterrupt  # the session ends mid-conversation
            out.append(t)
            on_turn(t)
        return out

    monkeypatch.setattr(runner.chat_client, "play", fake_play)
    monkeypatch.setattr(runner.chat_client, "make_client", lambda url: None)
    monkeypatch.setattr(runner.sparse_counters, "read",
                        lambda url: SparseCounters(steps["n"] / 2, steps["n"] / 2, 0.0))
    work = runner.Workloads(plan.RunPlan.preset(True), convs, 32, [], {})
    progress = runner.Progress(work.turns)

    def qa(journal):
        return runner._play_qa("http://x", "m", work, progress, "row", journal)

    whole, counts, _ = qa(Journal(str(tmp_path), "row", "fp", resume=False))
    assert whole == chat and counts["decode_steps"] == 10 * len(chat)
    assert played == [c.name for c in convs]

    steps["n"], played[:], kill_at["n"] = 0, [], 3
    with pytest.raises(KeyboardInterrupt):
        qa(Journal(str(tmp_path), "row", "fp", resume=False))
    lines = (tmp_path / "journal-row.jsonl").read_text().splitlines()
    kill_at["n"], played[:] = None, []
    j = Journal(str(tmp_path), "row", "fp", resume=True)
    # The first two: not the killed one, nor any queued behind it (the failure stops
    # them before they start, however late the main thread sees it).
    assert sorted(j.done.turns) == sorted(c.name for c in convs[:2])
    assert len(lines) == 3
    again, counts, _ = qa(j)
    assert played == [c.name for c in convs if c.name not in j.done.turns]
    assert again == chat
    # The killed conversation's steps belong to no line: the total is the uninterrupted
    # run's.
    assert counts["decode_steps"] == 10 * len(chat)
    progress.close()

    # A torn last line: that conversation is played again. Another fingerprint, or
    # resume off: everything is.
    path = tmp_path / "journal-row.jsonl"
    path.write_text("\n".join(lines[:2] + [lines[2][:50]]) + "\n")
    assert sorted(Journal(str(tmp_path), "row", "fp", resume=True).done.turns) == [
        convs[0].name]
    assert path.read_text().splitlines() == lines[:2]  # the torn line dropped
    path.write_text("\n".join(lines) + "\n")
    assert Journal(str(tmp_path), "row", "other", resume=True).done.turns == {}
    assert Journal(str(tmp_path), "row", "fp", resume=False).done.turns == {}
    assert path.read_text().splitlines() == ['{"fingerprint": "fp"}']


def test_untracked_paths_are_listed_not_counted_as_dirty(monkeypatch):
    """A run's own output folder in the repo is untracked at its start: listed, not
    'dirty'; a change to a tracked file is."""
    from sgl_spec.bench import provenance

    answers = {("status", "--porcelain", "--untracked-files=no"): "",
               ("ls-files", "--others", "--exclude-standard", "--directory"):
                   "docs/results/data/run/\n",
               ("rev-parse", "HEAD"): "abc"}
    monkeypatch.setattr(provenance, "_git", lambda *a: answers[a])
    assert provenance.git() == {"commit": "abc", "dirty": False,
                                "untracked": ["docs/results/data/run/"]}
    answers[("status", "--porcelain", "--untracked-files=no")] = " M sgl_spec/config.py"
    assert provenance.git()["dirty"] is True


def test_machine_record_names_the_cpu_matmul_flags(monkeypatch):
    """Hosts of one CPU model name differ in AMX; the record says which this one has."""
    from sgl_spec import cpu
    from sgl_spec.bench import provenance

    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"fpu", "amx_tile", "avx2",
                                                         "avx512_bf16"}))
    assert provenance.machine()["cpu_matmul_flags"] == ["avx2", "avx512_bf16", "amx_tile"]
    monkeypatch.setattr(cpu, "flags", lambda: frozenset())
    assert provenance.machine()["cpu_matmul_flags"] == []


def test_offload_report_is_none_without_a_server_or_offload():
    assert runner.offload_report("http://127.0.0.1:9") is None  # nothing listens
