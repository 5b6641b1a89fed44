"""Shared fixtures: real sglang servers started once per test session (launched
right after collection, so they boot while the unit tests run).

With ``SGLSPEC_TEST_BLOCK_SGLANG=1`` every ``import sglang...`` in this process fails
(``tests/test_no_sglang.py`` runs the sglang-free modules' tests that way).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import pytest


class _BlockSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            raise ImportError(f"sglang is blocked in this test process ({fullname})")
        return None


if os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG") == "1":
    sys.meta_path.insert(0, _BlockSglang())

from sgl_spec.bench import configset
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess

# Flags both servers share (the benchmarks' own), so that only the sgl_spec
# components differ; idle schedulers sleep so two servers leave the 2 cores free.
COMMON_FLAGS = [*configset.COMMON_FLAGS, "--sleep-on-idle"]


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
    return ["--model-path", model_path, *COMMON_FLAGS]


def _stock_flags(model_path: str) -> list[str]:
    """Stock sglang.launch_server with torch_native attention (what CPU users run)."""
    return ["--model-path", model_path, *configset.LAUNCHERS["stock"].flags, *COMMON_FLAGS]


def _loopserve_flags(model_path: str) -> list[str]:
    """LoopServe for the decode and the prefill tests: decode budget 4096 from context
    0, so every history is covered and decode is exact mode's token for token; sparse
    prefill of extends from 600 tokens at alpha 0.98 (the paper's 0.955 loses planted
    facts on this 135M model), so shorter prompts prefill exactly."""
    return ["--model-path", model_path, *COMMON_FLAGS,
            "--spec-mode", "loopserve", "--spec-budget", "4096", "--spec-min-context", "0",
            "--spec-prefill", "loopserve", "--spec-prefill-min-tokens", "600",
            "--spec-prefill-alpha", "0.98"]


EARLY_SERVERS = {  # fixture name -> (launcher, flags(model_path)); modules add theirs
    "spec_server": (SPEC, _spec_flags),
    "stock_server": (STOCK, _stock_flags),
    "loopserve_server": (SPEC, _loopserve_flags),
}
_launched: dict[str, ServerProcess] = {}


def early_server(name: str, model_path: str):
    """For a fixture named ``name`` in EARLY_SERVERS, of any scope: the server launched
    after collection (or now, if it was not), healthy; stopped when the fixture ends."""
    module, flags = EARLY_SERVERS[name]
    with _launched.pop(name, None) or ServerProcess(module, flags(model_path)) as server:
        yield server


def pytest_collection_modifyitems(items):
    """Unit tests first, then the tests that start servers (each group in its
    collected order): the shared servers boot during the first group."""
    items.sort(key=lambda item: item.get_closest_marker("server") is not None)


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG"):
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    wanted = [name for name in EARLY_SERVERS if name in used]
    if wanted:
        from sgl_spec.prepare_model import prepare

        model = prepare()
        logs = session.config._tmp_path_factory.mktemp("logs")
        for name in wanted:
            module, flags = EARLY_SERVERS[name]
            _launched[name] = ServerProcess(module, flags(model),
                                            log_path=str(logs / f"{name}.log")).launch()


def pytest_sessionfinish(session):
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
