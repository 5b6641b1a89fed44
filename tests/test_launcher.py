"""sgl_spec.launch_server argument handling and SpecConfig (no server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_spec.config import SpecConfig
from sgl_spec.launch_server import CPU_MAX_TOTAL_TOKENS, split_argv, sglang_argv


def test_spec_flags_are_split_from_sglang_flags():
    cfg, rest = split_argv(["--model-path", "/m", "--spec-mode", "exact", "--tp-size", "1"])
    assert cfg == SpecConfig(mode="exact", disable=False)
    assert rest == ["--model-path", "/m", "--tp-size", "1"]
    cfg, rest = split_argv(["--spec-disable", "--port=1"])
    assert cfg.disable and rest == ["--port=1"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--spec-mode", "bogus"], "--spec-mode"),
        (["--spec-bogus", "1"], "--spec-bogus"),
        (["--spec-mode=nope"], "exact"),
    ],
    ids=["bad-mode", "unknown-flag", "equals-form"],
)
def test_bad_spec_flags_exit_2_naming_flag_and_choices(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        split_argv(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "exact" in err or "--spec-mode" in err


def test_cpu_defaults_are_added_only_when_not_given():
    cfg = SpecConfig()
    out = sglang_argv(cfg, ["--model-path", "/m"], cpu=True)
    assert out == [
        "--model-path", "/m", "--device", "cpu",
        "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS),
        "--attention-backend", "sgl_spec", "--radix-cache-backend", "sgl_spec",
    ]
    given = ["--model=/m", "--device", "cpu", "--max-total-tokens=100",
             "--attention-backend", "triton", "--disable-radix-cache"]
    assert sglang_argv(cfg, given, cpu=True) == given


def test_spec_disable_serves_stock_components():
    out = sglang_argv(SpecConfig(disable=True), ["--model-path", "/m"], cpu=True)
    assert "sgl_spec" not in out
    assert out[out.index("--attention-backend") + 1] == "torch_native"
    out = sglang_argv(SpecConfig(disable=True), ["--model-path", "/m"], cpu=False)
    assert "--attention-backend" not in out and "--device" not in out


def test_config_json_round_trip_and_validation():
    cfg = SpecConfig(mode="exact", disable=True)
    assert SpecConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="valid keys"):
        SpecConfig.from_json('{"mode": "exact", "budget": 3}')
    with pytest.raises(ValueError, match="valid values: exact"):
        SpecConfig(mode="sparse")


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_spec.launch_server", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_invalid_flag_value_exits_nonzero_with_valid_values():
    proc = _launch("--spec-mode", "bogus")
    assert proc.returncode == 2
    assert "--spec-mode" in proc.stderr and "'exact'" in proc.stderr


def test_help_lists_sglang_and_spec_flags():
    proc = _launch("--help")
    assert proc.returncode == 0
    for flag in ("--spec-mode", "--spec-disable", "--model-path", "--tp-size"):
        assert flag in proc.stdout
    assert "Default: exact" in proc.stdout
