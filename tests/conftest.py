"""Shared fixtures: real sglang servers started once per test session (launched
right after collection, so they boot while the unit tests run).

With ``SGLSPEC_TEST_BLOCK_SGLANG=1`` every ``import sglang...`` in this process fails
(``tests/test_no_sglang.py`` runs the sglang-free modules' tests that way).
"""

from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest


class _BlockSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            raise ImportError(f"sglang is blocked in this test process ({fullname})")
        return None


if os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG") == "1":
    sys.meta_path.insert(0, _BlockSglang())

from sgl_spec import cpu as host_cpu
from sgl_spec.bench import configset
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess
from sgl_spec.head.train import TrainConfig
from sgl_spec.krul.calibrate import CalibrationConfig, stats_path
from sgl_spec.train_head import head_dir, is_prepared

# SGLang's own test files, where a user put them (tests/upstream/SOURCES.md), are run by
# python -m sgl_spec.integration.upstream_tests, not by this suite.
collect_ignore = ["upstream"]

# Flags both servers share (the benchmarks' own), so that only the sgl_spec
# components differ; idle schedulers sleep so two servers leave the 2 cores free.
# A KV pool of 8192 tokens (the model's window) rather than the benchmarks' 32768: up to
# ten servers are up at once, each 8k tokens of pool is 0.38 GB in float32, and a HiCache
# server starts only where 10 GiB of host memory stay free (sglang's reserve).
TEST_POOL = 8192
# sglang sizes a CPU pool from the memory free when its server profiles, less a slack of
# (1 - mem_fraction_static) of the memory free before the weights (0.716 by default): with
# ten float32 servers booting at once (a host without native bfloat16) that left one a
# pool of 669 tokens. A small slack keeps TEST_POOL, which the free memory holds.
COMMON_FLAGS = [*configset.COMMON_FLAGS, "--sleep-on-idle", "--mem-fraction-static", "0.95"]
COMMON_FLAGS[COMMON_FLAGS.index("--max-total-tokens") + 1] = str(TEST_POOL)
# Every shared sgl_spec server checks its KV slots and per-request structures after each
# step (GET /sgl_spec/cache -> invariants); tests read the counts.
SPEC_CHECKS = ["--spec-check-invariants"]
# The sparse-path servers decode sparse wherever --spec-min-context says (what their tests
# test), not where a first-start measurement on a busy CI machine says it pays: the
# fallback (--spec-decode-profile auto, the default) has its own test.
SPARSE_ALWAYS = ["--spec-decode-profile", "off"]


@pytest.fixture(scope="session")
def tok():
    """A deterministic word-level stand-in for an HF tokenizer."""
    from _tokenizers import WordTokenizer

    return WordTokenizer()


@pytest.fixture(scope="session")
def hf_tok(model_path):
    """The default model's real tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def model_path() -> str:
    from sgl_spec.prepare_model import prepare

    return prepare()


LONG_MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="session")
def long_model_path() -> str:
    """The opt-in long-context model's directory; the test is skipped where it is not
    prepared (CI never prepares it)."""
    from sgl_spec.prepare_model import is_prepared, model_dir

    path = model_dir(model=LONG_MODEL)
    if not is_prepared(path):
        pytest.skip(f"needs python -m sgl_spec.prepare_model --model {LONG_MODEL}")
    return path


@pytest.fixture(scope="session")
def long_tok(long_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(long_model_path)


def _log_path(tmp_path_factory, name: str) -> str:
    return os.path.join(str(tmp_path_factory.mktemp("logs")), f"{name}.log")


# ---- the session's shared servers ------------------------------------------------
# Built by name; launched as soon as collection shows a selected test needs them
# (pytest_collection_finish), so that they boot (~40 s each on 2 cores, mostly
# single-threaded imports) while the unit tests run, which go first (below).

def _spec_flags(model_path: str) -> list[str]:
    """sgl_spec.launch_server, exact mode, with the sgl_spec defaults."""
    return ["--model-path", model_path, *COMMON_FLAGS, *SPEC_CHECKS]


def _stock_flags(model_path: str) -> list[str]:
    """Stock sglang.launch_server with torch_native attention (what CPU users run)."""
    return ["--model-path", model_path, *configset.LAUNCHERS["stock"].flags, *COMMON_FLAGS]


def _loopserve_flags(model_path: str) -> list[str]:
    """LoopServe for the decode and the prefill tests: decode budget 4096 from context
    0, so every history is covered and decode is exact mode's token for token; sparse
    prefill of extends from 600 tokens at the default alpha (the paper's 0.955 loses
    planted facts on this 135M model), so shorter prompts prefill exactly."""
    return ["--model-path", model_path, *COMMON_FLAGS, *SPEC_CHECKS,
            *SPARSE_ALWAYS, "--spec-mode", "loopserve", "--spec-budget", "4096",
            "--spec-min-context", "0",
            "--spec-prefill", "loopserve", "--spec-prefill-min-tokens", "600"]


SMALL_BUDGET_MIN = 256  # the small-budget loopserve server's sparse decode and prefill floor


def _small_budget_flags(model_path: str) -> list[str]:
    """LoopServe at a small budget (64, nd 16) from 256 tokens of history, seeded by the
    prompt (--spec-prompt-seed), with --spec-sparse-kv-cache drop, and sparse prefill of
    extends from 256 new tokens: the sparse-decode tests' long prompts and the abort
    storm's requests take both paths, their short probes neither."""
    return ["--model-path", model_path, *COMMON_FLAGS, *SPEC_CHECKS, *SPARSE_ALWAYS,
            "--spec-mode", "loopserve", "--spec-budget", "64", "--spec-prompt-seed",
            "--spec-min-context", str(SMALL_BUDGET_MIN), "--enable-metrics",
            "--spec-sparse-kv-cache", "drop",
            "--spec-prefill", "loopserve", "--spec-prefill-min-tokens", str(SMALL_BUDGET_MIN)]


SPECONTEXT_BUDGET = 64


def _head(model_path: str) -> str:
    """The quick form of the head, trained once into the cache dir like a user's default
    head (reused by later runs), in a subprocess: this runs in the launch thread, beside
    the unit tests (no imports here: they would change sys.modules under pytest)."""
    out = head_dir(model_path, TrainConfig.quick())
    if not is_prepared(out):
        subprocess.run([sys.executable, "-m", "sgl_spec.train_head", "--model-path", model_path,
                        "--out", out, "--quick"], check=True, capture_output=True, timeout=600)
    return out


def krul_stats(model_path: str) -> str:
    """The quick form of the model's attention statistics (Krul's), measured once into the
    cache dir (reused by later runs), in a subprocess: this runs in the launch thread,
    beside the unit tests (no imports here: they would change sys.modules under pytest)."""
    out = stats_path(model_path, CalibrationConfig.quick())
    if not os.path.exists(out):
        subprocess.run([sys.executable, "-m", "sgl_spec.calibrate", "strategy", "--quick",
                        "--model-path", model_path, "--out", out],
                       check=True, capture_output=True, timeout=600)
    return out


def _specontext_flags(model_path: str) -> list[str]:
    """SpeContext from 256 tokens of history; a pool that holds one ~1000-token request
    and a half, with HiCache (tests evict prompts to the host tier)."""
    return ["--model-path", model_path, *COMMON_FLAGS, *SPEC_CHECKS,
            *SPARSE_ALWAYS, "--spec-mode", "specontext", "--spec-draft-path", _head(model_path),
            "--spec-budget", str(SPECONTEXT_BUDGET), "--spec-min-context", "256",
            "--enable-metrics", "--max-total-tokens", "1400",
            "--enable-hierarchical-cache", "--hicache-ratio", "2"]


# --spec-offload auto's device KV budget for the offload server: in bfloat16 the staging
# rows (SPECONTEXT_BUDGET) and ~600 tokens at every layer, so a ~1000-token prompt moves
# about a third of the layers to the host; twice the bytes where the CPU serves float32
# (sgl_spec.cpu.default_dtype), which doubles every row, so the same layers move.
OFFLOAD_ELEMENT_BYTES = 4 if host_cpu.default_dtype() == "float32" else 2
OFFLOAD_KV_BYTES = 13_225_000 * OFFLOAD_ELEMENT_BYTES


def _offload_flags(model_path: str) -> list[str]:
    """The SpeContext server's flags with its layers offloaded past OFFLOAD_KV_BYTES (no
    HiCache: offload refuses it), in a pool whose slots hold a long request on both tiers."""
    flags = _specontext_flags(model_path)
    flags = flags[:len(flags) - flags[::-1].index("--max-total-tokens") - 1]
    return [*flags, "--max-total-tokens", "4000", "--spec-offload", "auto",
            "--spec-offload-kv-bytes", str(OFFLOAD_KV_BYTES)]


class Early(NamedTuple):
    """A shared server: ``flags(model_path)`` may prepare what the flags name (a head,
    statistics), in subprocesses only and importing nothing (it runs in the launch
    thread, beside the unit tests: an import there changes sys.modules while pytest
    iterates it); ``env(model_path)`` adds environment variables; ``early_dir(name)``
    holds what the server writes (storage)."""

    module: str
    flags: Callable[[str], list[str]]
    env: Callable[[str], dict[str, str]] | None = None
    prepares: bool = False  # flags() trains or measures something first: launched last
    # HiCache: its host pool is sized from the host memory free at its start, so these
    # go one at a time, before the others fill the memory
    host_tier: bool = False
    # not launched with the unit tests (ten float32 servers at once already fill the
    # memory) but when the module before its first test starts, once the module-scoped
    # servers of the modules before that have stopped: it boots while that module runs
    lazy: bool = False
    timeout_s: float = 240.0  # from launch to healthy (a first start that measures: more)

    def server(self, model_path: str, log_path: str | None = None) -> ServerProcess:
        env = self.env(model_path) if self.env else None
        return ServerProcess(self.module, self.flags(model_path), log_path=log_path, env=env,
                             timeout_s=self.timeout_s)


EARLY_SERVERS: dict[str, Early] = {  # fixture name -> Early; modules add theirs
    "spec_server": Early(SPEC, _spec_flags),
    "stock_server": Early(STOCK, _stock_flags),
    "loopserve_server": Early(SPEC, _loopserve_flags),
    "small_budget_server": Early(SPEC, _small_budget_flags),
    "specontext_server": Early(SPEC, _specontext_flags, prepares=True, host_tier=True),
    "offload_server": Early(SPEC, _offload_flags, prepares=True),
}
_launched: dict[str, ServerProcess] = {}
_lazy_at: dict[str, list[str]] = {}  # node id -> the lazy servers launched as it starts
_model: list[str] = []
_logs: list[Path] = []  # the session's server logs' directory
_launch_failed: dict[str, BaseException] = {}
_launching: dict[str, threading.Event] = {}
_base_dir: list[Path] = []
_session_over = threading.Event()


def early_dir(name: str) -> Path:
    """A directory of the session for the shared server ``name`` (its head, statistics,
    storage), the same on every call."""
    if not _base_dir:
        _base_dir.append(Path(tempfile.mkdtemp(prefix="sgl-spec-early-")))
    d = _base_dir[0] / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def early_server(name: str, model_path: str):
    """For a fixture named ``name`` in EARLY_SERVERS, of any scope: the server launched
    after collection (or now, if it was not), healthy; stopped when the fixture ends."""
    if name in _launching:
        _launching[name].wait()
    if name in _launch_failed:
        raise RuntimeError(f"the shared server {name} could not be launched") \
            from _launch_failed.pop(name)
    with _launched.pop(name, None) or EARLY_SERVERS[name].server(model_path) as server:
        _timeline(server=name, event="healthy")
        yield server
        _assert_invariants_held(server)


def _assert_invariants_held(server: ServerProcess) -> None:
    """A shared server that ran with --spec-check-invariants found no violation in any
    test that used it."""
    import requests

    if "--spec-check-invariants" not in server.args or server.proc.poll() is not None:
        return
    key = server.args[server.args.index("--api-key") + 1] if "--api-key" in server.args else None
    state = requests.get(server.url + "/sgl_spec/cache", timeout=60,
                         headers={"Authorization": f"Bearer {key}"} if key else None).json()
    inv = state["invariants"]
    assert inv["checks"] > 0 and inv["violations"] == 0, inv


# Node ids of the sglang-free modules' unit tests that the main run leaves to
# test_no_sglang (which runs them in a process without sglang): run once, not twice.
NO_SGLANG_RUN = "tests/test_no_sglang.py::test_their_unit_tests_pass_without_sglang"
BLOCKED_ONLY: list[str] = []


def pytest_collection_modifyitems(config, items):
    """Unit tests first, then the tests that start servers (``_by_server_boot``), then
    those marked ``alone``: the shared servers boot during the first group, and the
    module-scoped ones have stopped before the last (ten float32 servers and one more
    fill 24 GiB). Where test_no_sglang's run is selected, the tests it runs without
    sglang are left out here (``BLOCKED_ONLY``)."""
    _by_server_boot(items)
    if not os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG") and any(
            i.nodeid == NO_SGLANG_RUN for i in items):
        from test_no_sglang import runs_without_sglang

        moved = [i for i in items if runs_without_sglang(i)]
        if moved:
            BLOCKED_ONLY[:] = [i.nodeid for i in moved]
            config.hook.pytest_deselected(items=moved)
            items[:] = [i for i in items if not runs_without_sglang(i)]


def _launch_order() -> dict[str, int]:
    """The shared servers in the order the launch thread boots them: HiCache ones first
    (one at a time, each healthy before the next), those that prepare something last."""
    early = [n for n in EARLY_SERVERS if not EARLY_SERVERS[n].lazy]
    names = sorted(early, key=lambda n: (not EARLY_SERVERS[n].host_tier,
                                         EARLY_SERVERS[n].prepares))
    return {name: i for i, name in enumerate(names)}


def _by_server_boot(items) -> None:
    """Sort in place: unit tests, then server-test modules in the order their shared
    servers boot (a module by the last of them it uses, so it starts once they are all
    up; modules with servers of their own after those), then ``alone``, then ``heavy``
    (the abort storm: the fallback server's first-start measurement, whose time its test
    bounds, then runs without three storms beside it). A module's tests stay together
    and in their order."""
    order = _launch_order()
    rank: dict[str, int] = {}
    for item in items:
        used = [order[n] for n in getattr(item, "fixturenames", ()) if n in order]
        mod = item.nodeid.split("::")[0]
        rank[mod] = max(rank.get(mod, -1), *used, -1)
    last = len(order)
    items.sort(key=lambda item: (
        item.get_closest_marker("server") is not None,
        item.get_closest_marker("heavy") is not None,
        item.get_closest_marker("alone") is not None,
        r if (r := rank[item.nodeid.split("::")[0]]) >= 0 else last))


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG"):
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    wanted = [name for name in EARLY_SERVERS if name in used]
    if not wanted:
        return
    from sgl_spec.prepare_model import prepare

    model = prepare()
    _model.append(model)
    logs = session.config._tmp_path_factory.mktemp("logs")
    _logs.append(logs)
    _plan_lazy(session.items, [n for n in wanted if EARLY_SERVERS[n].lazy])
    wanted = [n for n in wanted if not EARLY_SERVERS[n].lazy]
    if not _base_dir:
        _base_dir.append(session.config._tmp_path_factory.mktemp("early"))
    order = _launch_order()
    wanted.sort(key=order.__getitem__)
    for name in wanted:
        _launching[name] = threading.Event()

    def launch_all():  # HiCache first, one at a time, then those that prepare nothing (a
        # preparation delays only later ones)
        for name in wanted:
            try:
                server = EARLY_SERVERS[name].server(model, log_path=str(logs / f"{name}.log"))
                _launched[name] = server.launch()
                _timeline(server=name, event="launch")
                if EARLY_SERVERS[name].host_tier:  # its host pool is sized once it is up:
                    server.wait_healthy()  # the next ones may take the memory it checked
            except BaseException as exc:  # re-raised by the fixture that needs it
                _launch_failed[name] = exc
            finally:
                _launching[name].set()
        # Servers die with the thread that started them (PR_SET_PDEATHSIG): stay.
        _session_over.wait()

    threading.Thread(target=launch_all, name="early-servers", daemon=True).start()


def _plan_lazy(items, names: list[str]) -> None:
    """Each lazy server launches as the first test of the module before its first user
    starts (``pytest_runtest_setup``), passing over modules that are themselves a lazy
    server's first user (two lazy servers in a row boot together); a first user at the
    very start launches it there."""
    mod = [it.nodeid.split("::")[0] for it in items]
    firsts = {name: next(i for i, it in enumerate(items)
                         if name in getattr(it, "fixturenames", ())) for name in names}
    lazy_mods = {mod[i] for i in firsts.values()}
    for name, at in firsts.items():
        while at > 0 and (mod[at - 1] == mod[at] or mod[at] in lazy_mods):
            at -= 1
        _lazy_at.setdefault(items[at].nodeid, []).append(name)


# SGLSPEC_TEST_TIMELINE=FILE: each test's phases with wall-clock start and end, and the
# shared servers' launch and healthy times, as JSON lines (where the suite's time goes).
_TIMELINE = os.environ.get("SGLSPEC_TEST_TIMELINE")


def _timeline(**rec) -> None:
    if _TIMELINE:
        import json
        import time

        with open(_TIMELINE, "a") as f:
            f.write(json.dumps({"t": round(time.time(), 2), **rec}) + "\n")


def _sample_load() -> None:
    while True:
        with open("/proc/loadavg") as f:
            _timeline(load1=float(f.read().split()[0]))
        _session_over.wait(10)
        if _session_over.is_set():
            return


if _TIMELINE and os.path.exists("/proc/loadavg") and not os.environ.get(
        "SGLSPEC_TEST_BLOCK_SGLANG"):
    threading.Thread(target=_sample_load, name="load-sampler", daemon=True).start()


def pytest_runtest_logreport(report):
    _timeline(test=report.nodeid, phase=report.when, s=round(report.duration, 2))


def pytest_runtest_setup(item):
    for name in _lazy_at.pop(item.nodeid, ()):
        if name not in _launched:
            log = _logs[0] / f"{name}.log" if _logs else None
            _launched[name] = EARLY_SERVERS[name].server(_model[0], log_path=log and
                                                         str(log)).launch()
            _timeline(server=name, event="launch")


def pytest_sessionfinish(session):
    for event in _launching.values():
        event.wait(timeout=600)
    _session_over.set()
    for server in _launched.values():  # launched, never used (their tests failed early)
        server.stop()


@pytest.fixture(scope="session")
def spec_server(model_path):
    """sgl_spec.launch_server, exact mode, with the sgl_spec defaults."""
    yield from early_server("spec_server", model_path)


@pytest.fixture(scope="session")
def stock_server(model_path):
    """Stock sglang.launch_server with torch_native attention (what CPU users run)."""
    yield from early_server("stock_server", model_path)


@pytest.fixture(scope="session")
def loopserve_server(model_path):
    """One LoopServe server for the sparse decode and prefill tests (_loopserve_flags)."""
    yield from early_server("loopserve_server", model_path)


@pytest.fixture(scope="session")
def small_budget_server(model_path):
    """LoopServe at a small budget with sparse prefill (_small_budget_flags), for the
    sparse-decode tests and the abort storm's."""
    yield from early_server("small_budget_server", model_path)


@pytest.fixture(scope="session")
def specontext_server(model_path):
    """SpeContext with the quick head (_specontext_flags), for its tests and the storm's."""
    yield from early_server("specontext_server", model_path)


@pytest.fixture(scope="session")
def offload_server(model_path):
    """SpeContext with its layers offloaded past a device KV budget (_offload_flags)."""
    yield from early_server("offload_server", model_path)
