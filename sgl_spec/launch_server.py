"""``python -m sgl_spec.launch_server``: sglang's launch_server plus ``--spec-*`` flags.

Every ``sglang.launch_server`` flag is accepted unchanged. sgl_spec's own flags are
stripped and validated here, then handed to the scheduler processes through the
environment. Defaults that differ from stock sglang (only where not given):

* ``--model-path``: the default model, prepared once (see ``sgl_spec.prepare_model``);
* ``--attention-backend sgl_spec`` and ``--radix-cache-backend sgl_spec``
  (with ``--spec-disable``: stock components, torch_native attention on CPU);
* on CPU hosts: ``--device cpu`` and ``--max-total-tokens 32768`` (stock sglang
  sizes a 15 GB KV pool on these machines); ``--dtype float32`` where the CPU has no
  native bfloat16 (``sgl_spec.cpu``); with more ranks (dp x tp x pp) than NUMA
  nodes, ``SGLANG_CPU_OMP_THREADS_BIND`` splitting the cores between them (stock
  sglang asserts otherwise; see ``sgl_spec.integration.cpu.threads``);
* ``--spec-krul``: the model's attention statistics, measured once into the cache dir
  (``python -m sgl_spec.calibrate strategy``);
* ``--spec-rounds``: the model's watershed, measured once into the cache dir
  (``python -m sgl_spec.calibrate watershed``);
* ``--spec-mode specontext`` without ``--spec-draft-path``: the retrieval head trained
  for the model (``sgl_spec.train_head``), once, into the cache dir; on GPU hosts
  ``--disable-cuda-graph`` (the head runs in Python before each step).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sgl_spec import BACKEND_NAME as NAME
from sgl_spec import config as spec_config
from sgl_spec import cpu as host_cpu
from sgl_spec import envs

logger = logging.getLogger("sgl_spec.launch_server")  # __main__ under python -m

PROG = "python -m sgl_spec.launch_server"
CPU_MAX_TOTAL_TOKENS = 32768


def _given(argv: list[str], *options: str) -> bool:
    return any(a in options or a.split("=", 1)[0] in options for a in argv)


_BOOL_FLAGS = {f.name: f for f in spec_config.FLAGS if f.kind == "bool"}


_NUMBER_FLAGS = {f.name for f in spec_config.FLAGS if f.kind in ("int", "fraction")}


def _join_numbers(argv: list[str]) -> list[str]:
    """``--spec-budget -1e3`` as ``--spec-budget=-1e3``: argparse takes a value like
    ``-1e3`` for an option and would not reach the check that names the valid range."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in _NUMBER_FLAGS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{a}={argv[i + 1]}")
                i += 2
                continue
        out.append(a)
        i += 1
    return out


def _spec_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    spec_config.add_cli_args(parser)
    return parser


def split_argv(argv: list[str]) -> tuple[spec_config.SpecConfig, list[str]]:
    """Separate ``--spec-*`` flags from sglang's; exits 2 on a bad ``--spec-*`` flag."""
    parser = _spec_parser()
    for a in argv:  # argparse's "ignored explicit argument" would not name the forms
        name, eq, val = a.partition("=")
        flag = _BOOL_FLAGS.get(name.replace("--no-spec-", "--spec-", 1))
        if eq and flag is not None:
            forms = (flag.name if flag.name == "--spec-disable"
                     else f"{flag.name} or --no-{flag.name[2:]}")
            parser.error(f"{name} takes no value (got {val!r}); valid: {forms}")
    spec_args, rest = parser.parse_known_args(_join_numbers(argv))
    unknown = [a.split("=", 1)[0] for a in rest if a.startswith("--spec-")]
    if unknown:
        valid = sorted(
            s for a in parser._actions for s in a.option_strings if s.startswith("--spec-")
        )
        parser.error(
            f"unrecognized sgl_spec flag(s): {', '.join(unknown)}; valid: {', '.join(valid)}"
        )
    try:
        cfg = spec_config.from_cli_args(spec_args)
    except ValueError as exc:
        parser.error(str(exc))
    if cfg.disable and cfg.decode.mode != "exact":
        logger.warning("--spec-mode %s has no effect with --spec-disable (stock "
                       "components decode exactly)", cfg.decode.mode)
    if cfg.disable and cfg.prefill.mode != "exact":
        logger.warning("--spec-prefill %s has no effect with --spec-disable (stock "
                       "components prefill exactly)", cfg.prefill.mode)
    if cfg.decode.draft_path:
        from sgl_spec.head.config import HeadConfig

        try:
            HeadConfig.load(cfg.decode.draft_path)
        except (OSError, ValueError) as exc:
            parser.error(f"--spec-draft-path {cfg.decode.draft_path!r}: {exc}")
    if cfg.krul.stats_path:
        from sgl_spec.krul.calibrate import load

        try:
            load(cfg.krul.stats_path)
        except ValueError as exc:
            parser.error(f"--spec-krul-stats: {exc}")
    if cfg.decode.profile_path not in spec_config.PROFILE_CHOICES:
        from sgl_spec.attention.step_cost import read_profile

        try:
            read_profile(cfg.decode.profile_path)
        except (OSError, ValueError) as exc:
            parser.error(f"--spec-decode-profile: {exc}")
    if cfg.krul.profile_path:
        from sgl_spec.krul.restore_cost import read_profile

        try:
            read_profile(cfg.krul.profile_path)
        except (OSError, ValueError) as exc:
            parser.error(f"--spec-krul-profile: {exc}")
    return cfg, rest


def _value(argv: list[str], *options: str) -> str | None:
    """The value of the last of ``options`` in ``argv`` (``--opt v`` or ``--opt=v``)."""
    found = None
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name in options:
            found = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def with_head(cfg: spec_config.SpecConfig, argv: list[str]) -> spec_config.SpecConfig:
    """``cfg`` with the retrieval head's path filled in where specontext needs one:
    the head trained for the served model, prepared once (progress bar)."""
    if cfg.disable or not cfg.decode.retrieval_head or cfg.decode.draft_path:
        return cfg
    import dataclasses

    from sgl_spec.train_head import prepare

    model = _value(argv, "--model-path", "--model")
    logger.info("--spec-mode specontext without --spec-draft-path: the retrieval head "
                "trained for %s (trained once, then reused)", model)
    return dataclasses.replace(
        cfg, decode=dataclasses.replace(cfg.decode, draft_path=prepare(model)))


def check_krul(cfg: spec_config.SpecConfig, argv: list[str]) -> None:
    """ValueError where ``--spec-krul`` cannot work with sglang's flags."""
    if not cfg.krul.enable:
        return
    if not _given(argv, "--enable-hierarchical-cache"):
        raise ValueError("--spec-krul compresses what HiCache keeps in host memory; valid: "
                         "add --enable-hierarchical-cache, or drop --spec-krul")
    backend = _value(argv, "--hicache-storage-backend")
    if backend not in (None, "", "none", "file"):
        raise ValueError(f"--spec-krul with --hicache-storage-backend {backend} is not "
                         "supported (zero-copy backends cannot address compressed rows); "
                         "valid: file, or no --hicache-storage-backend")
    if backend == "file" and (_value(argv, "--page-size") or "1") != "1":
        raise ValueError("--spec-krul with --hicache-storage-backend file needs --page-size 1 "
                         "(its host slots are not page-contiguous); valid: --page-size 1")
    if _given(argv, "--disable-radix-cache"):
        raise ValueError("--spec-krul needs the radix cache; valid: drop "
                         "--disable-radix-cache, or drop --spec-krul")


def check_krul_profile(cfg: spec_config.SpecConfig, argv: list[str]) -> None:
    """ValueError where ``--spec-krul-profile`` was measured for a model with another
    number of layers than the served one (read from its config.json, where local)."""
    config = _model_config(argv)
    if not cfg.krul.profile_path or config is None or "num_hidden_layers" not in config:
        return
    layers = config["num_hidden_layers"]
    from sgl_spec.krul.restore_cost import read_profile

    model = _value(argv, "--model-path", "--model")
    measured = read_profile(cfg.krul.profile_path)["shape"].get("num_layers")
    if measured != layers:
        raise ValueError(f"--spec-krul-profile {cfg.krul.profile_path!r} was measured for a "
                         f"model of {measured} layers; {model} has {layers}; valid: a "
                         "profile from python -m sgl_spec.calibrate restore --model-path "
                         f"{model}")


def _model_config(argv: list[str]) -> dict | None:
    """The served model's config.json, where ``--model-path`` is a local directory."""
    import json

    model = _value(argv, "--model-path", "--model")
    if not model or not os.path.isdir(model):
        return None
    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def with_decode_profile(cfg: spec_config.SpecConfig, argv: list[str], cpu: bool = True
                        ) -> spec_config.SpecConfig:
    """``cfg`` with ``min_context`` raised to where the decode profile found the sparse
    mode faster than exact on this host, or exact mode where it was faster nowhere, and
    the decision written into ``decode.decision``. ``--spec-decode-profile auto`` measures
    the profile once (``step_cost.prepare_profile``, cached); ``off`` keeps
    ``--spec-min-context``. ValueError where a given profile measured other decode flags,
    another model or KV dtype, or another device (a CPU profile on a CUDA host, a GPU's on
    a CPU one)."""
    d = cfg.decode
    if cfg.disable or d.mode == "exact":
        return cfg
    import dataclasses

    from sgl_spec.attention import step_cost

    here = "cpu" if cpu else "cuda"
    decide = lambda dc, text: dataclasses.replace(  # noqa: E731
        cfg, decode=dataclasses.replace(dc, decision=text))
    if d.profile_path == "off":
        return decide(d, f"--spec-decode-profile off: histories from --spec-min-context "
                         f"{d.min_context} decode {d.mode}")
    config = _model_config(argv)
    kv = step_cost.kv_dtype(_value(argv, "--dtype"), _value(argv, "--kv-cache-dtype"), config)
    path = d.profile_path
    if path == "auto":
        try:  # a mode that runs no sparse step on this device: nothing to measure
            step_cost.check(d, step_cost.measurable(d) or step_cost.HISTORIES, here)
        except ValueError as exc:
            return decide(d, f"--spec-decode-profile auto: not measured ({exc})")
        model = _value(argv, "--model-path", "--model")
        path = step_cost.profile_path(model, d, kv, here)
        if not os.path.exists(path):
            logger.info("--spec-decode-profile auto: measuring where %s B=%d decodes faster "
                        "than exact on this host (once; kept in %s)", d.mode, d.budget, path)
        path = step_cost.prepare_profile(model, d, kv, here)
    prof = step_cost.read_profile(path)
    measured = prof.get("device", "cpu")
    if measured != here:
        raise ValueError(f"--spec-decode-profile {path!r} was measured on {measured}; this "
                         f"host serves on {here}; valid: a profile from python -m "
                         f"sgl_spec.calibrate decode --device {here} on this host, or auto")
    try:
        shape = step_cost.shape_of(config) if config is not None else None
    except KeyError:  # not a config this check reads
        shape = None
    try:
        n = step_cost.min_context(prof, d, shape, kv)
    except ValueError as exc:
        raise ValueError(f"--spec-decode-profile {path!r}: {exc}") from None
    if n == step_cost.NEVER:  # exact mode, not a policy that never selects (nor a head)
        text = (f"{d.mode} B={d.budget} was faster than exact at no measured history (up to "
                f"{max(prof['histories'])} tokens) on this host (profile {path}): serving "
                "--spec-mode exact")
        logger.warning("--spec-decode-profile: %s", text)
        return decide(spec_config.DecodeConfig(), text)
    text = (f"{d.mode} B={d.budget} is faster than exact from {prof['crossover']} tokens on "
            f"this host (profile {path}): histories under {n} decode exactly")
    logger.info("--spec-decode-profile: %s", text)
    return decide(dataclasses.replace(d, min_context=n, profile_path=path), text)


def check_rounds(cfg: spec_config.SpecConfig, argv: list[str], cpu: bool) -> None:
    """ValueError where ``--spec-rounds`` cannot work with sglang's flags or this host."""
    if not cfg.rounds.enable:
        return
    if _given(argv, "--disable-radix-cache"):
        raise ValueError("--spec-rounds with --disable-radix-cache is not supported (stored "
                         "rounds ride the radix tree's nodes); valid: drop "
                         "--disable-radix-cache, or drop --spec-rounds")
    if (_value(argv, "--page-size") or "1") != "1":
        raise ValueError("--spec-rounds needs --page-size 1 (rounds end on any token); "
                         "valid: --page-size 1")
    if not cpu:
        raise ValueError("--spec-rounds serves on CPU hosts only so far (the tiered pool "
                         "and its attention are unverified on CUDA); valid: drop "
                         "--spec-rounds")


def check_offload(cfg: spec_config.SpecConfig, argv: list[str], cpu: bool) -> None:
    """ValueError where ``--spec-offload auto`` cannot work with sglang's flags or this
    host."""
    if cfg.disable or cfg.decode.offload == "off":
        return
    if _given(argv, "--enable-hierarchical-cache"):
        raise ValueError("--spec-offload auto with --enable-hierarchical-cache is not "
                         "supported yet (HiCache's host pool copies the device buffers by "
                         "address, which an offloaded layer changes); valid: drop one")
    if not cpu:
        raise ValueError("--spec-offload auto serves on CPU hosts only so far (sglang's CUDA "
                         "kernels would read an offloaded layer's host buffer); valid: "
                         "--spec-offload off")


def with_watershed(cfg: spec_config.SpecConfig, argv: list[str]) -> spec_config.SpecConfig:
    """``cfg`` with round mode's watershed resolved: ``--spec-round-watershed``, or the
    model's calibrated profile (measured once, progress bar, into the cache dir). A
    profile with no significant minimum, one whose selection at L_w misses the asked
    round too often (``watershed.weak_selection``), or a watershed outside the model's
    layers serves exact and says why (``rounds.decision``); a given watershed is used as
    given."""
    r = cfg.rounds
    if not r.enable:
        return cfg
    import dataclasses

    model = _value(argv, "--model-path", "--model")
    layers = (_model_config(argv) or {}).get("num_hidden_layers")
    lw, source = r.watershed, "--spec-round-watershed"
    if not lw:
        from sgl_spec.rounds import watershed

        if not os.path.exists(watershed.profile_path(model)):
            logger.info("--spec-rounds: measuring the watershed of %s (once; python -m "
                        "sgl_spec.calibrate watershed)", model)
        path = watershed.prepare(model)
        prof = watershed.load(path)
        lw, source = prof["watershed"], f"profile {path}"
        weak = watershed.weak_selection(prof, r.strategy)
        if weak:  # the selection there would lose what the questions ask for
            text = f"--spec-rounds: {weak} ({source}): serving exact"
            logger.warning("%s", text)
            return dataclasses.replace(cfg, rounds=spec_config.RoundConfig(decision=text))
    if lw is None or (layers is not None and not 1 <= lw < layers):
        text = (f"--spec-rounds: no watershed for {model} ({source}: "
                f"{'no significant minimum' if lw is None else f'L_w {lw} of {layers} layers'}"
                "): serving exact")
        logger.warning("%s", text)
        return dataclasses.replace(cfg, rounds=spec_config.RoundConfig(decision=text))
    text = (f"--spec-rounds: L_w {lw} of {layers or '?'} layers ({source}); strategy "
            f"{r.strategy}")
    logger.info("%s", text)
    return dataclasses.replace(cfg, rounds=dataclasses.replace(r, watershed=lw, decision=text))


def with_krul(cfg: spec_config.SpecConfig, argv: list[str]) -> spec_config.SpecConfig:
    """``cfg`` with Krul's statistics path filled in: the served model's, measured once
    (progress bar) into the cache dir."""
    if cfg.disable or not cfg.krul.enable or cfg.krul.stats_path:
        return cfg
    import dataclasses

    from sgl_spec.krul.calibrate import prepare

    model = _value(argv, "--model-path", "--model")
    return dataclasses.replace(
        cfg, krul=dataclasses.replace(cfg.krul, stats_path=prepare(model)))


def sglang_argv(cfg: spec_config.SpecConfig, argv: list[str], cpu: bool) -> list[str]:
    """sglang's argv with sgl_spec's defaults added where the user gave none."""
    out = list(argv)
    if not _given(out, "--model-path", "--model"):
        from sgl_spec.prepare_model import prepare

        out += ["--model-path", prepare()]
    if cpu and not _given(out, "--device"):
        out += ["--device", "cpu"]
    if cpu and not _given(out, "--max-total-tokens"):
        out += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
    if cpu and not _given(out, "--dtype") and host_cpu.default_dtype() is not None:
        logger.info("serving --dtype %s: this CPU has no native bfloat16 (AVX512-BF16 or "
                    "AMX); pass --dtype to choose", host_cpu.default_dtype())
        out += ["--dtype", host_cpu.default_dtype()]
    if not cpu and cfg.decode.retrieval_head and not _given(out, "--disable-cuda-graph"):
        out.append("--disable-cuda-graph")
    if not _given(out, "--attention-backend"):
        if not cfg.disable:
            out += ["--attention-backend", NAME]
        elif cpu:
            out += ["--attention-backend", "torch_native"]
    if (
        not cfg.disable
        and not _given(out, "--radix-cache-backend")
        and not _given(out, "--disable-radix-cache")
    ):
        out += ["--radix-cache-backend", NAME]
    return out


def _start_up_logging(argv: list[str]) -> None:
    """sgl_spec's start-up decisions (dtype, decode profile, head, statistics) printed at
    sglang's ``--log-level``, in sglang's format: they come before sglang configures
    its logging."""
    level = (_value(argv, "--log-level") or "info").upper()
    log = logging.getLogger("sgl_spec")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False  # sglang's root handler, once configured, would print it twice
    log.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")


def resolve(cfg: spec_config.SpecConfig, argv: list[str], cpu: bool) -> spec_config.SpecConfig:
    """Checks against sglang's flags, then what the flags leave to be prepared, in the
    order each needs the last: the retrieval head before the decode profile that runs it.
    ValueError names what is wrong."""
    check_krul_profile(cfg, argv)
    check_rounds(cfg, argv, cpu)
    check_offload(cfg, argv, cpu)
    cfg = with_head(cfg, argv)
    cfg = with_decode_profile(cfg, argv, cpu=cpu)
    return with_watershed(cfg, argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _start_up_logging(argv)
    from sgl_spec.boot import cuda_host
    from sgl_spec.integration import plugin, server

    if "-h" in argv or "--help" in argv:
        plugin.register()
        server.print_help(PROG, spec_config.add_cli_args)
        return
    cfg, rest = split_argv(argv)  # bad --spec-* flags fail before sglang loads
    try:
        check_krul(cfg, rest)
    except ValueError as exc:
        _spec_parser().error(str(exc))
    plugin.register()  # makes "sgl_spec" a valid --attention-backend choice
    cpu = not cuda_host()
    argv = sglang_argv(cfg, rest, cpu=cpu)
    if cpu:
        from sgl_spec.integration.cpu.threads import set_default_bind

        set_default_bind(argv)  # else --dp-size 2 dies on a one-node CPU
    try:
        cfg = resolve(cfg, argv, cpu)
    except ValueError as exc:
        _spec_parser().error(str(exc))
    cfg = with_krul(cfg, argv)
    os.environ[envs.SGLSPEC_CONFIG] = cfg.to_json()
    if cfg.check_invariants:  # sglang's busy check, which sgl_spec's joins
        os.environ.setdefault(envs.SGLANG_STRICT_BUSY_CHECK, "1")
    server.serve(argv, add_route=not cfg.disable)


if __name__ == "__main__":
    main()
