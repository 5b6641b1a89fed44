"""sgl_spec.launch_server argument handling and SpecConfig (no server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_spec import config as spec_config
from sgl_spec.config import CacheConfig, DecodeConfig, PrefillConfig, SpecConfig
from sgl_spec.launch_server import CPU_MAX_TOTAL_TOKENS, split_argv, sglang_argv


def test_spec_flags_are_split_from_sglang_flags():
    cfg, rest = split_argv(["--model-path", "/m", "--spec-mode", "exact", "--tp-size", "1"])
    assert cfg == SpecConfig()
    assert rest == ["--model-path", "/m", "--tp-size", "1"]
    cfg, rest = split_argv(["--spec-disable", "--port=1"])
    assert cfg.disable and rest == ["--port=1"]


def test_sparse_flags_fill_the_config_and_its_params():
    cfg, rest = split_argv([
        "--spec-mode", "loopserve", "--spec-budget", "64", "--spec-sink=2",
        "--spec-window", "8", "--spec-nd", "4", "--spec-min-context", "0", "--port", "1",
    ])
    assert rest == ["--port", "1"]
    d = cfg.decode
    assert (d.mode, d.budget, d.sink, d.window, d.nd, d.min_context) == (
        "loopserve", 64, 2, 8, 4, 0)
    defaults, _ = split_argv([])
    assert defaults == SpecConfig()  # the flags' defaults are the config's, one source
    d = defaults.decode
    assert (d.mode, d.budget, d.sink, d.window, d.nd, d.min_context) == (
        "exact", 1024, 4, 64, 16, 2048)


@pytest.mark.parametrize(
    "argv, flag, valid",
    [
        (["--spec-mode", "bogus"], "--spec-mode", "exact"),
        (["--spec-bogus", "1"], "--spec-bogus", "--spec-mode"),
        (["--spec-mode=nope"], "--spec-mode", "loopserve"),
        (["--spec-budget", "0"], "--spec-budget", "valid range: integers >= 1"),
        (["--spec-budget=lots"], "--spec-budget", "valid range: integers >= 1"),
        (["--spec-sink", "-1"], "--spec-sink", "valid range: integers >= 0"),
        (["--spec-window", "0"], "--spec-window", "valid range: integers >= 1"),
        (["--spec-nd", "1.5"], "--spec-nd", "valid range: integers >= 1"),
        (["--spec-min-context", "-3"], "--spec-min-context", "valid range: integers >= 0"),
        (["--spec-prefill", "dense"], "--spec-prefill", "loopserve"),
        (["--spec-prefill-alpha", "0"], "--spec-prefill-alpha", "a number in (0, 1]"),
        (["--spec-prefill-alpha=1.5"], "--spec-prefill-alpha", "a number in (0, 1]"),
        (["--spec-prefill-alpha", "high"], "--spec-prefill-alpha", "a number in (0, 1]"),
        (["--spec-prefill-min-tokens", "0"], "--spec-prefill-min-tokens",
         "valid range: integers >= 1"),
        (["--spec-prefill-min-tokens", "1e3"], "--spec-prefill-min-tokens",
         "valid range: integers >= 1"),
        (["--spec-prefill-max-density", "0"], "--spec-prefill-max-density",
         "a number in (0, 1]"),
        (["--spec-prefill-skip-density", "2"], "--spec-prefill-skip-density",
         "a number in (0, 1]"),
    ],
    ids=["bad-mode", "unknown-flag", "equals-form", "budget-0", "budget-text",
         "sink-negative", "window-0", "nd-float", "min-context-negative",
         "prefill-mode", "prefill-alpha-0", "prefill-alpha-1.5", "prefill-alpha-text",
         "prefill-min-tokens-0", "prefill-min-tokens-float", "prefill-max-density-0",
         "prefill-skip-density-2"],
)
def test_bad_spec_flags_exit_2_naming_flag_and_choices(argv, flag, valid, capsys):
    with pytest.raises(SystemExit) as exc:
        split_argv(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and valid in err


def test_prefill_flags_fill_the_config_independently_of_the_decode_mode():
    p = split_argv([])[0].prefill
    assert (p.mode, p.alpha, p.min_tokens, p.reuse, p.max_density, p.skip_density) == (
        "exact", 0.97, 2048, True, 0.3, 0.2)
    cfg, rest = split_argv([
        "--spec-prefill", "loopserve", "--spec-prefill-alpha=0.98",
        "--spec-prefill-min-tokens", "256", "--no-spec-prefill-reuse", "--port", "1",
    ])
    assert rest == ["--port", "1"]
    p = cfg.prefill
    assert (cfg.decode.mode, p.mode, p.alpha, p.min_tokens, p.reuse) == (
        "exact", "loopserve", 0.98, 256, False)
    assert not cfg.tagged_cache  # no kept lines, LRU: sglang's compiled tree core
    cfg, _ = split_argv(["--spec-prefill-alpha", "1", "--spec-mode", "loopserve",
                         "--spec-prefill-reuse", "--spec-prefill", "loopserve"])
    assert cfg.prefill.alpha == 1.0 and cfg.prefill.reuse and cfg.decode.mode == "loopserve"
    assert cfg.tagged_cache  # LoopServe keeps its lines on the tree's nodes
    assert SpecConfig.from_json(cfg.to_json()) == cfg


def test_the_tree_core_is_asked_for_or_follows_the_features_that_read_tags():
    assert split_argv(["--spec-tree-core", "tagged"])[0].tagged_cache
    assert not split_argv(["--spec-tree-core", "compiled"])[0].tagged_cache
    assert split_argv(["--spec-cache-eviction", "turn"])[0].tagged_cache
    code, err = _split(["--spec-tree-core", "compiled", "--spec-krul"])
    assert code == 2 and "--spec-krul read turn tags" in err and "valid: auto or tagged" in err
    code, err = _split(["--spec-tree-core", "python"])
    assert code == 2 and "'auto', 'compiled', 'tagged'" in err, err


@pytest.mark.parametrize("bf16", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_cpu_defaults_are_added_only_when_not_given(bf16, monkeypatch):
    from sgl_spec import cpu

    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", *(["avx512_bf16"] * bf16)}))
    cfg = SpecConfig()
    out = sglang_argv(cfg, ["--model-path", "/m"], cpu=True)
    assert out == [
        "--model-path", "/m", "--device", "cpu",
        "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS),
        *([] if bf16 else ["--dtype", "float32"]),
        "--attention-backend", "sgl_spec", "--radix-cache-backend", "sgl_spec",
    ]
    given = ["--model=/m", "--device", "cpu", "--max-total-tokens=100", "--dtype", "bfloat16",
             "--attention-backend", "triton", "--disable-radix-cache"]
    assert sglang_argv(cfg, given, cpu=True) == given
    assert "--dtype" not in sglang_argv(cfg, ["--model-path", "/m"], cpu=False)


def test_spec_disable_serves_stock_components():
    out = sglang_argv(SpecConfig(disable=True), ["--model-path", "/m"], cpu=True)
    assert "sgl_spec" not in out
    assert out[out.index("--attention-backend") + 1] == "torch_native"
    out = sglang_argv(SpecConfig(disable=True), ["--model-path", "/m"], cpu=False)
    assert "--attention-backend" not in out and "--device" not in out


def test_config_json_round_trip_and_validation():
    cfg = SpecConfig(disable=True)
    assert SpecConfig.from_json(cfg.to_json()) == cfg
    sparse = SpecConfig(decode=DecodeConfig(mode="snapkv", budget=3, sink=0, window=2, nd=5,
                                            min_context=9),
                        cache=CacheConfig(eviction="turn"),
                        prefill=PrefillConfig(mode="loopserve", alpha=0.5))
    assert SpecConfig.from_json(sparse.to_json()) == sparse
    with pytest.raises(ValueError, match="valid keys"):
        SpecConfig.from_json('{"disable": false, "bogus": 3}')
    with pytest.raises(ValueError, match="decode has unknown keys.*valid keys"):
        SpecConfig.from_json('{"decode": {"mode": "exact", "bogus": 3}}')
    with pytest.raises(ValueError, match="valid values: exact, streaming, snapkv, loopserve"):
        DecodeConfig(mode="sparse")
    with pytest.raises(ValueError, match="--spec-window 0 is invalid; valid range: integers >= 1"):
        SpecConfig.from_json('{"decode": {"mode": "loopserve", "window": 0}}')
    with pytest.raises(ValueError, match="--spec-prefill-reuse 'yes' is invalid"):
        PrefillConfig(reuse="yes")


def _launch(*args: str) -> subprocess.CompletedProcess:
    # A hang guard, not a speed check: --help imports sglang, 15 s alone on a 2-core CPU
    # but ~90 s in CI beside the session servers' boots (120 s once timed out there).
    return subprocess.run(
        [sys.executable, "-m", "sgl_spec.launch_server", *args],
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--spec-mode", "bogus"], ["--spec-mode", "'exact'", "'loopserve'"]),
        (["--spec-budget", "0"], ["--spec-budget 0 is invalid; valid range: integers >= 1"]),
        (["--spec-prefill-alpha", "2"],
         ["--spec-prefill-alpha 2.0 is invalid; valid range: a number in (0, 1]"]),
    ],
    ids=["mode", "budget", "prefill-alpha"],
)
def test_invalid_flag_value_exits_nonzero_with_valid_values(argv, needles):
    proc = _launch(*argv)
    assert proc.returncode == 2
    for needle in needles:
        assert needle in proc.stderr


def test_help_lists_sglang_and_spec_flags():
    proc = _launch("--help")
    assert proc.returncode == 0
    for flag in ("--spec-mode", "--spec-disable", "--model-path", "--tp-size",
                 "--spec-budget", "--spec-sink", "--spec-window", "--spec-nd",
                 "--spec-min-context", "--spec-prefill", "--spec-prefill-alpha",
                 "--spec-prefill-min-tokens", "--no-spec-prefill-reuse",
                 "--spec-prefill-max-density", "--spec-prefill-skip-density",
                 "--spec-krul-profile"):
        assert flag in proc.stdout
    text = " ".join(proc.stdout.split())  # argparse wraps help lines
    assert "Default: exact" in text
    assert "Integer >= 1. Default: 1024." in text and "Default: 2048." in text
    assert "Number in (0, 1]. Default: 0.97." in text


def test_krul_flags_fill_the_config_and_need_hicache(tmp_path):
    from sgl_spec.config import KrulConfig
    from sgl_spec.launch_server import check_krul

    cfg, rest = split_argv(["--spec-krul", "--spec-krul-ratio", "0.25", "--spec-krul-max-error",
                            "0.5", "--enable-hierarchical-cache"])
    assert cfg.krul == KrulConfig(enable=True, ratio=0.25, max_error=0.5)
    assert cfg.tagged_cache and rest == ["--enable-hierarchical-cache"]
    check_krul(cfg, rest)
    with pytest.raises(ValueError, match="add --enable-hierarchical-cache"):
        check_krul(cfg, [])
    check_krul(cfg, [*rest, "--hicache-storage-backend", "file"])
    with pytest.raises(ValueError, match="valid: file, or no --hicache-storage-backend"):
        check_krul(cfg, [*rest, "--hicache-storage-backend", "mooncake"])
    with pytest.raises(ValueError, match="valid: --page-size 1"):
        check_krul(cfg, [*rest, "--hicache-storage-backend", "file", "--page-size", "16"])
    assert cfg.krul.codec == "k8v4"
    cfg8, _ = split_argv(["--spec-krul", "--spec-krul-codec", "full"])
    assert cfg8.krul.codec == "full"
    with pytest.raises(SystemExit):
        split_argv(["--spec-krul", "--spec-krul-codec", "fp4"])
    with pytest.raises(ValueError, match="--spec-krul-codec 'fp4' is invalid; valid values: "
                                         "k8v4, int8, full"):
        KrulConfig(enable=True, codec="fp4")
    with pytest.raises(ValueError, match="read only with --spec-krul"):
        KrulConfig(stats_path="x.json")
    assert cfg.krul.restore == "auto"  # a restore's recompute beside its load on a GPU
    assert split_argv(["--spec-krul", "--spec-krul-restore", "serial"])[0].krul.restore \
        == "serial"
    with pytest.raises(ValueError, match="--spec-krul-restore 'overlap' is invalid; valid "
                                         "values: auto, pipelined, serial"):
        KrulConfig(enable=True, restore="overlap")
    with pytest.raises(ValueError, match="--spec-krul-restore is read only with --spec-krul"):
        KrulConfig(restore="serial")
    assert cfg.krul.strategy == "conversation"          # Algorithm 1 on its own attention
    cfg_m, _ = split_argv(["--spec-krul", "--spec-krul-strategy", "model"])
    assert cfg_m.krul.strategy == "model"
    with pytest.raises(ValueError, match="--spec-krul-strategy 'layer' is invalid; valid "
                                         "values: conversation, model"):
        KrulConfig(enable=True, strategy="layer")
    with pytest.raises(ValueError, match="--spec-krul-strategy is read only with --spec-krul"):
        KrulConfig(strategy="model")
    with pytest.raises(ValueError, match="drop --spec-disable"):
        SpecConfig(disable=True, krul=KrulConfig(enable=True))


def test_krul_stats_file_is_checked_before_sglang_loads(tmp_path, capsys):
    bad = tmp_path / "stats.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        split_argv(["--spec-krul", "--spec-krul-stats", str(bad)])
    assert exc.value.code == 2
    assert "--spec-krul-stats" in capsys.readouterr().err


def test_krul_restore_profile_is_checked_before_sglang_loads(tmp_path, capsys):
    from sgl_spec.config import KrulConfig

    bad = tmp_path / "restore.json"
    for text, why in (("{", "not JSON"), ("{}", "format None"), ("[1]", "not a restore"),
                      ('{"format": 1, "shape": {}, "recompute_s": 1, "tiers": {"file": {}}}',
                       "valid: file"),
                      ('{"format": 1, "shape": {}, "recompute_s": 1, "tokens": 8, '
                       '"tiers": {"host": {"load_s": 1}}}', "not a restore profile")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as exc:
            split_argv(["--spec-krul", "--spec-krul-profile", str(bad)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--spec-krul-profile" in err and why in err, err
    with pytest.raises(ValueError, match="--spec-krul-profile is read only with --spec-krul"):
        KrulConfig(profile_path="x.json")


def test_krul_restore_profile_must_match_the_served_model(tmp_path):
    from sgl_spec.launch_server import check_krul_profile

    prof = tmp_path / "restore.json"
    prof.write_text('{"format": 1, "shape": {"num_layers": 24}, "recompute_s": 1, '
                    '"tokens": 4096, "tiers": {"host": {"load_s": 1}}}')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 30}')
    cfg, _ = split_argv(["--spec-krul", "--spec-krul-profile", str(prof)])
    with pytest.raises(ValueError, match="measured for a model of 24 layers.*has 30"):
        check_krul_profile(cfg, ["--model-path", str(model)])
    (model / "config.json").write_text('{"num_hidden_layers": 24}')
    check_krul_profile(cfg, ["--model-path", str(model)])


def test_calibration_rows_and_statistics_file_round_trip(tmp_path):
    import torch

    from sgl_spec.krul import calibrate
    from sgl_spec.krul.similarity import Similarity

    cc = calibrate.CalibrationConfig(last_rows=4, random_rows=3)
    rows = calibrate.query_rows(100, cc, torch.Generator().manual_seed(0))
    assert rows[-4:].tolist() == [96, 97, 98, 99] and len(rows) == 7
    assert bool((rows[:-4] >= 50).all()) and rows.tolist() == sorted(set(rows.tolist()))
    with pytest.raises(ValueError, match="cannot be read"):
        calibrate.load(str(tmp_path / "missing.json"))
    sim = Similarity(3)
    sim.gram += torch.eye(3)
    path = tmp_path / "s.json"
    path.write_text(__import__("json").dumps({"format": 1, "stats": sim.to_dict()}))
    torch.testing.assert_close(calibrate.load(str(path)).gram, sim.gram)


# ---- the flag space, property-based (issue 18: >= 200 examples each) -------------------
import contextlib  # noqa: E402
import io  # noqa: E402
import string  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sgl_spec.config import FLAGS, Flag  # noqa: E402
from sgl_spec.launch_server import check_krul  # noqa: E402

_WORDS = st.text(alphabet=string.ascii_letters, min_size=1, max_size=8)
_CHECKED = [f for f in FLAGS if f.kind != "path"]  # paths: files, tested above


def _bool_forms(flag: Flag) -> list[str]:
    return [flag.name] if flag.name == "--spec-disable" else [flag.name, f"--no-{flag.name[2:]}"]


def _pass(flag: Flag, value: str, eq: bool) -> list[str]:
    return [f"{flag.name}={value}"] if eq else [flag.name, value]


def _valid(flag: Flag):
    """(argv, the config value it sets) for one flag."""
    if flag.kind == "bool":
        return st.sampled_from(_bool_forms(flag)).map(lambda a: ([a], not a.startswith("--no-")))
    if flag.kind == "choice":
        values = st.sampled_from(flag.choices)
    elif flag.kind == "int":
        values = st.integers(flag.lo, flag.lo + 100_000)
    else:
        values = st.floats(0.0, 1.0, exclude_min=True)
    return st.tuples(values, st.booleans()).map(lambda p: (_pass(flag, str(p[0]), p[1]), p[0]))


def _invalid(flag: Flag):
    """(argv, what the error must name) for one flag: out of range or the wrong type."""
    if flag.kind == "bool":
        return st.tuples(st.sampled_from(_bool_forms(flag)), _WORDS).map(
            lambda p: ([f"{p[0]}={p[1]}"], [p[0], "takes no value", flag.name]))
    if flag.kind == "choice":
        values, needles = _WORDS.filter(lambda w: w not in flag.choices), list(flag.choices)
    elif flag.kind == "int":
        values = st.one_of(st.integers(-10**9, flag.lo - 1).map(str),
                           st.floats(0.5, 1e6).filter(lambda x: x != int(x)).map(str),
                           _WORDS.filter(lambda w: w.lower() not in ("nan", "inf")))
        needles = [f"valid range: integers >= {flag.lo}"]
    else:
        values = st.one_of(st.floats(-1e6, 0.0).map(str),
                           st.floats(1.0, 1e6, exclude_min=True).map(str),
                           st.sampled_from(["nan", "inf", "-inf"]), _WORDS)
        needles = ["valid range: a number in (0, 1]"]
    return st.tuples(values, st.booleans()).map(
        lambda p: (_pass(flag, p[0], p[1]), [flag.name, *needles]))


@st.composite
def _valid_flags(draw, exclude: Flag | None = None):
    """A few distinct valid ``--spec-*`` flags with the config values they set."""
    flags = draw(st.lists(st.sampled_from([f for f in _CHECKED if f != exclude]),
                          max_size=5, unique=True))
    return [(f, *draw(_valid(f))) for f in flags]


def _split(argv: list[str]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return split_argv(argv), err.getvalue()
        except SystemExit as exc:
            return exc.code, err.getvalue()


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_every_bad_flag_value_exits_2_naming_the_flag_and_its_valid_values(data):
    flag = data.draw(st.sampled_from(_CHECKED))
    bad, needles = data.draw(_invalid(flag))
    groups = [args for _, args, _ in data.draw(_valid_flags(exclude=flag))]
    groups.insert(data.draw(st.integers(0, len(groups))), bad)
    argv = ["--model-path", "/m", *(a for g in groups for a in g)]
    code, err = _split(argv)
    assert code == 2, (argv, code)
    for needle in needles:
        assert needle in err, (argv, needle, err)


@settings(max_examples=250, deadline=None)
@given(chosen=_valid_flags(), hicache=st.booleans(),
       storage=st.sampled_from([None, "file", "mooncake"]), page=st.sampled_from([None, "1", "16"]))
def test_valid_flags_fill_the_config_and_contradictions_name_both_sides(chosen, hicache, storage,
                                                                        page):
    argv = [a for _, args, _ in chosen for a in args]
    sglang = ["--enable-hierarchical-cache"] * hicache
    sglang += ["--hicache-storage-backend", storage] * (storage is not None)
    sglang += ["--page-size", page] * (page is not None)
    got, err = _split(argv + sglang)
    given_ = {f.name: value for f, _, value in chosen}
    if given_.get("--spec-prompt-seed") and given_.get("--spec-mode", "exact") != "loopserve":
        assert got == 2 and "--spec-prompt-seed is read only with --spec-mode loopserve" in err
        return
    if given_.get("--spec-prefetch", "auto") != "auto" and \
            given_.get("--spec-mode", "exact") != "specontext":
        assert got == 2 and "--spec-prefetch is read only with --spec-mode specontext" in err
        return
    if given_.get("--spec-sparse-kv-cache") == "drop" and \
            given_.get("--spec-mode", "exact") == "exact":
        assert got == 2 and "--spec-sparse-kv-cache drop needs a sparse --spec-mode" in err
        return
    if given_.get("--spec-dense-layers") and given_.get("--spec-mode", "exact") == "exact":
        assert got == 2 and "--spec-dense-layers is read only with a sparse --spec-mode" in err
        return
    lookahead = spec_config.DecodeConfig.lookahead
    if given_.get("--spec-lookahead", lookahead) != lookahead and \
            given_.get("--spec-mode", "exact") != "loopserve":
        assert got == 2 and "--spec-lookahead is read only with --spec-mode loopserve" in err
        return
    offload = given_.get("--spec-offload", "off")
    kv_bytes = given_.get("--spec-offload-kv-bytes", 0)
    if offload != "off" and given_.get("--spec-mode", "exact") != "specontext":
        assert got == 2 and "needs --spec-mode specontext" in err
        return
    if offload == "auto" and not kv_bytes:
        assert got == 2 and "needs --spec-offload-kv-bytes" in err
        return
    if offload == "off" and kv_bytes:
        assert got == 2 and "--spec-offload-kv-bytes is read only with" in err
        return
    if given_.get("--spec-krul-strategy", "conversation") != "conversation" and \
            not given_.get("--spec-krul"):
        assert got == 2 and "--spec-krul-strategy is read only with --spec-krul" in err
        return
    if given_.get("--spec-krul-restore", "auto") != "auto" and \
            not given_.get("--spec-krul"):
        assert got == 2 and "--spec-krul-restore is read only with --spec-krul" in err
        return
    rounds = given_.get("--spec-rounds", False)
    round_defaults = spec_config.RoundConfig()
    if not rounds and any(given_.get(f.name, getattr(round_defaults, f.field))
                          != getattr(round_defaults, f.field)
                          for f in spec_config.FLAGS if f.section == "rounds"):
        assert got == 2 and "is read only with --spec-rounds" in err
        return
    if given_.get("--spec-disable") and given_.get("--spec-krul"):
        assert got == 2 and "drop --spec-disable, or drop --spec-krul" in err
        return
    if rounds and (given_.get("--spec-disable") or given_.get("--spec-krul-profile")
                   or given_.get("--spec-mode", "exact") != "exact"):
        assert got == 2 and "--spec-rounds does not compose with" in err
        return
    if given_.get("--spec-tree-core") == "compiled" and (
            rounds or given_.get("--spec-cache-eviction") == "turn" or given_.get("--spec-krul") or (
                given_.get("--spec-prefill") == "loopserve"
                and given_.get("--spec-prefill-reuse", True))):
        assert got == 2 and "--spec-tree-core compiled:" in err and "valid: auto or tagged" in err
        return
    cfg, rest = got
    assert rest == sglang
    for flag, _, value in chosen:
        part = getattr(cfg, flag.section) if flag.section else cfg
        assert getattr(part, flag.field) == value, (flag.name, value)
    if not cfg.krul.enable:
        check_krul(cfg, rest)  # nothing to check without Krul
        return
    problem = (None if hicache else "--enable-hierarchical-cache") or (
        "--hicache-storage-backend" if storage == "mooncake" else None) or (
        "--page-size 1" if storage == "file" and page == "16" else None)
    if problem is None:
        check_krul(cfg, rest)
    else:
        with pytest.raises(ValueError, match="valid: ") as exc:
            check_krul(cfg, rest)
        assert problem in str(exc.value) and "--spec-krul" in str(exc.value)


# ---- round mode (issue 44) -------------------------------------------------------------
def test_round_mode_refuses_what_it_cannot_serve_naming_the_flag(capsys):
    from sgl_spec.launch_server import check_rounds

    cfg, _ = split_argv(["--spec-rounds"])
    check_rounds(cfg, ["--max-total-tokens", "4096"], cpu=True)  # fine
    check_rounds(cfg, ["--enable-hierarchical-cache"], cpu=True)  # composes
    for argv, needle in ((["--disable-radix-cache"], "--disable-radix-cache"),
                         (["--page-size", "16"], "--page-size 1")):
        with pytest.raises(ValueError, match=needle):
            check_rounds(cfg, argv, cpu=True)
    with pytest.raises(ValueError, match="CPU hosts only"):
        check_rounds(cfg, [], cpu=False)
    off, _ = split_argv([])
    check_rounds(off, ["--enable-hierarchical-cache"], cpu=False)  # not asked: nothing
    for bad in (["--spec-round-strategy", "best"], ["--spec-round-min-rounds", "0"],
                ["--spec-round-strategy", "fixed"]):  # the last: without --spec-rounds
        with pytest.raises(SystemExit) as exc:
            split_argv(bad if bad[-1] == "fixed" else ["--spec-rounds", *bad])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'best'" in err and "'adaptive'" in err and "is read only with --spec-rounds" in err
    with pytest.raises(SystemExit):
        split_argv(["--spec-rounds", "--spec-mode", "loopserve"])
    assert "--spec-rounds does not compose with --spec-mode loopserve" in capsys.readouterr().err
    cfg, _ = split_argv(["--spec-rounds", "--spec-prefill", "loopserve"])  # below L_w
    assert cfg.rounds.enable and cfg.prefill.mode == "loopserve"
    cfg, _ = split_argv(["--spec-rounds", "--spec-krul"])  # Krul composes; its recompute not
    assert cfg.rounds.enable and cfg.krul.enable
    with pytest.raises(ValueError, match="does not compose with --spec-krul-profile"):
        spec_config.SpecConfig(rounds=spec_config.RoundConfig(enable=True),
                               krul=spec_config.KrulConfig(enable=True, profile_path="p.json"))


def test_round_mode_reads_the_calibrated_watershed_or_serves_exact_saying_why(tmp_path,
                                                                               monkeypatch):
    import json

    from sgl_spec import jsonfile
    from sgl_spec.launch_server import with_watershed
    from sgl_spec.rounds import watershed

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    argv = ["--model-path", str(model)]
    measured = []

    def fake_prepare(path, *a, **k):  # the calibration: once per model, into the cache dir
        measured.append(path)
        out = str(tmp_path / "ws.json")
        jsonfile.write_atomic(out, {"format": watershed._FORMAT, "layers": 30,
                                    "curve": [0.0] * 29,
                                    "watershed": found, "recall": recall,
                                    "strategy_recall": by_strategy})
        return out

    monkeypatch.setattr(watershed, "prepare", fake_prepare)
    cfg, _ = split_argv(["--spec-rounds", "--spec-round-strategy", "fixed"])
    found, recall, by_strategy = 12, [0.9] * 30, {}
    got = with_watershed(cfg, argv).rounds
    assert (got.enable, got.watershed, got.strategy) == (True, 12, "fixed")
    assert "L_w 12 of 30 layers" in got.decision and measured == [str(model)]
    found = None  # a calibration that finds no significant minimum
    got = with_watershed(cfg, argv).rounds
    assert not got.enable and "no significant minimum" in got.decision \
        and "serving exact" in got.decision
    given, _ = split_argv(["--spec-rounds", "--spec-round-watershed", "40"])
    got = with_watershed(given, argv).rounds  # outside the model's layers: exact, said
    assert not got.enable and "L_w 40 of 30 layers" in got.decision
    assert len(measured) == 2  # a given watershed measures nothing
    found, recall = 12, [0.5] * 30  # a selection at L_w that misses the asked round
    recall[9], recall[11], recall[29] = 0.9, 0.6, 1.0  # the last layer cannot be L_w
    got = with_watershed(cfg, argv).rounds
    assert not got.enable and "serving exact" in got.decision
    assert "60% of the calibration's questions" in got.decision and "layer 10: 90%" in got.decision
    given, _ = split_argv(["--spec-rounds", "--spec-round-watershed", "12"])
    assert with_watershed(given, argv).rounds.enable  # a given watershed is used as given
    # per strategy: fixed keeps the asked round at L_w for 70%, topk for 90%
    recall = [0.9] * 30
    by_strategy = {"peak": {"topk": [0.9] * 30, "fixed": [0.7] * 12 + [0.8] * 18}}
    got = with_watershed(cfg, argv).rounds
    assert not got.enable and "(fixed) at L_w 12 keeps the asked round for 70%" in got.decision
    assert "highest at layer 13: 80%" in got.decision
    topk, _ = split_argv(["--spec-rounds"])
    assert with_watershed(topk, argv).rounds.enable


# ---- SpeContext's layer offload (issue 45) -------------------------------------------------
def test_offload_refuses_what_it_cannot_serve_naming_the_flag(capsys):
    from sgl_spec.launch_server import check_offload

    spec = ["--spec-mode", "specontext"]
    cfg, _ = split_argv([*spec, "--spec-offload", "auto", "--spec-offload-kv-bytes", "64000000"])
    assert cfg.decode.offload == "auto" and cfg.decode.offload_kv_bytes == 64_000_000
    check_offload(cfg, ["--max-total-tokens", "40000"], cpu=True)  # fine
    with pytest.raises(ValueError, match="--enable-hierarchical-cache is not supported"):
        check_offload(cfg, ["--enable-hierarchical-cache"], cpu=True)
    with pytest.raises(ValueError, match="CPU hosts only"):
        check_offload(cfg, [], cpu=False)
    check_offload(split_argv(spec)[0], ["--enable-hierarchical-cache"], cpu=False)  # off
    for bad, needle in (
            (["--spec-offload", "on"], "choose from 'off', 'auto'"),
            (["--spec-offload", "auto"], "needs --spec-mode specontext"),
            ([*spec, "--spec-offload", "auto"], "needs --spec-offload-kv-bytes"),
            ([*spec, "--spec-offload-kv-bytes", "1000"], "read only with --spec-offload auto"),
            ([*spec, "--spec-offload", "auto", "--spec-offload-kv-bytes", "-1"],
             "--spec-offload-kv-bytes")):
        with pytest.raises(SystemExit) as exc:
            split_argv(bad)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


def test_the_head_is_prepared_before_the_decode_profile_that_runs_it(tmp_path, monkeypatch):
    """--spec-mode specontext without --spec-draft-path on a host with no decode profile
    yet: the profile is measured with the head prepared for the model, not an empty path
    (which failed the start with "--spec-draft-path '' is not a directory")."""
    import json

    from sgl_spec import launch_server, train_head
    from sgl_spec.attention import step_cost

    model, head = tmp_path / "model", tmp_path / "head"
    model.mkdir(), head.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setattr(train_head, "prepare", lambda path, *a, **k: str(head))
    seen = []

    def prepare_profile(path, d, kv, device="cpu", cache_dir=None):
        seen.append(d.draft_path)
        raise ValueError("measured")

    monkeypatch.setattr(step_cost, "prepare_profile", prepare_profile)
    monkeypatch.setattr(step_cost, "profile_path", lambda *a, **k: str(tmp_path / "none.json"))
    cfg, rest = split_argv(["--spec-mode", "specontext", "--model-path", str(model)])
    with pytest.raises(ValueError, match="measured"):
        launch_server.resolve(cfg, rest, cpu=True)
    assert seen == [str(head)]
