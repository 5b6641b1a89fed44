"""The kernel micro-benchmarks (``sgl_spec.bench.vslash``, ``sgl_spec.bench.reselect``) on
tiny shapes: every figure is reported and the ratios are the figures' ratios."""

from __future__ import annotations

import json

import pytest
import torch


def test_crossover_bench_times_every_path_on_the_same_extend():
    """The bench behind the README's crossover table runs on a tiny layer: every path
    is timed, the baseline (exact mode's masked call) and the fused split agree, and
    the serving path's figure is reported."""
    from sgl_spec.bench.vslash import break_even, crossover, dense_sdpa
    from sgl_spec.kernels.dense import dense_attention_torch

    g = torch.Generator().manual_seed(3)
    hist, n = 48, 80
    lay = {"q": torch.randn(hist + n, 6, 16, generator=g),
           "k": torch.randn(hist + n, 2, 16, generator=g),
           "v": torch.randn(hist + n, 2, 16, generator=g), "layer": 0}
    q, k, v = lay["q"][hist:], lay["k"], lay["v"]
    torch.testing.assert_close(dense_sdpa(q, k, v, hist), dense_attention_torch(q, k, v, hist),
                               rtol=1e-4, atol=1e-5)
    (row,) = crossover([lay], [n], hist, alpha=0.9, repeats=1)
    for key in ("dense_s", "split_s", "select_s", "vslash_s", "serving_s", "steady_s"):
        assert row[key] > 0 and row["per_layer"][0][key] == row[key]
    assert 0 < row["density"] <= 1 and row["n"] == n and row["history"] == hist
    layer = row["per_layer"][0]
    assert layer["fallback_s"] == layer["split_s"]  # over a prefix: the fused split
    (b,) = break_even(row["per_layer"])
    assert b["lo"] <= layer["density"] < b["hi"] and b["layers"] == 1
    assert b["vslash"] == pytest.approx(layer["vslash_s"] / layer["split_s"])


def test_vslash_cli_appends_json_lines(tmp_path, capsys):
    from sgl_spec.bench import vslash

    out = tmp_path / "rows.jsonl"
    args = ["--n", "64", "--history", "32", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--density", "0.5", "--vertical-share", "0.5",
            "--repeats", "1", "--out", str(out)]
    vslash.main(args)
    vslash.main(args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2  # --out appends
    r = rows[0]
    assert (r["n"], r["history"], r["q_heads"], r["kv_heads"], r["head_dim"]) == (64, 32, 4, 2,
                                                                                 16)
    assert r["speedup"] == pytest.approx(r["dense_sdpa_s"] / r["vslash_torch_s"])
    assert r["device"] == "cpu"
    assert 0 < r["density"] <= 1
    assert "dense SDPA" in capsys.readouterr().out


def test_reselect_bench_ratio_is_reselect_over_nd_dense_steps(tmp_path):
    from sgl_spec.bench import reselect

    res = reselect.run(seq_len=256, nd=4, budget=32, num_q_heads=4, num_kv_heads=2,
                       head_dim=16, dtype=torch.float32, repeats=1)
    assert res["config"]["seq_len"] == 256 and res["config"]["nd"] == 4
    assert list(res["per_layer"]) == ["K/V laid out", "gather from pool"]
    for r in res["per_layer"].values():
        assert r["nd_dense_steps_ms"] == pytest.approx(4 * r["dense_step_ms"])
        assert r["ratio"] == pytest.approx(r["reselect_ms"] / r["nd_dense_steps_ms"])
    p = res["parts"]
    calls = ("gather_ms", "score_history_ms", "select_ms")
    torch_calls = ("gather_ms", "score_history_torch_ms", "look_ahead_ms", "select_topk_ms")
    assert p["sum_ms"] == pytest.approx(sum(p[k] for k in calls))
    assert p["torch_sum_ms"] == pytest.approx(sum(p[k] for k in torch_calls))
    assert all(p[k] > 0 for k in (*calls, *torch_calls, "logits_matmul_fp32_ms",
                                  "logits_matmul_bf16_ms", "layers_batched_look_ahead_select_ms"))
    out = tmp_path / "r.json"
    reselect.main(["--seq-len", "256", "--nd", "4", "--budget", "32", "--num-q-heads", "4",
                   "--num-kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                   "--threads", "0", "--layers", "3", "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["config"]["budget"] == 32 and got["config"]["layers"] == 3
    with pytest.raises(SystemExit):
        reselect.main(["--layers", "0"])


def test_extend_bench_times_every_call_and_reports_the_rules_pick(tmp_path):
    from sgl_spec.attention.extend import CALLS
    from sgl_spec.bench import extend

    extend.main(["--points", "4:32", "64:16", "--repeats", "1", "--rounds", "2",
                 "--dtype", "float32", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["prefix"], r["new"]) for r in res["points"]] == [(4, 32), (64, 16)]
    assert [r["pick"] for r in res["points"]] == ["padded", "masked"]
    for r in res["points"]:
        assert set(r["ms"]) == set(CALLS) and all(0 < s[0] <= s[1] <= s[2]
                                                  for s in r["ms"].values())
        assert r["pick_over_best"] >= 1.0
    assert "| 64 | 16 |" in (tmp_path / "results.md").read_text()
    for bad in (["--points", "4"], ["--points", "-1:4"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            extend.main([*bad, "--out", str(tmp_path)])


def test_batched_selection_over_layers_equals_one_call_per_layer():
    """The parts' batched row selects L layers' scores in one call: the same top-B as one
    call per layer (the look-ahead and the stable ties are row-wise)."""
    from sgl_spec.sparse.scoring import look_ahead, select_topk

    gen = torch.Generator().manual_seed(0)
    mass = torch.rand(3, 2, 200, generator=gen).round(decimals=1)  # ties
    lo, hi = torch.tensor([4, 4, 4]), torch.tensor([180, 180, 180])
    together = select_topk(look_ahead(mass, 8, lo), 32, lo, hi, first_of_ties=True)
    for i in range(3):
        one = select_topk(look_ahead(mass[i:i + 1], 8, lo[:1]), 32, lo[:1], hi[:1],
                          first_of_ties=True)
        assert torch.equal(together[i:i + 1], one)


def test_decode_kernels_bench_reports_every_path_and_its_error(tmp_path, capsys):
    from sgl_spec.bench import decode_kernels

    decode_kernels.main(["--out", str(tmp_path), "--histories", "64", "300", "--batches", "2",
                         "--layers", "2", "--repeats", "1", "--budget", "32",
                         "--kept-share", "0.5"])
    res = json.loads((tmp_path / "results.json").read_text())
    short, long_ = res["points"]
    assert set(short["ms"]) == {"torch_native", "exact cpu", "exact torch"}
    assert set(long_["ms"]) == {*decode_kernels.PATHS}  # the sparse step needs a history
    for pt in res["points"]:
        assert pt["vs_torch_native"]["torch_native"] == 1.0
        assert all(v > 0 for v in pt["ms"].values())
        assert all(e < 2e-2 for e in pt["rel_err"].values())  # bf16 against fp64
    out = capsys.readouterr().out
    assert "| 300 | 2 | loopserve cpu |" in out and "| 300 | 2 | round cpu |" in out
    assert res["config"]["watershed"] == 1  # 0.4 of the layers
    # LoopServe's reselection, where it has a sparse step: its cost and the mean step
    assert "reselect_ms" not in short and long_["reselect_ms"] > 0
    assert "LoopServe at 300 x 2: a reselection (every 16 steps) adds" in out


def test_split_tune_table_marks_the_default_and_refuses_a_cpu_host(capsys):
    """The split-rule tuner's table has a row per pair, the default marked, the ratio
    column the geometric mean given; without CUDA it exits naming what it needs."""
    from sgl_spec.bench import split_tune

    pts = [{"history": 8192, "batch": 1,
            "ms": {"1x1": {"exact": 2.0, "loopserve": 3.0},
                   "2x4": {"exact": 2.5, "loopserve": 3.5}}}]
    md = split_tune.markdown({"config": {"layers": 30, "repeats": 10, "gpu": "G",
                                         "pairs": ["1x1", "2x4"], "default": "2x4"},
                              "points": pts, "geomean_vs_default": {"1x1": 0.8, "2x4": 1.0},
                              "best": "1x1"})
    assert "| 2x4 (default) | 2.50 | 3.50 | 1x |" in md and "| 1x1 | 2.00 | 3.00 | 0.8x |" in md
    assert md.rstrip().endswith("Best: 1x1.")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            split_tune.main(["--out", "unused"])
        assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_restore_kernel_bench_times_each_path_and_checks_the_rows(tmp_path):
    from sgl_spec.bench import restore_kernel

    restore_kernel.main(["--out", str(tmp_path), "--tokens", "64", "--layers", "2",
                         "--repeats", "2", "--threads", "1", "--codecs", "k8v4"])
    res = json.loads((tmp_path / "results.json").read_text())
    (pt,) = res["points"]
    assert pt["one_pass_equals_torch"] and pt["checksums_equal"] and pt["threads"] == 1
    assert set(pt["ms"]) == {"full copy", "codec, torch", "codec, one pass",
                             "verify: checksum, gathered", "verify: checksum, in place",
                             "estimator: rows, gathered", "estimator: rows, in place"}
    assert all(0 < s["min"] <= s["median"] <= s["max"] for s in pt["ms"].values())
    assert "codec, one pass" in (tmp_path / "results.md").read_text()
