"""The decode calibration behind the exact fallback: where a sparse step pays on this host
(``sgl_spec.attention.step_cost``, ``python -m sgl_spec.calibrate decode``) and how a
server given the profile (``--spec-decode-profile``) decodes shorter histories exactly."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from sgl_spec.attention import step_cost
from sgl_spec.attention.step_cost import NEVER, crossover
from sgl_spec.config import DecodeConfig
from sgl_spec.launch_server import split_argv, with_decode_profile

H = (1024, 2048, 4096, 8192)


@pytest.mark.parametrize("sparse, want", [
    ((0.5, 1.0, 2.0, 3.0), 1024),             # faster everywhere
    ((2.0, 2.5, 3.0, 4.0), 4096),             # pays from 4k on
    ((0.9, 2.5, 3.0, 4.0), 4096),             # faster at 1k, slower at 2k: not from 1k
    ((0.5, 1.0, 2.0, 9.0), NEVER),            # slower at the longest: never
    ((1.0, 2.0, 4.0, 8.0), NEVER),            # level is not faster
])
def test_crossover_is_where_sparse_stays_faster(sparse, want):
    assert crossover(H, (1.0, 2.0, 4.0, 8.0), sparse) == want


def _profile(tmp_path, cross=4096, layers=30, **decode):
    d = {k: getattr(DecodeConfig(mode="loopserve"), k) for k in step_cost.MATCH}
    d.update(decode)
    shape = {"num_layers": layers, "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    prof = {"format": 1, "shape": shape, "decode": d, "histories": list(H),
            "exact_s": [1, 2, 4, 8], "sparse_s": [2, 2.5, 3, 4], "crossover": cross}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(prof))
    return str(path)


def _model(tmp_path, layers=30):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "torch_dtype": "bfloat16"}))
    return str(model)


def test_a_profile_raises_min_context_to_its_crossover(tmp_path):
    path = _profile(tmp_path, cross=4096)
    argv = ["--model-path", _model(tmp_path)]
    for given, want in ((2048, 4096), (8192, 8192)):    # the larger of the two
        cfg, _ = split_argv(["--spec-mode", "loopserve", "--spec-min-context", str(given),
                             "--spec-decode-profile", path])
        got = with_decode_profile(cfg, argv).decode
        assert (got.mode, got.min_context) == ("loopserve", want)
        assert got.use_exact(want - 1) and not got.use_exact(want)


def test_a_mode_that_never_paid_serves_exact(tmp_path):
    cfg, _ = split_argv(["--spec-mode", "loopserve", "--spec-decode-profile",
                         _profile(tmp_path, cross=None)])
    got = with_decode_profile(cfg, ["--model-path", _model(tmp_path)])
    # exact: no policy, no head; the decision says why (GET /sgl_spec/cache)
    assert got.decode == DecodeConfig(decision=got.decode.decision)
    assert "faster than exact at no measured history" in got.decode.decision
    assert got.cache == cfg.cache and got.krul == cfg.krul
    assert step_cost.min_context(step_cost.read_profile(_profile(tmp_path, cross=None)),
                                 cfg.decode) == NEVER


def test_auto_measures_once_per_host_model_dtype_and_flags_then_reuses(tmp_path, monkeypatch):
    """--spec-decode-profile auto (the default): the first start measures the profile
    into the cache dir, a second start reads it back; other flags or another KV dtype
    measure their own. The decision (GET /sgl_spec/cache) names it."""
    monkeypatch.setenv("SGLSPEC_CACHE_DIR", str(tmp_path / "cache"))
    measured = []

    def fake_profile(model, cfg, histories, steps, repeats, dtype, device):
        measured.append((cfg.budget, dtype))
        return json.loads(open(_profile(tmp_path, cross=None, budget=cfg.budget)).read()) | {
            "kv_dtype": dtype, "histories": list(histories)}

    monkeypatch.setattr(step_cost, "profile", fake_profile)
    argv = ["--model-path", _model(tmp_path), "--dtype", "float32"]
    cfg, _ = split_argv(["--spec-mode", "loopserve"])
    assert cfg.decode.profile_path == "auto"
    for _ in range(2):
        got = with_decode_profile(cfg, argv).decode
        assert got.mode == "exact" and "at no measured history" in got.decision
    assert measured == [(1024, "float32")]  # once
    other, _ = split_argv(["--spec-mode", "loopserve", "--spec-budget", "512"])
    with_decode_profile(other, argv)
    with_decode_profile(cfg, argv[:2])  # the model's own bfloat16
    assert measured == [(1024, "float32"), (512, "float32"), (1024, "bfloat16")]
    d = DecodeConfig(mode="loopserve")
    assert step_cost.profile_path(argv[1], d, "float32") != step_cost.profile_path(
        argv[1], dataclasses.replace(d, nd=8), "float32")
    off, _ = split_argv(["--spec-mode", "loopserve", "--spec-decode-profile", "off"])
    got = with_decode_profile(off, argv).decode
    assert (got.mode, got.min_context) == ("loopserve", 2048)
    assert got.decision.startswith("--spec-decode-profile off")
    assert len(measured) == 3


def test_a_profile_of_other_flags_or_another_model_is_refused(tmp_path):
    path = _profile(tmp_path, budget=512, layers=24)
    cfg, _ = split_argv(["--spec-mode", "loopserve", "--spec-decode-profile", path])
    with pytest.raises(ValueError) as exc:
        with_decode_profile(cfg, ["--model-path", _model(tmp_path, layers=30)])
    msg = str(exc.value)
    assert "--spec-decode-profile" in msg and "budget 512 (this server: 1024)" in msg
    assert "num_layers 24 (this model: 30)" in msg and "num_q_heads" not in msg
    assert "python -m sgl_spec.calibrate decode" in msg
    with pytest.raises(ValueError, match="measured on cpu; this host serves on cuda; valid: "
                       "a profile from python -m sgl_spec.calibrate decode --device cuda"):
        with_decode_profile(cfg, [], cpu=False)
    cfg, _ = split_argv(["--spec-mode", "specontext", "--spec-decode-profile", path])
    with pytest.raises(ValueError, match="mode 'loopserve' \\(this server: 'specontext'\\)"):
        with_decode_profile(cfg, [])


def test_a_profile_serves_the_device_it_was_measured_on(tmp_path):
    """A GPU's profile (calibrate decode --device cuda) on a CUDA host, not on a CPU one."""
    path = _profile(tmp_path, cross=8192, mode="specontext")
    prof = json.loads(open(path).read())
    prof["device"] = "cuda"
    open(path, "w").write(json.dumps(prof))
    cfg, _ = split_argv(["--spec-mode", "specontext", "--spec-decode-profile", path])
    argv = ["--model-path", _model(tmp_path)]
    assert with_decode_profile(cfg, argv, cpu=False).decode.min_context == 8192
    with pytest.raises(ValueError, match="measured on cuda; this host serves on cpu; valid: "
                       "a profile from python -m sgl_spec.calibrate decode --device cpu"):
        with_decode_profile(cfg, argv)


def test_a_profile_of_another_kv_dtype_is_refused(tmp_path):
    """A profile without the field timed bfloat16 (every one before it): a float32 server
    computes its steps at other speeds on a CPU without AVX512-BF16."""
    path = _profile(tmp_path, cross=4096)
    model = _model(tmp_path)
    cfg, _ = split_argv(["--spec-mode", "loopserve", "--spec-decode-profile", path])
    assert with_decode_profile(cfg, ["--model-path", model]).decode.min_context == 4096
    for argv in (["--dtype", "float32"], ["--dtype=float"], ["--kv-cache-dtype", "fp8_e5m2"]):
        with pytest.raises(ValueError) as exc:
            with_decode_profile(cfg, ["--model-path", model, *argv])
        want = "float32" if "float" in argv[-1] else "fp8_e5m2"
        assert f"a bfloat16 KV pool (this server: {want})" in str(exc.value)
        assert "--dtype" in str(exc.value)
    prof = json.loads(open(path).read())
    prof["kv_dtype"] = "float32"
    open(path, "w").write(json.dumps(prof))
    assert with_decode_profile(cfg, ["--model-path", model, "--dtype", "float32"]
                               ).decode.min_context == 4096
    with pytest.raises(ValueError, match="a float32 KV pool \\(this server: bfloat16\\)"):
        with_decode_profile(cfg, ["--model-path", model])
    assert step_cost.kv_dtype("auto", "auto", {"torch_dtype": "float16"}) == "float16"
    assert step_cost.kv_dtype(None, None, {"torch_dtype": "float32"}) == "float16"  # sglang's
    assert step_cost.kv_dtype(None, None, {"model_type": "gemma2"}) == "bfloat16"
    assert step_cost.kv_dtype("half", None, None) == "float16"


def test_bad_profiles_exit_2_before_sglang_loads(tmp_path, capsys):
    bad = tmp_path / "decode.json"
    for text in ("{", "{}", "[1]", '{"format": 1, "shape": {"num_layers": 30}, '
                 '"decode": {"mode": "loopserve"}, "crossover": 4096}'):
        bad.write_text(text)
        with pytest.raises(SystemExit) as exc:
            split_argv(["--spec-mode", "loopserve", "--spec-decode-profile", str(bad)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--spec-decode-profile" in err and ("not JSON" in err or "not a decode" in err)
    with pytest.raises(SystemExit):
        split_argv(["--spec-mode", "loopserve", "--spec-decode-profile", str(tmp_path / "no")])
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--spec-decode-profile is read only with a sparse"):
        DecodeConfig(profile_path="x.json")


def test_the_measured_steps_are_the_served_path(model_path):
    """A short profile on the default model's shape: the sparse row's timed steps are all
    sparse, with LoopServe's reselections among them (whole --spec-nd intervals), the
    exact row's none; the crossover follows from the rows."""
    cfg = DecodeConfig(mode="loopserve", budget=256, nd=4)
    prof = step_cost.profile(model_path, cfg, (1024, 2048), steps=6, repeats=1, threads=1,
                             progress=False)
    shape = {"num_layers": 30, "num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    assert prof["shape"] == shape and prof["steps"] == 8
    assert all(t > 0 for t in prof["exact_s"] + prof["sparse_s"])
    assert len(prof["exact_runs_s"]) == len(prof["sparse_runs_s"]) == 2
    for c in prof["sparse_counts"]:
        assert (c["sparse_steps"], c["exact_steps"], c["reselections"]) == (8, 0, 2)
    want = crossover(prof["histories"], prof["exact_s"], prof["sparse_s"])
    assert prof["crossover"] == (None if want == NEVER else want)
    assert step_cost.min_context(prof, dataclasses.replace(cfg, min_context=0), shape) == want
    with pytest.raises(ValueError, match="valid: histories > 388"):
        step_cost.profile(model_path, DecodeConfig(mode="loopserve", budget=256), (256,))


def test_calibrate_decode_cli_writes_the_profile_a_server_reads(model_path, tmp_path):
    """The command end to end for SpeContext (its retrieval head planned every step): a
    profile file that the launcher accepts for the same flags."""
    from conftest import _head

    head = _head(model_path)
    out = tmp_path / "decode.json"
    flags = ["--spec-mode", "specontext", "--spec-budget", "256", "--spec-draft-path", head]
    run = subprocess.run([sys.executable, "-m", "sgl_spec.calibrate", "decode", "--quick",
                          "--threads", "1", "--dtype", "float32", "--out", str(out),
                          "--trace", str(tmp_path / "trace.txt"), *flags],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(out)
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert "history   exact ms   sparse ms" in run.stdout
    table = (tmp_path / "trace.txt").read_text()  # the sparse steps' stages, profiled
    assert table.startswith("specontext B=256, 3072 tokens x 1, 8 steps")
    for stage in ("plan", "head capture", "layer"):
        assert f" {stage} " in table
    prof = step_cost.read_profile(str(out))
    assert prof["decode"]["mode"] == "specontext" and prof["histories"] == [1536, 3072]
    for c in prof["sparse_counts"]:  # every timed step sparse, each loading part of B
        assert c["sparse_steps"] == prof["steps"] and c["exact_steps"] == 0
        assert 0 < c["rows_loaded"] < 256 and 0 < c["overlap"] < 1
    assert prof["kv_dtype"] == "float32" and "float32 KV" in run.stdout
    cfg, _ = split_argv([*flags, "--spec-decode-profile", str(out)])
    got = with_decode_profile(cfg, ["--model-path", model_path, "--dtype", "float32"]).decode
    assert got.mode in ("specontext", "exact")
    with pytest.raises(ValueError, match="float32 KV pool"):   # the model's own bfloat16
        with_decode_profile(cfg, ["--model-path", model_path])
    bad = subprocess.run([sys.executable, "-m", "sgl_spec.calibrate", "decode"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--spec-mode exact has nothing to calibrate" in bad.stderr


def test_decode_rows_say_which_requests_attend_a_subset_and_why():
    """GET /sgl_spec/cache's decode.rows: per live request, its path and the reason."""
    from _sparse import SHAPE

    from sgl_spec.attention.decode import Decoder
    from sgl_spec.sparse import get_policy

    cfg = DecodeConfig(mode="loopserve", budget=8, sink=2, window=4, nd=4,
                       first_select_step=4, min_context=32)
    dec = Decoder(SHAPE, get_policy("loopserve", cfg, SHAPE))
    for rid, n in (("short", 20), ("young", 40), ("old", 40)):
        dec._step(rid, n)
    for k in range(5):
        dec._step("old", 41 + k)
    rows = dec.rows()
    assert rows["short"] == {"history": 20, "step": 0, "path": "exact",
                             "why": "exact: history 20 < min_context 32"}
    # started at decode, not at prefill: no prompt seed, dense until step 4
    assert rows["young"]["why"] == ("exact until LoopServe's first selection (step 4): "
                                    "no prompt seed")
    assert rows["old"]["path"] == "sparse" and rows["old"]["history"] == 45
    dec.release("old")
    assert "old" not in dec.rows() and Decoder(SHAPE).rows() == {}
