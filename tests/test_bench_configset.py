"""The evaluation harness' configuration files (TOML rows, ``[plan]``, checks), run
plans and CLI, without a server."""

from __future__ import annotations

import pytest

from sgl_spec.bench import configset, plan, runner
from _tokenizers import WordTokenizer
from sgl_spec.bench.__main__ import build_parser

VALID = """
name = "trio"
[[config]]
name = "stock"
launcher = "stock"
[[config]]
name = "sgl_spec exact"
launcher = "sgl_spec"
flags = ["--spec-mode", "exact"]
reference = true
"""


def test_builtin_baseline_has_the_two_rows():
    sets = configset.load()
    assert sets.name == "baseline"
    assert [c.name for c in sets.configs] == ["stock", "sgl_spec exact"]
    assert sets.reference.name == "sgl_spec exact"
    stock, exact = sets.configs
    assert stock.module == "sglang.launch_server"
    assert exact.module == "sgl_spec.launch_server"
    from sgl_spec import cpu

    # stock in the dtype sgl_spec's launcher picks for this CPU (like for like)
    dtype = ["--dtype", cpu.default_dtype()] if cpu.default_dtype() else []
    assert stock.server_args("/m") == ["--model-path", "/m", "--max-total-tokens", "32768",
                                       "--enable-cache-report", "--enable-metrics",
                                       "--device", "cpu", "--attention-backend",
                                       "torch_native", *dtype]
    assert exact.server_args("/m")[-2:] == ["--spec-mode", "exact"]
    assert exact.slug == "sgl_spec-exact"
    assert sets.baseline.name == "stock"
    # The stock-vs-exact comparison: the QA run, the speed chats and bench_serving.
    assert sets.plan == plan.RunPlan("default", ("long-division", "animals"), 1024,
                                     ("doc_chat", "growing"), "default")
    assert sets.within_points == () and sets.followup_speedup == (("sgl_spec exact", 5),)


def test_builtin_sparse_decode_set():
    sets = configset.load(f"{configset.CONFIG_DIR}/sparse-decode.toml")
    assert sets.name == "sparse-decode" and sets.reference.name == "sgl_spec exact"
    budgets = ("256", "512", "1024")
    assert [c.name for c in sets.configs] == ["sgl_spec exact", *(
        f"{mode} B={b}" for mode in ("streaming", "snapkv", "loopserve") for b in budgets)]
    by_name = {c.name: c for c in sets.configs}
    for b in budgets:
        assert by_name[f"loopserve B={b}"].flags == ("--spec-mode", "loopserve",
                                                     "--spec-budget", b)
        assert by_name[f"snapkv B={b}"].flags == ("--spec-mode", "snapkv", "--spec-budget", b)
        # streaming attends sink + window: the window holds B + the others' 64 recent.
        assert by_name[f"streaming B={b}"].flags == (
            "--spec-mode", "streaming", "--spec-window", str(int(b) + 64), "--spec-budget", "1")
    assert sets.plan == plan.RunPlan("default", ("doc-facts",), 512)
    assert dict(sets.within_points) == {"loopserve B=1024": 3}
    assert plan.choose(sets.plan, quick=True) == plan.RunPlan.preset(True)
    assert plan.choose(sets.plan, quick=False, concurrency=2).concurrency == 2
    assert plan.choose(None, quick=False) == plan.RunPlan.preset(False)


def test_a_later_row_is_only_data():
    text = VALID + '[[config]]\nname = "loopserve B=512"\nlauncher = "sgl_spec"\n' \
                   'flags = ["--spec-mode", "loopserve"]\n'
    sets = configset.loads(text)
    assert [c.name for c in sets.configs][-1] == "loopserve B=512"
    assert sets.configs[-1].slug == "loopserve-B-512"


@pytest.mark.parametrize("text, match", [
    (VALID.replace('name = "trio"', 'name = "trio"\ncolour = 1'),
     r"unknown key\(s\) \['colour'\]; valid keys: \['name', 'description', 'config', "
     r"'plan', 'checks'\]"),
    (VALID.replace('launcher = "stock"', 'launcher = "stock"\nflag = []'),
     r"#1: unknown key\(s\) \['flag'\]; valid keys: \['name', 'launcher', 'flags'"),
    (VALID.replace('name = "stock"\n', ""), r"#1: missing 'name'; valid keys: \['name'"),
    (VALID.replace('name = "trio"\n', ""), r"missing top-level 'name'"),
    (VALID.replace('"sgl_spec exact"', '"stock"'), r"duplicate names \['stock'\]"),
    (VALID.replace("reference = true", ""), r"exactly one row .*found 0"),
    (VALID.replace('launcher = "stock"', 'launcher = "stock"\nreference = true'),
     r"exactly one row .*found 2: \['stock', 'sgl_spec exact'\]"),
    (VALID.replace('launcher = "stock"', 'launcher = "vllm"'),
     r"unknown launcher 'vllm'; valid: \['sgl_spec', 'stock'\]"),
    (VALID.replace('["--spec-mode", "exact"]', '["--port", "1"]'), r"set by the harness"),
    ('name = "empty"', r"no \[\[config\]\] rows"),
    ("name = [", r"not valid TOML"),
], ids=["unknown-set-key", "unknown-row-key", "row-without-name", "set-without-name",
        "duplicate-names", "no-reference", "two-references", "unknown-launcher",
        "owned-flag", "no-rows", "bad-toml"])
def test_invalid_config_files(text, match):
    with pytest.raises(ValueError, match=match):
        configset.loads(text, "x.toml")


def test_plan_and_checks_tables():
    sets = configset.loads(VALID + '[plan]\nlonggen = "long-context"\n'
                           'longgen_max_tokens = 384\n'
                           '[checks.within_points]\n"stock" = 2.5\n')
    assert sets.plan == plan.RunPlan("default", ("doc-facts", "doc-outline"), 384)
    assert sets.within_points == (("stock", 2.5),)
    only_dataset = configset.loads(VALID + '[plan]\ndataset = "quick"\n').plan
    assert only_dataset == plan.RunPlan("quick", ("long-division", "animals"), 1024)
    assert only_dataset.chats == () and only_dataset.serving is None
    speed = configset.loads(VALID + '[plan]\nchats = ["doc_chat"]\nserving = true\n'
                            '[checks.followup_speedup]\n"sgl_spec exact" = 4.5\n')
    assert (speed.plan.chats, speed.plan.serving) == (("doc_chat",), "default")
    assert speed.plan.serving_config.num_prompts == 16
    assert speed.followup_speedup == (("sgl_spec exact", 4.5),)
    assert configset.loads(VALID + '[plan]\nserving = "quick"\n').plan.serving == "quick"
    assert configset.loads(VALID + '[plan]\nserving = false\n').plan.serving is None


@pytest.mark.parametrize("extra, match", [
    ('[plan]\ndatasets = "quick"\n',
     r"x.toml: \[plan\]: unknown key\(s\) \['datasets'\]; valid keys: \['dataset', "
     r"'longgen', 'longgen_max_tokens', 'chats', 'serving'\]"),
    ('[plan]\ndataset = "huge"\n', r"\[plan\]: unknown preset 'huge'; valid: \['default'"),
    ('[plan]\nlonggen = ["doc-fact"]\n',
     r"\[plan\]: unknown long-generation prompt\(s\) \['doc-fact'\]; valid: .*'doc-facts'"),
    ('[plan]\nlonggen = "everything"\n',
     r"longgen 'everything' is not a preset; valid presets: \['default', 'long-context'"),
    ('[plan]\nlonggen = [1]\n', r"longgen must be a list of prompt names"),
    ('[plan]\nlonggen_max_tokens = 0\n', r"longgen_max_tokens must be a positive integer"),
    ('[plan]\nlonggen_max_tokens = "512"\n', r"longgen_max_tokens must be a positive"),
    ('plan = 3\n', r"\[plan\] must be a table"),
    ('[checks]\nwithin = 3\n',
     r"\[checks\]: unknown key\(s\) \['within'\]; valid keys: \['within_points', "
     r"'followup_speedup'\]"),
    ('[checks.within_points]\n"loopserve" = 3\n',
     r"names 'loopserve', not a row other than the reference; valid: \['stock'\]"),
    ('[checks.within_points]\n"sgl_spec exact" = 3\n', r"not a row other than the reference"),
    ('[checks.within_points]\n"stock" = -1\n', r"'stock' must be a number of points in \[0, 100\]"),
    ('[checks.within_points]\n"stock" = "3"\n', r"must be a number of points"),
    ('[plan]\nchats = ["doc"]\n', r"\[plan\]: unknown chat 'doc'; valid: \['doc_chat'"),
    ('[plan]\nchats = "doc_chat"\n', r"chats must be a list of chat names"),
    ('[plan]\nchats = ["growing", "growing"]\n', r"chats must be distinct"),
    ('[plan]\nserving = "huge"\n',
     r"unknown serving preset 'huge'; valid: \['default', 'quick'\]"),
    ('[plan]\nserving = 16\n', r"serving must be true, false or a preset name"),
    ('[checks.followup_speedup]\n"stock" = 5\n',
     r"\[checks.followup_speedup\] names 'stock', not a row other than the first row; "
     r"valid: \['sgl_spec exact'\]"),
    ('[checks.followup_speedup]\n"sgl_spec exact" = 0\n', r"must be a factor > 0, got 0"),
], ids=["unknown-plan-key", "unknown-dataset", "unknown-prompt", "unknown-longgen-preset",
        "longgen-not-names", "zero-budget", "string-budget", "plan-not-table",
        "unknown-check-key", "check-unknown-row", "check-reference-row", "negative-points",
        "string-points", "unknown-chat", "chats-not-list", "duplicate-chat",
        "unknown-serving", "serving-number", "speedup-of-baseline", "zero-speedup"])
def test_invalid_plan_and_checks(extra, match):
    # Top-level keys must come before the [[config]] tables.
    text = extra + VALID if extra.startswith("plan =") else VALID + extra
    with pytest.raises(ValueError, match=match):
        configset.loads(text, "x.toml")


def test_run_plan_renders_long_context_prompts():
    p = plan.RunPlan("quick", ("animals", "doc-facts"), 512)
    with pytest.raises(ValueError, match="'doc-facts' holds a 3000-token document"):
        p.longgen_items()
    items = p.longgen_items(WordTokenizer())
    assert [(i.conversation.name, i.max_tokens, i.ignore_eos) for i in items] == [
        ("longgen-animals", 512, False), ("longgen-doc-facts", 512, True)]
    assert items == p.longgen_items(WordTokenizer())  # a pure function of the tokenizer


def test_cli_help_and_bad_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    assert "--concurrency" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text(VALID.replace("reference = true", ""))
    from sgl_spec.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--configs", str(bad), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert "exactly one row" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:1", "--resume", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--resume" in capsys.readouterr().err


def test_server_flags_reach_every_row(tmp_path, capsys):
    sets = configset.load(configset.DEFAULT_PATH)
    fp32 = sets.with_flags(["--dtype", "float32"])
    assert [c.flags[-2:] for c in fp32.configs] == [("--dtype", "float32")] * len(sets.configs)
    assert [c.flags[:-2] for c in fp32.configs] == [c.flags for c in sets.configs]
    assert sets.with_flags([]) is sets
    with pytest.raises(ValueError, match="set by the harness"):
        sets.with_flags(["--port", "1"])
    from sgl_spec.bench.__main__ import main

    for argv, msg in ((["--server-flags=--port 1"], "set by the harness"),
                      (["--url", "http://127.0.0.1:1", "--server-flags", "--dtype float32"],
                       "already running")):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--out", str(tmp_path / "o")])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_run_plan_presets_and_validation():
    quick = runner.RunPlan.preset(True)
    assert quick.dataset == "quick" and quick.longgen_max_tokens == 256
    assert [i.max_tokens for i in quick.longgen_items()] == [256]
    # --quick plays everything, small: the headline doc chat, growing context, serving.
    assert quick.chats == ("doc_chat-quick", "growing-quick") and quick.serving == "quick"
    items = quick.chat_items(WordTokenizer())
    assert {n: [(i.conversation.name, len(i.conversation.user_turns), i.max_tokens)
                for i in its] for n, its in items.items()} == {
        "doc_chat-quick": [("doc_chat-quick-0", 3, 32)],
        "growing-quick": [("growing-quick-0", 3, 32)]}
    default = runner.RunPlan.preset(False)
    assert default.chats == () and default.serving_config is None
    with pytest.raises(ValueError, match="valid: .*animals"):
        runner.RunPlan("quick", ("nope",), 256)
    with pytest.raises(ValueError, match="concurrency"):
        runner.RunPlan("quick", (), 256, concurrency=0)




def test_conversations_filter_names_the_valid_ones(model_path, tmp_path, capsys):
    from sgl_spec.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--model-path", model_path, "--url", "http://127.0.0.1:1",
              "--conversations", "qa-0-0", "nope", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--conversations: unknown nope; valid: qa-" in err and "qa-0-0," not in err


def test_seed_draws_other_conversations_of_the_preset(model_path, tmp_path, capsys):
    from sgl_spec.bench.__main__ import main

    base = ["--quick", "--model-path", model_path, "--url", "http://127.0.0.1:1",
            "--out", str(tmp_path / "o")]
    # the name filter lists the drawn dataset's names: seed 1 names its conversations qa-1-*
    with pytest.raises(SystemExit) as exc:
        main([*base, "--seed", "1", "--conversations", "qa-0-0"])
    assert exc.value.code == 2
    assert "unknown qa-0-0; valid: qa-1-0 .. qa-1-2 (3 conversations)" in capsys.readouterr().err
    for argv, msg in ((["--seed", "1", "--dataset", str(tmp_path / "d.jsonl")], "drop one"),
                      (["--seed", "-1"], "--seed must be >= 0")):
        with pytest.raises(SystemExit) as exc:
            main([*base, *argv])
        assert exc.value.code == 2 and msg in capsys.readouterr().err
